"""What keeping a step graph per batch shape saves (csrc/step_graphs.cpp): speculative rounds whose
shapes alternate, with the cache's default limit against one kept graph (the engine before the
cache, DELTASPEC_GRAPH_CACHE=1), interleaved.

    python bench/graph_cache_bench.py [MODEL.gguf] [--device cpu|cuda] [--n-seqs 1,4] [--prompt 64]
                                      [--gen 96] [--draft-n-max 8] [--reps 3] [--caches 1,8] [--out FILE.json]

Without MODEL, a tiny-vocabulary model of --tiny-layers layers (default 24: a small Qwen3.5's
count of graph nodes, with almost no arithmetic, so the host's share shows) is written to a temp
folder. For each sequence count N, N greedy requests (random prompts of --prompt tokens, --gen
tokens each) run through add_request / step in two modes:
  plain  no drafter: every step the same shape (the control: the cache must not cost anything);
  ref/4  prompt lookup in a reference holding the plain run's output with every 4th token wrong:
         drafts of varying length break off, plain steps come between, so the target's shape
         changes nearly every round (decode of N rows, verify of N x Tq rows, Tq varying).
One engine per cache limit (the limit is read when an engine is made); repetitions interleave
(every N, mode and limit, --reps times). Every step after the first (which admits and prefills)
is timed. Per cell: the median ms per target pass (the steps' wall time over the passes) with its
spread (min-max), tok/s, graphs built and passes that switched to another kept graph, and the host
seconds spent building and allocating graphs (GraphStats). Both limits must give the same tokens
(checked: "same"). There is no llama.cpp peer for this: it is the engine's own host overhead.
Writes bench/results/latest/graph_cache_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "graph_cache_bench.json"
MODES = ("plain", "ref/4")


class Engines:
    """One model per cache limit, the same file and options."""

    def __init__(self, path: str, device: str, caches: list[int], n_seqs: list[int], n_prompt: int, n_gen: int,
                 n_draft: int, threads: int | None):
        from deltaspec import Model
        from deltaspec.sampling import SamplingOptions

        kw = dict(n_threads=threads) if threads else {}
        self.models = {}
        for c in caches:
            old = os.environ.get("DELTASPEC_GRAPH_CACHE")
            os.environ["DELTASPEC_GRAPH_CACHE"] = str(c)
            try:
                self.models[c] = Model(path, n_ctx=n_prompt + n_gen + 1, device=device, n_seq_max=max(n_seqs),
                                       progress=False, **kw)
            finally:
                if old is None:
                    os.environ.pop("DELTASPEC_GRAPH_CACHE")
                else:
                    os.environ["DELTASPEC_GRAPH_CACHE"] = old
        self.greedy = SamplingOptions(temperature=0.0).native()
        self.n_gen, self.n_draft = n_gen, n_draft
        n_vocab = next(iter(self.models.values())).n_vocab
        rng = np.random.default_rng(0)
        self.prompts = [rng.integers(0, n_vocab, size=n_prompt).tolist() for _ in range(max(n_seqs))]
        self.refs: dict[int, list[list[int]]] = {}  # N -> the reference per prompt (ref/4)
        for n in n_seqs:  # warm-up, and the plain output the references hold
            plain = self._one(caches[-1], n, "plain")["tokens"]
            self.refs[n] = [[(t + 1) % n_vocab if i % 4 == 3 else t for i, t in enumerate(p + out)]
                            for p, out in zip(self.prompts, plain)]
            for c in caches:
                self._one(c, n, "ref/4")

    def _one(self, cache: int, n: int, mode: str) -> dict:
        engine = self.models[cache]._engine
        spec = [None if mode == "plain" else (self.n_draft, 0, 3, self.refs[n][k]) for k in range(n)]
        ids = [engine.add_request(self.prompts[k], self.n_gen, self.greedy, [], [], speculation=spec[k])
               for k in range(n)]
        tokens = {i: [] for i in ids}

        def step() -> int:
            got = 0
            for ev in engine.step():
                tokens[ev["id"]].extend(ev["tokens"])
                got += len(ev["tokens"])
            return got

        step()  # admits and prefills every request
        g0 = dict(engine.graph_stats)
        t1 = time.perf_counter()
        n_tokens = 0
        while engine.n_requests:
            n_tokens += step()
        dt = time.perf_counter() - t1
        g1 = engine.graph_stats
        passes = (g1["builds"] + g1["reuses"]) - (g0["builds"] + g0["reuses"])
        return {"cache": cache, "n_seqs": n, "mode": mode, "seconds": dt, "tokens_out": n_tokens,
                "tok_s": n_tokens / dt, "passes": passes, "ms_per_pass": 1e3 * dt / passes,
                "builds": g1["builds"] - g0["builds"], "switches": g1["switches"] - g0["switches"],
                "host_build_ms": 1e3 * ((g1["build_seconds"] + g1["alloc_seconds"]) -
                                        (g0["build_seconds"] + g0["alloc_seconds"])),
                "kept_bytes": g1["kept_bytes"], "tokens": [tokens[i] for i in ids]}

    def run(self, n_seqs: list[int]) -> list[dict]:
        out = []
        for n in n_seqs:
            for mode in MODES:
                cells = [self._one(c, n, mode) for c in self.models]
                same = all(c["tokens"] == cells[0]["tokens"] for c in cells)
                for c in cells:
                    c["same"] = same
                    out.append(c)
                    print(f"N={n:2d} {mode:6s} cache={c['cache']}: {c['ms_per_pass']:7.3f} ms/pass, {c['tok_s']:8.1f} tok/s, "
                          f"{c['builds']:3d} builds / {c['passes']} passes, {c['switches']} switches, "
                          f"host build+alloc {c['host_build_ms']:.1f} ms{'' if same else ', OTHER TOKENS'}", flush=True)
        return out

    def close(self) -> None:
        for m in self.models.values():
            m.close()


def summarize(reps: list[list[dict]]) -> list[dict]:
    out = []
    for i, first in enumerate(reps[0]):
        cell = {k: first[k] for k in ("cache", "n_seqs", "mode", "passes")}
        for key in ("ms_per_pass", "tok_s", "host_build_ms"):
            vals = [rep[i][key] for rep in reps]
            cell.update({key: float(np.median(vals)), f"{key}_min": min(vals), f"{key}_max": max(vals),
                         f"{key}_reps": vals})
        cell["builds"] = int(np.median([rep[i]["builds"] for rep in reps]))
        cell["switches"] = int(np.median([rep[i]["switches"] for rep in reps]))
        cell["kept_bytes"] = max(rep[i]["kept_bytes"] for rep in reps)
        cell["same"] = all(rep[i]["same"] for rep in reps)
        out.append(cell)
    return out


def table(cells: list[dict]) -> str:
    rows = ["| N | mode | cache | ms/pass (min-max) | tok/s | builds / passes | switches | host build+alloc ms | same tokens |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        rows.append(f"| {c['n_seqs']} | {c['mode']} | {c['cache']} | {c['ms_per_pass']:.3f} ({c['ms_per_pass_min']:.3f}-"
                    f"{c['ms_per_pass_max']:.3f}) | {c['tok_s']:.1f} | {c['builds']} / {c['passes']} | {c['switches']} | "
                    f"{c['host_build_ms']:.1f} | {'yes' if c['same'] else 'NO'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="a qwen35 GGUF (default: a tiny-vocabulary model, --tiny-layers)")
    ap.add_argument("--tiny-layers", type=int, default=24)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--n-seqs", default="1,4")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--draft-n-max", type=int, default=8)
    ap.add_argument("--caches", default="1,8", help="DELTASPEC_GRAPH_CACHE limits to compare")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    n_seqs = [int(x) for x in args.n_seqs.split(",")]
    caches = [int(x) for x in args.caches.split(",")]
    if args.reps < 1 or args.gen < 8 or not n_seqs or min(n_seqs) < 1 or not caches or min(caches) < 1:
        ap.error("need --reps >= 1, --gen >= 8, sequence counts >= 1 and cache limits >= 1")
    tmp = None
    path = args.model
    if path is None:
        from deltaspec.testing.tiny_vocab import write_tiny_vocab_model
        tmp = tempfile.TemporaryDirectory(prefix="graph-cache-bench-")
        path = str(write_tiny_vocab_model(Path(tmp.name) / "tiny.gguf", seed=0, n_layer=args.tiny_layers))
    runs = []
    engines = Engines(path, args.device, caches, n_seqs, args.prompt, args.gen, args.draft_n_max, args.threads)
    try:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            runs.append(engines.run(n_seqs))
    finally:
        engines.close()
    cells = summarize(runs)
    print(table(cells))
    for rep in runs:
        for c in rep:
            del c["tokens"]
    result = {"model": args.model or f"tiny-vocab, {args.tiny_layers} layers", "device": args.device,
              "host": platform.node(), "n_prompt": args.prompt, "n_gen": args.gen, "draft_n_max": args.draft_n_max,
              "reps": args.reps, "cells": cells, "runs": runs,
              "note": "ms per target pass over the steps after the prefill; cache 1 = one kept graph (before the "
                      "cache); ref/4: prompt lookup in the plain output with every 4th token wrong (shapes change "
                      "nearly every round); no peer: the engine's own host overhead"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(c["same"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
