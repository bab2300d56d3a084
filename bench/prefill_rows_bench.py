"""Time to first token when many requests arrive together: prompt chunks of several requests in one
pass (Engine::prefill_rows, the default) against each prompt prefilled alone in turn (the scheduler
before it), on one Model.

    python bench/prefill_rows_bench.py [MODEL.gguf] [--device cpu|cuda] [--n-seqs 8] [--prompt 64]
                                       [--budget 512] [--gen 4] [--reps 3] [--threads N] [--shape wide|tiny]
                                       [--out FILE.json]

Without MODEL a synthetic tiny-vocabulary qwen35 with random F32 weights is written to a temporary
folder (--shape wide: n_embd 256, 8 layers; tiny: the tests' n_embd 64, 4 layers, where a pass's
fixed costs dominate): its speed is that of its shapes only (say so with every number).
Each run adds --n-seqs requests with fresh random prompts of --prompt tokens at once (greedy, no
end-of-generation tokens) and steps the scheduler (prefill budget --budget per step, as
`deltaspec serve --prefill-budget`) until every request has its first token: a request's TTFT is
the time from the submission to the end of the step that returned its first token (what a server's
client sees). The two modes alternate inside every repetition (on, off, on, off, ...); a first
untimed round of each builds the graphs. Reports per mode the median over repetitions of the
median and of the last TTFT, with their spread (min-max), and the prefill passes over 2+ slots.
No peer: llama-server's TTFT at the same load is bench/server_bench.py's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "prefill_rows_bench.json"


def one_run(model, n_seqs: int, n_prompt: int, n_gen: int, rng) -> dict:
    from deltaspec.sampling import SamplingOptions

    engine = model._engine
    greedy = SamplingOptions(temperature=0.0).native()
    t0 = time.perf_counter()
    for _ in range(n_seqs):
        engine.add_request(rng.integers(0, model.n_vocab, size=n_prompt).tolist(), n_gen, greedy, [], [])
    first: dict[int, float] = {}
    steps = 0
    while len(first) < n_seqs:
        events = engine.step()
        steps += 1
        t = time.perf_counter() - t0
        for ev in events:
            if ev["tokens"] and ev["id"] not in first:
                first[ev["id"]] = t
    while engine.n_requests:  # the rest, untimed, so that the next run starts from idle slots
        engine.step()
    ttft = sorted(first.values())
    return {"ttft_median_ms": 1e3 * statistics.median(ttft), "ttft_last_ms": 1e3 * ttft[-1],
            "ttft_first_ms": 1e3 * ttft[0], "steps_to_last_first_token": steps}


def spread(vals: list[float]) -> dict:
    return {"median": float(np.median(vals)), "min": float(min(vals)), "max": float(max(vals))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF (default: a synthetic tiny-vocabulary model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512, help="prefill budget per step (0: no limit)")
    ap.add_argument("--gen", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", choices=("wide", "tiny"), default="wide", help="the synthetic model's (no MODEL)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    from deltaspec import Model

    tmp = None
    path = args.model
    if path is None:
        from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

        tmp = tempfile.TemporaryDirectory()
        shape = dict(n_embd=256, n_layer=8, n_ff=768, n_head=4, n_head_kv=2, ssm_v_heads=4, ssm_k_heads=2)
        path = str(write_tiny_vocab_model(Path(tmp.name) / "bench.gguf", seed=0, **(shape if args.shape == "wide" else {})))
    kw = dict(n_threads=args.threads) if args.threads else {}
    rng = np.random.default_rng(0)
    runs: dict[str, list[dict]] = {"rows": [], "alone": []}
    passes = {}
    with Model(path, n_ctx=args.prompt + args.gen + 8, device=args.device, n_seq_max=args.n_seqs, progress=False,
               **kw) as model:
        model.set_prefill_budget(args.budget)
        for rep in range(args.reps + 1):  # rep 0: untimed, builds every graph
            for mode in ("rows", "alone"):
                model._engine.set_prefill_rows(mode == "rows")
                before = model._engine.prefill_stats["multi_slot_passes"]
                r = one_run(model, args.n_seqs, args.prompt, args.gen, rng)
                r["multi_slot_passes"] = model._engine.prefill_stats["multi_slot_passes"] - before
                if rep == 0:
                    continue
                runs[mode].append(r)
                print(f"rep {rep} {mode:5s}: TTFT median {r['ttft_median_ms']:8.1f} ms, last {r['ttft_last_ms']:8.1f} ms, "
                      f"{r['multi_slot_passes']} passes over 2+ slots", flush=True)
        passes = dict(model._engine.prefill_stats)
        backend = model._engine.backend
    summary = {mode: {k: spread([r[k] for r in rs]) for k in ("ttft_median_ms", "ttft_last_ms")}
               for mode, rs in runs.items()}
    print(f"\n{args.n_seqs} prompts of {args.prompt} tokens submitted together, prefill budget {args.budget}, "
          f"{backend}, {path if args.model else f'synthetic tiny-vocabulary model, {args.shape} shape (random weights)'}")
    print("| prefill | TTFT median ms (min-max) | last TTFT ms (min-max) |")
    print("|---|---|---|")
    for mode, s in summary.items():
        a, b = s["ttft_median_ms"], s["ttft_last_ms"]
        print(f"| {'several prompts per pass' if mode == 'rows' else 'one prompt at a time'} | "
              f"{a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) | {b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f}) |")
    ratio = summary["alone"]["ttft_median_ms"]["median"] / summary["rows"]["ttft_median_ms"]["median"]
    print(f"median TTFT, one at a time / several per pass: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                    "backend": backend, "host": platform.node(), "runs": runs, "summary": summary,
                                    "median_ttft_ratio": ratio, "prefill_stats": passes}, indent=1))
    print(f"wrote {args.out}")
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
