"""Synthetic DFlash drafters: the z-lab Qwen3.5-27B-DFlash shape (algorithms_brief.md §1.3) as
llama.cpp's converter lays it out (arch `dflash`, the target's vocabulary copied in), random Q8_0
or F16 weights. For speed measurements only: what it drafts is noise.

    python -m deltaspec.synth_dflash OUT.gguf [--quant q8_0] [--layers 1,16,31,46,61]

Q8_0 rows are written directly (a random f16 scale and random int8 values per 32-value block, a
valid block of that type), so the 1.7B-parameter file takes seconds, not a quantizer's hours.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import numpy as np

# Qwen3.5-27B-DFlash (HF config): 5 layers, hidden 5120, 32/8 heads of 128, FFN 17408, block 16,
# mask 248070, rope_theta 1e7, target_layer_ids [1, 16, 31, 46, 61] of the 64-layer target
SHAPE_27B = dict(n_embd=5120, n_layer=5, n_head=32, n_head_kv=8, head_dim=128, n_ff=17408, block_size=16,
                 mask_token_id=248070, rope_theta=1e7, target_layer_ids=(1, 16, 31, 46, 61))


def _q8_0(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    blocks = rows * cols // 32
    out = np.empty((blocks, 34), dtype=np.uint8)
    # int8 values uniform on [-127, 127] have std ~73: the scale puts the weights at `std`
    out[:, :2] = np.full(blocks, std / 73.0, dtype=np.float16).view(np.uint8).reshape(blocks, 2)
    out[:, 2:] = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(rows, cols // 32 * 34)


def write_synthetic_dflash(path: str | os.PathLike[str], quant: str = "q8_0", seed: int = 0, **shape) -> Path:
    from .synth import _add_tokenizer, _Writer  # the target's real vocabulary, packed once

    s = {**SHAPE_27B, **shape}
    E, L, H, Hkv, D, F = s["n_embd"], s["n_layer"], s["n_head"], s["n_head_kv"], s["head_dim"], s["n_ff"]
    n_feat = len(s["target_layer_ids"]) * E
    rng = np.random.default_rng(seed)
    path = Path(path)
    w = _Writer(str(path), "dflash")
    w.add_name("deltaspec-synthetic-dflash")
    w.add_block_count(L)
    w.add_context_length(262144)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_uint32("dflash.block_size", s["block_size"])
    w.add_array("dflash.target_layers", [i + 1 for i in s["target_layer_ids"]])
    w.add_array("dflash.rope.dimension_sections", [D // 2, 0, 0, 0])
    _add_tokenizer(w, None)
    w.add_uint32("tokenizer.ggml.mask_token_id", s["mask_token_id"])

    def mat(name: str, n_in: int, n_out: int) -> None:
        std = 1.0 / np.sqrt(n_in)
        if quant == "q8_0":
            w.add_tensor(name, _q8_0(n_out, n_in, std, rng),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, (rng.standard_normal((n_out, n_in), dtype=np.float32) * std).astype(np.float16))

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("fc.weight", n_feat, E)
    norm("enc.output_norm.weight", E)
    for i in range(L):
        norm(f"blk.{i}.attn_norm.weight", E)
        mat(f"blk.{i}.attn_q.weight", E, H * D)
        mat(f"blk.{i}.attn_k.weight", E, Hkv * D)
        mat(f"blk.{i}.attn_v.weight", E, Hkv * D)
        mat(f"blk.{i}.attn_output.weight", H * D, E)
        norm(f"blk.{i}.attn_q_norm.weight", D)
        norm(f"blk.{i}.attn_k_norm.weight", D)
        norm(f"blk.{i}.ffn_norm.weight", E)
        mat(f"blk.{i}.ffn_gate.weight", E, F)
        mat(f"blk.{i}.ffn_up.weight", E, F)
        mat(f"blk.{i}.ffn_down.weight", F, E)
    norm("output_norm.weight", E)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--quant", choices=["q8_0", "f16"], default="q8_0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a tiny shape (E 256, 2 layers) for checks on a CPU")
    args = ap.parse_args(argv)
    shape = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, target_layer_ids=(0, 1)) \
        if args.small else {}
    print(write_synthetic_dflash(args.out, args.quant, args.seed, **shape))


if __name__ == "__main__":
    main()
