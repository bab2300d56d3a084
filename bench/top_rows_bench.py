"""Sampled decoding of many sequences with top rows (each logits row reduced on the device to its
64 best logits, ids and log-sum-exp: ggml/deltaspec_top.h) against whole rows copied to the host.

    python bench/top_rows_bench.py MODEL.gguf [--device cuda] [--n-seqs 16,32] [--prompt 64] [--gen 64]
                                   [--reps 3] [--out FILE.json]

N requests with random prompts, each sampling exactly --gen tokens (temperature 0.8, top_k 40,
top_p 0.95: llama.cpp's defaults, which top rows serve), run with add_request / step on one Model
with n_seq_max = the largest N. The timed part is every step after the first (which admits and
prefills): one decode row per sequence. Each repetition runs every N with top rows on, then off
(Engine::enable_top_rows), interleaved; each row reports the median and spread of its repetitions,
the time per step, and the bytes a step copies from the device: N * n_vocab * 4 for whole rows,
N * (2 * 64 + 1) * 4 for top rows. Both modes draw the same tokens (asserted): the comparison is
of the same work. No llama.cpp peer: llama-batched-bench has no sampled mode to compare with.
Weights of a synthetic GGUF are random: the speed is that of the model's shapes and quant mix.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from bench_cli import batch_decode_args, write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "top_rows_bench.json"


def run_once(model, n: int, n_prompt: int, n_gen: int, top_rows: bool, seed: int) -> dict:
    from deltaspec.sampling import SamplingOptions

    engine = model._engine
    engine.top_rows_enabled = top_rows
    rng = np.random.default_rng(seed)
    ids = []
    for i in range(n):  # no EOG ids and no stops: every request makes exactly n_gen tokens
        sampling = SamplingOptions(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed * 1000 + i).native()
        prompt = rng.integers(0, model.n_vocab, size=n_prompt).tolist()
        ids.append(engine.add_request(prompt, n_gen, sampling, [], []))
    tokens = {i: [] for i in ids}
    before = engine.decode_stats["top_rows"]
    for ev in engine.step():
        tokens[ev["id"]] += ev["tokens"]
    t0 = time.perf_counter()
    n_steps = 0
    while engine.n_requests:
        for ev in engine.step():
            tokens[ev["id"]] += ev["tokens"]
        n_steps += 1
    dt = time.perf_counter() - t0
    n_tokens = sum(len(t) for t in tokens.values()) - 2 * n  # the first step committed 2 per sequence
    return {"n_seqs": n, "top_rows": top_rows, "decode_s": dt, "steps": n_steps, "decode_tokens": n_tokens,
            "tok_s": n_tokens / dt, "step_ms": 1e3 * dt / n_steps,
            "top_rows_taken": engine.decode_stats["top_rows"] - before,
            "tokens": [tokens[i] for i in ids]}


def main(argv=None) -> int:
    args, n_seqs = batch_decode_args(__doc__.splitlines()[0], DEFAULT_OUT, n_seqs="16,32", gen=64, min_gen=3,
                                     argv=argv)
    from deltaspec import Model

    kw = dict(n_threads=args.threads) if args.threads else {}
    runs = []
    with Model(args.model, n_ctx=args.prompt + args.gen + 1, device=args.device, n_seq_max=max(n_seqs),
               progress=False, **kw) as model:
        n_vocab, k = model.n_vocab, min(64, model.n_vocab)
        for n in n_seqs:  # untimed: every graph shape built once
            for top in (True, False):
                run_once(model, n, args.prompt, 4, top, seed=99)
        for rep in range(args.reps):
            for n in n_seqs:
                pair = [run_once(model, n, args.prompt, args.gen, top, seed=rep) for top in (True, False)]
                if pair[0]["tokens"] != pair[1]["tokens"]:
                    raise AssertionError(f"N={n}: top rows drew other tokens than whole rows")
                if pair[0]["top_rows_taken"] < n * (args.gen - 2) or pair[1]["top_rows_taken"] != 0:
                    raise AssertionError(f"N={n}: the modes did not run as asked: {pair[0]['top_rows_taken']}, "
                                         f"{pair[1]['top_rows_taken']} top rows")
                for r in pair:
                    del r["tokens"]
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep + 1} N={n:3d} {'top  ' if r['top_rows'] else 'whole'}: {r['tok_s']:8.1f} tok/s, "
                          f"{r['step_ms']:7.2f} ms/step", flush=True)
    rows = []
    for n in n_seqs:
        for top in (True, False):
            sel = [r for r in runs if r["n_seqs"] == n and r["top_rows"] == top]
            tok = [r["tok_s"] for r in sel]
            ms = [r["step_ms"] for r in sel]
            rows.append({"n_seqs": n, "top_rows": top, "tok_s": float(np.median(tok)), "tok_s_min": min(tok),
                         "tok_s_max": max(tok), "step_ms": float(np.median(ms)), "step_ms_min": min(ms),
                         "step_ms_max": max(ms), "copied_bytes_per_step": n * (4 * (2 * k + 1) if top else 4 * n_vocab)})
    lines = ["| N | rows | tok/s (min-max) | ms/step (min-max) | device->host bytes/step |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_seqs']} | {'top 64' if r['top_rows'] else 'whole'} | {r['tok_s']:.1f} "
                     f"({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f}) | {r['step_ms']:.2f} ({r['step_ms_min']:.2f}-"
                     f"{r['step_ms_max']:.2f}) | {r['copied_bytes_per_step']:,} |")
    for n in n_seqs:
        top, whole = (next(r for r in rows if r["n_seqs"] == n and r["top_rows"] == t) for t in (True, False))
        lines.append(f"N={n}: {whole['step_ms'] - top['step_ms']:.2f} ms saved per step, "
                     f"{(whole['copied_bytes_per_step'] - top['copied_bytes_per_step']) / 2**20:.1f} MiB less copied")
    print("\n".join(lines))
    result = {"model": os.path.abspath(args.model), "device": args.device, "host": platform.node(), "n_vocab": n_vocab,
              "top_k": k, "n_prompt": args.prompt, "n_gen": args.gen, "reps": args.reps, "rows": rows, "runs": runs,
              "note": "sampled decode (temperature 0.8, top_k 40, top_p 0.95) of N sequences, top rows vs whole "
                      "rows; synthetic weights: the speed of the shapes and quant mix"}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
