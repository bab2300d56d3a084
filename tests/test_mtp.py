"""Qwen3.5's MTP head as a drafter: the head against a torch reference and llama.cpp, the target's
tapped hidden states against transformers, and speculation with it (lossless greedy, drafting
that follows the hidden states it is paired with).

The parity checkpoint is the tiny random `mtp_attn2_untied` (tiny_models.MTP_CONFIGS), converted
with its MTP layer by our converter (which test_convert.py holds byte-identical to llama.cpp's).
The speculation tests use tiny-vocabulary models with an MTP layer (tiny_vocab.TinyShape.mtp).
The exact-marginal test of sampled output is in test_speculative_sampling.py ("mtp-*" cases).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from deltaspec import Model  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.testing.tiny_models import tiny_model_dir  # noqa: E402
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TOL = 2e-3     # max |logit difference| (f32 weights and KV cache; logits have std ~3)
PEER_TOL = 5e-3  # the same against llama.cpp, whose CPU kernels round differently (measured 3.6e-3)
N_ROWS = 40    # (token, hidden) rows fed to the MTP heads
CHUNK = 17     # our head gets the rows in chunks of this many: later rows read the KV cache


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """(Model with MTP, HF target, checkpoint folder, token ids, the target's normed final hidden
    state at every position, from transformers)."""
    hf_dir = tiny_model_dir("mtp_attn2_untied")
    path = tmp_path_factory.mktemp("mtp") / "mtp-f32.gguf"
    convert_hf_to_gguf(hf_dir, path, outtype="f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = Model(path, n_ctx=256, n_ubatch=16, type_k="f32", type_v="f32")
    ids = np.random.default_rng(3).integers(0, 248000, size=N_ROWS).tolist()
    with torch.no_grad():
        hidden = hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    yield model, hf, hf_dir, ids, hidden
    model.close()


def mtp_rows(ids: list[int], hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs the head reads: token p with the target's hidden state at p - 1 (zeros at p = 0)."""
    prev = np.concatenate([np.zeros_like(hidden[:1]), hidden[:-1]])
    return np.asarray(ids, np.int32), prev.astype(np.float32)


