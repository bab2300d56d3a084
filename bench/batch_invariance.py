"""What a batch-invariant model costs: prefill, decode (near the start and deep in the context)
and speculative decode speed with the device's default kernels and with Model(batch_invariant=True)
(see python/deltaspec/batch_invariance.py), on the CPU or on CUDA.

    python bench/batch_invariance.py --out bench/results/latest/cpu_batch_invariance.json
    python bench/batch_invariance.py --device cuda --model 27b-q4_k_m.gguf --drafter ngram \
        --out bench/results/latest/cuda_batch_invariance.json

Settings, each in processes of its own, selected through the environment:
  default      the device's kernels by batch shape (CPU: K-quant batches of >= 8 rows tiled,
               attention tiled from 64 query rows, one-row attention split over the threads from
               512 KV cells; CUDA: mat-vecs for a token, tensor-core / tile kernels for batches,
               flash attention's vector kernel for a token)
  invariant    DELTASPEC_BATCH_INVARIANT=1 (CPU: ggml-cpu's reference kernels at every width;
               CUDA: deltaspec's invariant products and attention, ggml/cuda/deltaspec_invariant.h)

Model: --model, or `deltaspec synth --preset 0.8b --quant q4_k_m` (RANDOM weights, Qwen3.5-0.8B's
shapes and llama-quantize's Q4_K_M mix). Per process: prefill of random prompts of each --pp
length, greedy decode of --tg tokens after a 16-token prompt and after a --depth-token one, and
speculative greedy decode of the first: --drafter self loads the file again as its own draft
(draft_n_min 1, draft_n_max 8: every draft accepted, verify batches of 9 rows, the width where
ggml-cpu tiles K-quant matmuls); --drafter ngram drafts by prompt lookup (draft_n_max 8; a random
model's greedy text soon repeats, so most drafts are accepted) without a second copy of a large
model. Each process also checks, bitwise, the logits of a 12-row and a 70-row batch and of a
2-row batch after 600 tokens against the same tokens as one-token steps. Settings alternate
within each of --reps rounds, so a slow spell of a shared machine hits them alike; the median
is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "default": {"DELTASPEC_BATCH_INVARIANT": "0"},
    "invariant": {"DELTASPEC_BATCH_INVARIANT": "1"},
}
GGML_VARS = ("DELTASPEC_BATCH_INVARIANT", "GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE")
SPEED = ("tg_tok_s", "tg_deep_tok_s", "spec_tok_s")
BITWISE_SHAPES = ((12, 0), (70, 0), (2, 600))  # (batch rows, context before them)


def worker(path: str, pps: list[int], tg: int, depth: int, threads: int, device: str, drafter: str) -> dict:
    import numpy as np

    from deltaspec import Model
    from deltaspec.testing.batch_rows import batch_vs_steps

    rng = np.random.default_rng(5)
    n_ctx = max(pps + [depth, 600]) + tg + 80
    target = Model(path, n_ctx=n_ctx, n_threads=threads, device=device, progress=False)
    spec_args = dict(spec_type="ngram-simple", draft_n_max=8)
    if drafter == "self":
        spec_args = dict(draft_model=Model(path, n_ctx=n_ctx, n_threads=threads, device=device, progress=False),
                         draft_n_max=8, draft_n_min=1)
    diffs = {f"{rows}@{context}": batch_vs_steps(target, rows, context, rng) for rows, context in BITWISE_SHAPES}
    target.reset()
    target.eval(rng.integers(0, target.n_vocab, size=8).tolist())  # warm-up at the tiled width
    pp_tok_s = {}
    for pp in pps:
        prompt = rng.integers(0, target.n_vocab, size=pp).tolist()
        target.reset()
        t0 = time.perf_counter()
        target.eval(prompt)
        pp_tok_s[f"pp{pp}_tok_s"] = pp / (time.perf_counter() - t0)
    short = prompt[:16]
    plain = target.generate(short, max_tokens=tg, temperature=0)
    deep = target.generate(rng.integers(0, target.n_vocab, size=depth).tolist(), max_tokens=tg, temperature=0)
    spec = target.generate(short, max_tokens=tg, temperature=0, **spec_args)
    return {"batch_invariant": target.batch_invariant, "row_diffs": diffs,
            "rows_bitwise_equal": all(d == 0 for d in diffs.values()), "max_row_diff": max(diffs.values()),
            **pp_tok_s, "tg_tok_s": plain.stats.tokens_per_second, "tg_deep_tok_s": deep.stats.tokens_per_second,
            "spec_tok_s": spec.stats.tokens_per_second, "spec_identical_to_plain": spec.tokens == plain.tokens,
            "n_drafted": spec.stats.n_drafted, "n_accepted": spec.stats.n_accepted}


def run_one(setting: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in GGML_VARS}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, __file__, "--worker", str(args.model), "--pp", args.pp, "--tg", str(args.tg),
           "--depth", str(args.depth), "--threads", str(args.threads), "--device", args.device,
           "--drafter", args.drafter]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a qwen35 GGUF (default: synthesize the 0.8b Q4_K_M one)")
    ap.add_argument("--pp", default="32,128,512", help="prefill lengths in tokens, comma-separated")
    ap.add_argument("--tg", type=int, default=33, help="generated tokens per decode")
    ap.add_argument("--depth", type=int, default=1024, help="prompt length of the deep decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--drafter", choices=("self", "ngram"), default="self",
                    help="speculation: the file as its own draft model, or prompt lookup")
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, [int(n) for n in args.pp.split(",")], args.tg, args.depth,
                                args.threads, args.device, args.drafter)))
        return
    metrics = tuple(f"pp{n}_tok_s" for n in args.pp.split(",")) + SPEED
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = Path(tmp) / "0.8b-q4_k_m.gguf"
            subprocess.run([sys.executable, "-m", "deltaspec", "synth", "--preset", "0.8b", "--quant", "q4_k_m",
                            str(args.model)], check=True, capture_output=True)
        runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
        for rep in range(args.reps):
            order = list(SETTINGS) if rep % 2 == 0 else list(SETTINGS)[::-1]
            for s in order:
                runs[s].append(run_one(s, args))
                print(f"round {rep + 1}/{args.reps} {s}: " + " ".join(
                    f"{k} {runs[s][-1][k]:.2f}" for k in metrics), file=sys.stderr, flush=True)
    results = {}
    for s, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in metrics}
        results[s] = {**med, "env": SETTINGS[s], "batch_invariant": rows[0]["batch_invariant"],
                      "rows_bitwise_equal": all(r["rows_bitwise_equal"] for r in rows),
                      "max_row_diff": max(r["max_row_diff"] for r in rows),
                      "spec_identical_to_plain": all(r["spec_identical_to_plain"] for r in rows),
                      "n_drafted": rows[0]["n_drafted"], "n_accepted": rows[0]["n_accepted"], "runs": rows}
    base = results["default"]
    table = ["| setting | rows bitwise | " + " | ".join(f"pp{n} tok/s" for n in args.pp.split(","))
             + f" | tg{args.tg} tok/s | tg{args.tg} @ {args.depth} tok/s | spec tok/s ({args.drafter}, n_max 8) |",
             "|---" * (len(metrics) + 2) + "|"]
    for s, r in results.items():
        cells = [f"{r[k]:.2f} ({r[k] / base[k]:.2f}x)" for k in metrics]
        table.append(f"| {s} | {'yes' if r['rows_bitwise_equal'] else 'no (max %.2g)' % r['max_row_diff']} | "
                     + " | ".join(cells) + " |")
    print("\n".join(table))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": "deltaspec synth --preset 0.8b --quant q4_k_m" if args.model.parent == Path(tmp)
                else str(args.model), "device": args.device, "drafter": args.drafter, "pp": args.pp, "tg": args.tg,
                "depth": args.depth, "threads": args.threads,
                "reps": args.reps,
                "statistic": "median over reps; settings alternate within each round", "cpus": os.cpu_count(),
                "machine": platform.machine(), "processor": platform.processor(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        where = f"{args.threads} thread(s)" if args.device == "cpu" else args.device
        note = (f"Median of {args.reps} rounds, {where}, {meta['model']}; (x): against default. "
                f"See bench/batch_invariance.py.")
        args.out.with_suffix(".md").write_text("\n".join(table) + "\n\n" + note + "\n")


if __name__ == "__main__":
    main()
