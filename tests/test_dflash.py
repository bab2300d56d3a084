"""The DFlash block drafter against the z-lab `dflash` package's torch DFlashDraftModel.

Tiny random drafters, f32, for the tiny-vocabulary qwen35 target (fast), whose features are given
directly. (The testbed's llama.cpp-converted drafter with features that deltaspec's target taps
itself is tested in test_testbed.py, on the smoke testbed that module trains anyway.) Each test
names the bug that was planted to see it fail.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("dflash")

from deltaspec import Drafter, Model  # noqa: E402
from deltaspec.errors import (HyperParameterError, MissingTensorError, UnsupportedArchitectureError)  # noqa: E402
from deltaspec.gguf_file import read_gguf  # noqa: E402
from deltaspec.testing import tiny_dflash as TD  # noqa: E402
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path  # noqa: E402

REL = 1e-4  # max |ours - torch| / max |torch|, f32


def _gguf_matrix(path, name) -> np.ndarray:
    t = read_gguf(path).tensors[name]
    return np.fromfile(path, dtype=np.float32, count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape[::-1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny-vocabulary target, its embedding and head as numpy, and a drafter factory."""
    root = tmp_path_factory.mktemp("dflash")
    path = tiny_vocab_model_path()
    target = Model(path, n_ctx=512, n_threads=1)
    embed = _gguf_matrix(path, "token_embd.weight")
    head = _gguf_matrix(path, "output.weight") if "output.weight" in read_gguf(path).tensors else embed
    made = {}

    def drafter(seed=0, qtype="f32", **cfg_kw):
        key = (seed, qtype, tuple(sorted(cfg_kw.items())))
        if key not in made:
            cfg = TD.dflash_config(target.hparams.n_embd, target.n_vocab, cfg_kw.pop("layer_ids", [0, 2]),
                                   mask_token_id=5, num_target_layers=target.hparams.n_layer, **cfg_kw)
            model = TD.build_tiny_dflash(cfg, seed=seed)
            file = TD.write_dflash_gguf(model, cfg, root / f"d{len(made)}.gguf", qtype=qtype)
            made[key] = (model, cfg, file, Drafter(file, target=target))
        return made[key]

    yield target, embed, head, drafter, root
    target.close()


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("causal", [None, True], ids=["noncausal", "causal"])
def test_block_logits_equal_torch(tiny, causal):
    """Logits of every block slot equal DFlashDraftModel's (f32, 1e-4 relative) given the same
    target features, over rounds that extend the context and one that replaces its tail (rejected
    tokens' rows), as the decode loop does.

    Planted bugs, each seen red: RoPE type NORMAL instead of NEOX in graph_dflash.cpp (rel 0.30);
    K without its k_norm weight (rel 0.08); the block's causal mask left out (causal case only,
    rel 0.37); inject() writing rows after the cached ones instead of at pos0 (third round, rel 0.23)."""
    target, embed, head, drafter, _ = tiny
    kw = {} if causal is None else {"causal": causal}
    model, cfg, _, d = drafter(seed=1, block_size=6, **kw)
    n_feat = len(cfg["dflash_config"]["target_layer_ids"]) * cfg["hidden_size"]
    feats = np.random.default_rng(0).standard_normal((40, n_feat)).astype(np.float32)
    d.truncate(0)
    rounds = [(0, 9), (9, 14), (11, 30)]  # (pos0, end): the last replaces rows 11..13
    for pos0, end in rounds:
        d.inject(feats[pos0:end], pos0)
        assert d.n_cached == end
        anchor = int(7 + end)
        ours = d.block_logits(anchor)
        ref = TD.reference_block_logits(model, feats[:end], anchor, embed, head)
        assert ours.shape == (cfg["block_size"] - 1, target.n_vocab)
        assert _rel(ours, ref) < REL, (pos0, end, _rel(ours, ref))
        assert d.block_top1(anchor) == ref.argmax(-1).tolist()
    # not degenerate: the slots differ from each other and the logits spread over the vocabulary
    assert np.abs(ours[0] - ours[-1]).max() > 0.1 and ours.std(-1).min() > 0.3


def test_quantized_drafters_track_f32(tiny):
    """F16 and Q8_0 drafter files load and stay near the f32 drafter (the same random weights), and
    really are quantized (Q8_0 differs from f32). Planted bug: tensor bytes read 32 bytes late
    (red: the last tensor then ends past the end of the file)."""
    target, embed, head, drafter, _ = tiny
    feats = np.random.default_rng(3).standard_normal((12, 2 * target.hparams.n_embd)).astype(np.float32)
    out = {}
    for qtype in ("f32", "f16", "q8_0"):
        *_, d = drafter(seed=2, qtype=qtype)
        d.truncate(0)
        d.inject(feats)
        out[qtype] = d.block_logits(11)
    assert _rel(out["f16"], out["f32"]) < 5e-3
    assert 1e-4 < _rel(out["q8_0"], out["f32"]) < 5e-2