def ours(model: Model, tokens: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our head's logits and output hidden for the rows, fed in chunks of CHUNK."""
    engine = model._engine
    engine.mtp_reset()
    parts = [engine.mtp_eval(tokens[i:i + CHUNK], hidden[i:i + CHUNK]) for i in range(0, len(tokens), CHUNK)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def torch_mtp(hf, hf_dir: Path, tokens: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MTP block written from the checkpoint's mtp.* weights: zero-centred RMSNorms (1 + w),
    fc over [norm(embedding) | norm(hidden)], transformers' own Qwen3.5 decoder layer (gated full
    attention + SwiGLU, causal, positions 0..T-1), the final norm and the target's LM head."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    sd = safetensors_torch.load_file(hf_dir / "model.safetensors")
    cfg = hf.config
    layer_cfg = cfg.__class__(**{**cfg.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
    layer_cfg._attn_implementation = "eager"
    layer = Qwen3_5DecoderLayer(layer_cfg, 0).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in sd.items() if k.startswith("mtp.layers.0.")})
    eps = cfg.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    T = len(tokens)
    with torch.no_grad():
        e = hf.model.embed_tokens(torch.tensor(tokens[None], dtype=torch.long))
        h = torch.from_numpy(hidden[None])
        x = torch.cat([norm(e, sd["mtp.pre_fc_norm_embedding.weight"]), norm(h, sd["mtp.pre_fc_norm_hidden.weight"])], -1)
        x = x @ sd["mtp.fc.weight"].T
        pos = torch.arange(T)[None]
        pe = hf.model.rotary_emb(x, pos[None].expand(3, 1, T))
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=pe, attention_mask=mask)
        x = out[0] if isinstance(out, tuple) else out
        h_out = norm(x, sd["mtp.norm.weight"])
        return hf.lm_head(h_out)[0].numpy(), h_out[0].numpy()


def test_taps_match_transformers(parity):
    """Taps return each row's decoder-layer outputs and final normed hidden state as transformers
    computes them, across micro-batches (n_ubatch 16 < 40 rows); keep(n) drops a verify batch's
    untaken rows. Seen to fail: tapping x before the layer's FFN residual add put layer 2's rows
    up to 2.5 off; tapping the final hidden state before output_norm, up to 5.6."""
    model, hf, _, ids, hidden = parity
    engine = model._engine
    n_layer = model.hparams.n_layer
    engine.set_taps([2, n_layer])
    try:
        model.logits(ids)
        got = engine.tapped
        assert got.shape == (len(ids), 2, model.hparams.n_embd) and engine.tapped_pos == 0
        with torch.no_grad():
            layers = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(got[:, 0], layers[3][0].numpy(), atol=1e-3, rtol=1e-3)
        np.testing.assert_allclose(got[:, 1], hidden, atol=1e-3, rtol=1e-3)

        engine.clear_tapped()
        engine.reserve_slots(4)
        engine.reset()
        engine.eval(np.asarray(ids[:10], np.int32))
        engine.clear_tapped()  # rows from position 10 on
        engine.eval_verify(np.asarray(ids[10:14], np.int32))
        engine.keep(2)
        assert engine.tapped_pos == 10 and engine.tapped.shape[0] == 2
        np.testing.assert_allclose(engine.tapped[:, 1], hidden[10:12], atol=1e-3, rtol=1e-3)
    finally:
        engine.set_taps([])


def test_mtp_head_matches_torch_reference(parity):
    """Our head's logits and output hidden equal the torch reference written above from the
    checkpoint's weights, row by row, for rows fed in chunks (each chunk attends to the KV rows
    the earlier ones wrote). The power check below: the same rows with the hidden states paired
    one position late (token p with h_p, a drafter's classic off-by-one) must differ. Seen to fail:
    with graph_mtp.cpp concatenating [hidden | embedding] (the order flipped), the output hidden
    was up to 5.2 off."""
    model, hf, hf_dir, ids, hidden = parity
    tokens, prev = mtp_rows(ids, hidden)
    logits, h_out = ours(model, tokens, prev)
    ref_logits, ref_h = torch_mtp(hf, hf_dir, tokens, prev)
    assert ref_logits.std(-1).min() > 0.5 and len(set(ref_logits.argmax(-1).tolist())) > 10
    np.testing.assert_allclose(h_out, ref_h, atol=1e-3, rtol=1e-3)
    assert np.abs(logits - ref_logits).max() < TOL
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()

    shifted, _ = ours(model, tokens, hidden.astype(np.float32))
    assert np.abs(shifted - ref_logits).max() > 0.5


@pytest.mark.peer
def test_mtp_head_matches_llama_cpp(parity, tmp_path):
    """llama.cpp's own MTP graph (an MTP context of the pinned tree's libllama, driven by
    tests/peer_tools/llama_mtp_logits.cpp) on the same GGUF and the same (token, hidden) rows, fed
    in chunks of 5: the same logits and output hidden state (h_nextn) as our head. Seen to fail:
    with our concat order flipped in graph_mtp.cpp (hidden first), h_nextn was up to 5.2 off."""
    model, _, _, ids, hidden = parity
    tool = _build_harness(tmp_path)
    tokens, prev = mtp_rows(ids, hidden)
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(inp, "wb") as f:
        f.write(np.array([len(tokens), prev.shape[1]], np.int32).tobytes())
        f.write(tokens.tobytes())
        f.write(prev.tobytes())
    proc = subprocess.run([str(tool), model.path, str(inp), str(out), "5"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    raw = np.fromfile(out, np.float32)
    T, E, V = len(tokens), prev.shape[1], model.n_vocab
    peer_logits, peer_h = raw[:T * V].reshape(T, V), raw[T * V:].reshape(T, E)
    logits, h_out = ours(model, tokens, prev)
    np.testing.assert_allclose(h_out, peer_h, atol=1e-3, rtol=1e-3)
    assert np.abs(logits - peer_logits).max() < PEER_TOL
    assert (logits.argmax(-1) == peer_logits.argmax(-1)).all()


def _build_harness(tmp_path: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from bench.peers.llama_cpp import build_llama_cpp, upstream_tree

    bin_dir = build_llama_cpp(quiet=True)
    tree = upstream_tree()
    tool = tmp_path / "llama_mtp_logits"
    cmd = ["c++", "-std=c++17", "-O1", f"-I{tree / 'include'}", f"-I{tree / 'src'}", f"-I{tree / 'ggml' / 'include'}",
           str(REPO / "tests" / "peer_tools" / "llama_mtp_logits.cpp"), f"-L{bin_dir}", "-lllama", "-lggml",
           "-lggml-base", f"-Wl,-rpath,{bin_dir}", "-o", str(tool)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return tool


# --- speculation -----------------------------------------------------------------------------


def _greedy_pair(model: Model, prompt: list[int], n: int, **spec):
    plain = model.generate(prompt, max_tokens=n, temperature=0)
    fast = model.generate(prompt, max_tokens=n, temperature=0, spec_type="mtp", **spec)
    return plain, fast


def test_oracle_mtp_drafts_are_all_accepted():
    """A target whose next token depends on the current one only (branch_scale 0) and an MTP head
    that computes exactly that (its hidden input weighted 0): every draft is the target's own next
    token, so every draft is accepted, in chains of 3. This is what shows the drafter runs the
    head on the right token at the right step. Seen to fail: feeding draft i's predecessor instead
    of draft i into step i + 1 accepted 19 of 39 drafts in the first run."""
    with Model(tiny_vocab_model_path(branch_scale=0.0, mtp=True), n_ctx=256, n_threads=1) as m:
        drafted = 0
        for start in (72, 101, 33):
            plain, fast = _greedy_pair(m, [start, 104, 105], 40, draft_n_max=3, draft_n_min=1)
            assert fast.tokens == plain.tokens
            assert fast.stats.n_drafted > 20 and fast.stats.n_accepted == fast.stats.n_drafted
            drafted += fast.stats.n_drafted
        assert drafted > 60


def test_greedy_mtp_is_lossless():
    """Speculation with a random MTP head on a random target (drafts mostly rejected, some
    accepted) gives exactly plain greedy output; drafting happened in every run (draft_n_min 1
    keeps it drafting)."""
    with Model(tiny_vocab_model_path(mtp=True, mtp_hidden_scale=1.0), n_ctx=256, n_threads=1) as m:
        rng = np.random.default_rng(11)
        for _ in range(6):
            prompt = rng.integers(0, 256, size=rng.integers(2, 20)).tolist()
            plain, fast = _greedy_pair(m, prompt, 32, draft_n_max=4, draft_n_min=1)
            assert fast.tokens == plain.tokens and fast.finish_reason == plain.finish_reason
            assert fast.stats.n_drafted > 0


def test_drafts_follow_the_target_hidden_states():
    """With one draft a round, greedy runs accept exactly the drafts a Python replay predicts: each
    round's draft is the argmax of the head run over every committed (token p, target hidden at
    p - 1) pair, the hidden states tapped from one target pass over the final text. The head here
    leans on its hidden input and its attention (mtp_hidden_scale 0.5, mtp_branch_scale 1), so a
    drafter that writes its KV rows from the wrong pairs accepts other drafts. Seen to fail:
    pairing each catch-up row but the last with the hidden state of its own position (not the one
    before) accepted 5 where the replay predicts 3 (the second prompt)."""
    path = tiny_vocab_model_path(branch_scale=0.0, mtp=True, mtp_hidden_scale=0.5, mtp_branch_scale=1.0)
    n = 60
    with Model(path, n_ctx=256, n_threads=1) as m:
        engine = m._engine
        for prompt in ([72, 101, 108, 108, 111], [33, 40, 50], [1, 2, 3]):
            plain, fast = _greedy_pair(m, prompt, n, draft_n_max=1, draft_n_min=1)
            assert fast.tokens == plain.tokens
            text = prompt + plain.tokens
            engine.set_taps([m.hparams.n_layer])
            try:
                m.logits(text)
                hidden = engine.tapped[:, 0]
            finally:
                engine.set_taps([])
            expected, length = 0, len(prompt) + 1  # the first token comes from the prefill
            while n - (length - len(prompt)) >= 2:  # a round drafts while 2 tokens are left to generate
                tokens, prev = mtp_rows(text[:length], hidden[:length])
                engine.mtp_reset()
                draft = int(engine.mtp_eval(tokens, prev)[0][-1].argmax())
                hit = draft == text[length]
                expected += hit
                length += 2 if hit else 1
            print(prompt, "accepted", fast.stats.n_accepted, "replay", expected, "drafted", fast.stats.n_drafted)
            assert fast.stats.n_drafted > 30
            assert fast.stats.n_accepted == expected


def test_mtp_needs_an_mtp_layer():
    with Model(tiny_vocab_model_path(), n_ctx=64, n_threads=1) as m:
        assert not m._engine.has_mtp
        with pytest.raises(ValueError, match="no MTP layer"):
            m.generate([1, 2], max_tokens=4, spec_type="mtp")
        with pytest.raises(ValueError, match="own MTP head"):
            m.generate([1, 2], max_tokens=4, spec_type="draft-mtp", draft_model=m)
