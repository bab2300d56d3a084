"""Would a 16-bit recurrent state pay? Quality and bytes of storing the Gated DeltaNet states in f16 or
bf16 instead of f32 (deltaspec and llama.cpp keep them in f32).

    python bench/recurrent_state_dtype.py [--dir TESTBED] [--windows 3] [--length 2048]

Quality, on the trained testbed's target (transformers' Qwen3_5ForCausalLM from the testbed's HF
folder, the same weights as its target.gguf): held-out windows (as bench/kv_quality.py cuts them)
are read one token per step through the model's cache, as decoding does. After every step each
DeltaNet state is rounded to the dtype under test and back, which is what storing it in that dtype
between steps does; the f32 run is the reference. Per context bin: KL(f32 || dtype) of the
next-token distributions and top-1 agreement; held-out perplexity of the whole window. Windows are
the repetitions (median [min-max]).

Bytes (no model needed): a slot's DeltaNet states and what a decode step reads and writes of them,
next to the weights and KV rows it reads, for the Qwen3.5 27B shapes (python/deltaspec/synth.py).

Writes bench/results/latest/recurrent_state_dtype.json and its table (.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kv_quality import bins_for, compare, heldout_windows  # noqa: E402

DTYPES = ("bf16", "f16")
DEFAULT_OUT = HERE / "results" / "latest" / "recurrent_state_dtype.json"


def run_window(target, window: list[int], dtype) -> np.ndarray:
    """Logits [len(window) - 1, V] of reading window[:-1] one token per step, each DeltaNet state
    rounded to `dtype` (None: kept in f32) after every step."""
    import inspect

    import torch

    kw = "cache" if "cache" in inspect.signature(type(target).forward).parameters else "past_key_values"
    cache, rows = None, []
    with torch.no_grad():
        for tok in window[:-1]:
            out = target(input_ids=torch.tensor([[tok]]), use_cache=True, **({kw: cache} if cache is not None else {}))
            cache = getattr(out, kw)
            if dtype is not None:
                rounded = 0
                for layer in cache.layers:
                    # a tensor, or (transformers 5.2x) a dict of them: {index: [B, H, S, S]}
                    states = getattr(layer, "recurrent_states", None)
                    if isinstance(states, dict):
                        for k, v in states.items():
                            states[k] = v.to(dtype).to(v.dtype)
                            rounded += 1
                    elif states is not None:
                        layer.recurrent_states = states.to(dtype).to(states.dtype)
                        rounded += 1
                if not rounded:
                    raise RuntimeError("the cache holds no recurrent state: nothing was rounded (a transformers change?)")
            rows.append(out.logits[0, -1].float().numpy())
    return np.stack(rows)


def bytes_table() -> dict:
    """The 27B's DeltaNet state bytes per slot and per decode step (read + write), f32 vs 16-bit."""
    from deltaspec.slot_memory import slot_bytes
    from deltaspec.synth import PRESETS

    hp = PRESETS["27b"]
    n_delta = sum(1 for r in hp.recurrent if r)
    state_f32 = n_delta * hp.ssm_n_v_heads * hp.ssm_state_size * hp.ssm_state_size * 4
    slot = slot_bytes(hp, 32768, "q4_0", "q4_0")
    return {"deltanet_layers": n_delta, "state_f32_bytes": state_f32, "state_16bit_bytes": state_f32 // 2,
            "recurrent_bytes_per_slot_f32": slot["recurrent"], "kv_q4_0_bytes_at_32k": slot["kv"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/work/tb_rebuilt", help="the testbed folder (hf/target, target.gguf)")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)

    import torch
    from transformers import Qwen3_5ForCausalLM

    import deltaspec

    torch.set_num_threads(args.threads)
    folder = Path(args.dir)
    target = Qwen3_5ForCausalLM.from_pretrained(folder / "hf/target", dtype=torch.float32).eval()
    with deltaspec.Model(folder / "target.gguf", n_ctx=256, progress=False) as m:  # its tokenizer
        windows = heldout_windows(m, args.windows, args.length)
    bins = bins_for(args.length)
    per_dtype: dict[str, list[dict]] = {d: [] for d in DTYPES}
    ref_ppl = []
    t0 = time.time()
    for i, window in enumerate(windows):
        targets = np.array(window[1:])
        ref = run_window(target, window, None)
        ref_ppl.append(compare(ref, ref, targets, bins)["ppl"])
        for name in DTYPES:
            logits = run_window(target, window, {"bf16": torch.bfloat16, "f16": torch.float16}[name])
            per_dtype[name].append(compare(ref, logits, targets, bins))
        print(f"window {i + 1}/{len(windows)}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    result = {"what": __doc__.splitlines()[0], "testbed": str(folder), "windows": len(windows),
              "length": args.length, "f32_ppl": ref_ppl, "dtypes": per_dtype, "bytes_27b": bytes_table(),
              "seconds": round(time.time() - t0, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md = table(result)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def table(result: dict) -> str:
    bins = list(result["dtypes"][DTYPES[0]][0]["bins"])
    lines = [f"DeltaNet state stored in 16 bits between decode steps vs f32, testbed target, {result['windows']} "
             f"held-out windows of {result['length']} tokens, median [min-max] over windows",
             "", "| state | " + " | ".join(f"KL {b}" for b in bins) + " | " + " | ".join(f"top-1 {b}" for b in bins)
             + " | perplexity |", "|---|" + "---:|" * (2 * len(bins) + 1)]
    lines.append("| f32 | " + " | ".join("0" for _ in bins) + " | " + " | ".join("1" for _ in bins) + " | "
                 + _spread(result["f32_ppl"], ".3f") + " |")
    for name in DTYPES:
        runs = result["dtypes"][name]
        lines.append(f"| {name} | " + " | ".join(_spread([r["bins"][b]["kl"] for r in runs], ".1e") for b in bins)
                     + " | " + " | ".join(_spread([r["bins"][b]["top1"] for r in runs], ".4f") for b in bins)
                     + " | " + _spread([r["ppl"] for r in runs], ".3f") + " |")
    b = result["bytes_27b"]
    mib = 2.0**20
    lines += ["", f"27B ({b['deltanet_layers']} DeltaNet layers): states {b['state_f32_bytes'] / mib:.0f} MiB per "
              f"slot in f32, {b['state_16bit_bytes'] / mib:.0f} MiB in 16 bits; a decode step reads and writes "
              f"them once ({2 * b['state_f32_bytes'] / 1e9:.2f} GB in f32); a slot's q4_0 KV at 32K is "
              f"{b['kv_q4_0_bytes_at_32k'] / mib:.0f} MiB."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