def test_greedy_speculation_equals_plain_decoding(tiny):
    """spec_type "dflash": greedy output equals plain greedy on every prompt, drafts were proposed
    and some accepted (so keep() after partial acceptance and the taps of verify batches ran).

    Planted bug: DFlashDrafter injecting the tapped rows one position late (pos + 1): red (the
    drafter's cache no longer continues). The closing check compares the cache the loop left with
    a fresh read of the committed tokens."""
    target, *_, drafter, _ = tiny
    *_, d = drafter(seed=3)
    rng = np.random.default_rng(11)
    drafted = accepted = 0
    for _ in range(12):
        prompt = rng.integers(0, 256, size=int(rng.integers(2, 12))).tolist()
        plain = target.generate(prompt, max_tokens=48, temperature=0)
        fast = target.generate(prompt, max_tokens=48, temperature=0, draft_model=d, spec_type="dflash",
                               draft_n_max=15, draft_n_min=7)
        assert fast.tokens == plain.tokens
        drafted += fast.stats.n_drafted
        accepted += fast.stats.n_accepted
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    # the context the loop left holds the committed tokens' features (none of rejected drafts): a
    # block from it equals one from a fresh read of the same tokens
    sequence = prompt + fast.tokens
    k = d.n_cached
    assert len(prompt) <= k < len(sequence)
    left = d.block_logits(sequence[k])
    d.read_context(sequence[:k])
    assert _rel(left, d.block_logits(sequence[k])) < REL


def test_sampled_speculation_runs_and_reports(tiny):
    """At T > 0 the chain drafts are one-hot proposals (accepted with probability p(d), the residual
    otherwise): the run is reproducible by seed and reports drafting."""
    target, *_, drafter, _ = tiny
    *_, d = drafter(seed=3)
    kw = dict(max_tokens=40, temperature=0.9, seed=7, draft_model=d, spec_type="dflash", draft_n_max=7, draft_n_min=7)
    a, b = target.generate([1, 2, 3], **kw), target.generate([1, 2, 3], **kw)
    assert a.tokens == b.tokens and a.stats.n_drafted > 0


def test_refuses_drafters_that_do_not_fit(tiny, tmp_path):
    """Wrong hidden size, target layers past the target's, a missing tensor, another architecture,
    a vocabulary of another size: each refused with the key or tensor named."""
    target, *_ = tiny

    def variant(name, edit_cfg=None, **write_kw):
        cfg = TD.dflash_config(target.hparams.n_embd, target.n_vocab, [0, 2], mask_token_id=5,
                               num_target_layers=target.hparams.n_layer)
        if edit_cfg:
            edit_cfg(cfg)
        return TD.write_dflash_gguf(TD.build_tiny_dflash(cfg), cfg, tmp_path / f"{name}.gguf", **write_kw)

    E = target.hparams.n_embd
    cases = [
        (variant("wide", lambda c: c.update(hidden_size=2 * E)), HyperParameterError, "hidden size"),
        (variant("deep", lambda c: c["dflash_config"].update(target_layer_ids=[0, 9])), HyperParameterError,
         "target_layers"),
        (variant("vocab", tokens=["a"] * 7), HyperParameterError, "vocabulary"),
        (variant("notensor", skip=("blk.1.attn_k_norm.weight",)), MissingTensorError, "blk.1.attn_k_norm.weight"),
        (variant("arch", arch="llama"), UnsupportedArchitectureError, "general.architecture"),
    ]
    for path, exc, words in cases:
        with pytest.raises(exc, match=words):
            Drafter(path, target=target)


def test_cli_dflash_text_unchanged(tiny):
    """`deltaspec run -md D.gguf --spec-type dflash` prints the text plain greedy prints and reports
    drafting; without -md it exits 2 naming --spec-type. Seen to fail with generation.py sending
    spec_type "dflash" down the draft-model path (the CLI then exits with an error)."""
    import subprocess
    import sys

    target, *_, drafter, _ = tiny
    *_, path, _ = drafter(seed=3)
    base = ["-m", target.path, "-p", "the cat sat on the mat", "-n", "24", "--temp", "0", "-t", "1", "-c", "256"]

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "deltaspec", "run", *base, *extra], capture_output=True,
                              text=True, encoding="utf-8", errors="replace", timeout=120)

    plain, fast = run(), run("-md", str(path), "--spec-type", "dflash", "--spec-draft-n-min", "7")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and len(plain.stdout) > 30
    assert "drafted" in fast.stderr.strip().splitlines()[-1]
    bad = run("--spec-type", "dflash")
    assert bad.returncode == 2 and "--spec-type" in bad.stderr
