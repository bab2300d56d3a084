"""Aggregate decode throughput with several sequences at once, deltaspec vs llama-batched-bench.

    python bench/batch_bench.py MODEL.gguf [--device cuda] [--n-seqs 1,4,16,32] [--prompt 128] [--gen 128]
                                [--reps 3] [--batched-bench BIN/llama-batched-bench] [--out FILE.json]

deltaspec: a Model with n_seq_max = the largest count; for each count N, N requests with distinct
random prompts of --prompt tokens, each generating exactly --gen tokens (greedy, no
end-of-generation tokens, so none stops early), run with add_request / step. The first step
admits and prefills every request; the timed part is every step after it (each one decode row per
sequence), and the rate is the tokens those steps committed over their time: aggregate decode
tok/s, as llama-batched-bench's S_TG (pl * tg / t_tg, its prompts prefilled first, untimed).

The peer runs `llama-batched-bench -npp PROMPT -ntg GEN -npl N,... -ngl 99 -fa on
--output-format jsonl` on the same file (built by bench/peers/llama_cpp.py build --cuda, which
builds llama-batched-bench beside llama-bench). Repetitions interleave: deltaspec's counts (one
Model kept open), then one llama-batched-bench run, --reps times; each count reports the median
and the spread (min, max) of its repetitions. Weights of a synthetic GGUF are random: the speed is
that of the model's shapes and quant mix (say so with every number).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_cli import write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "batch_bench.json"


class Ours:
    """One Model with n_seq_max = the largest count, kept open across repetitions; the first round
    (4 tokens per sequence, untimed) builds the graphs of every shape."""

    def __init__(self, model_path: str, device: str, n_seqs: list[int], n_prompt: int, n_gen: int,
                 threads: int | None = None):
        from deltaspec import Model
        from deltaspec.sampling import SamplingOptions

        kw = dict(n_threads=threads) if threads else {}
        self.model = Model(model_path, n_ctx=n_prompt + n_gen + 1, device=device, n_seq_max=max(n_seqs),
                           progress=False, **kw)
        self.greedy = SamplingOptions(temperature=0.0).native()
        self.rng = np.random.default_rng(0)
        self.n_seqs, self.n_prompt, self.n_gen = n_seqs, n_prompt, n_gen
        self.run(warm=True)

    def run(self, warm: bool = False) -> list[dict]:
        engine, out = self.model._engine, []
        for n in self.n_seqs:
            gen = 4 if warm else self.n_gen
            for _ in range(n):  # no EOG ids and no stops: every request makes exactly `gen` tokens
                prompt = self.rng.integers(0, self.model.n_vocab, size=self.n_prompt).tolist()
                engine.add_request(prompt, gen, self.greedy, [], [])
            t0 = time.perf_counter()
            first = engine.step()
            t1 = time.perf_counter()
            n_tokens = 0
            while engine.n_requests:
                n_tokens += sum(len(ev["tokens"]) for ev in engine.step())
            t2 = time.perf_counter()
            if warm:
                continue
            assert len(first) == n and sum(len(ev["tokens"]) for ev in first) == 2 * n
            assert n_tokens == n * (gen - 2)
            out.append({"n_seqs": n, "n_prompt": self.n_prompt, "n_gen": gen, "prefill_s": t1 - t0,
                        "decode_s": t2 - t1, "decode_tokens": n_tokens,
                        "tok_s": n_tokens / (t2 - t1), "per_seq_tok_s": n_tokens / (t2 - t1) / n})
            print(f"deltaspec  N={n:3d}: {out[-1]['tok_s']:9.1f} tok/s aggregate, "
                  f"{out[-1]['per_seq_tok_s']:7.1f} per sequence", flush=True)
        return out

    def close(self) -> None:
        self.model.close()


def measure_peer(binary: str, model_path: str, n_seqs: list[int], n_prompt: int, n_gen: int,
                 device: str) -> list[dict]:
    n_ctx = max(n_seqs) * (n_prompt + n_gen)
    cmd = [binary, "-m", model_path, "-c", str(n_ctx), "-b", "2048", "-ub", "512", "-npp", str(n_prompt),
           "-ntg", str(n_gen), "-npl", ",".join(map(str, n_seqs)), "-fa", "on", "--output-format", "jsonl",
           "-ngl", "99" if device == "cuda" else "0"]
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    out = []
    for line in (p.stdout + "\n" + p.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            out.append({"n_seqs": r["pl"], "n_prompt": r["pp"], "n_gen": r["tg"], "tok_s": r["speed_tg"],
                        "per_seq_tok_s": r["speed_tg"] / r["pl"], "raw": r})
            print(f"llama.cpp  N={r['pl']:3d}: {r['speed_tg']:9.1f} tok/s aggregate", flush=True)
    if len(out) != len(n_seqs):
        raise RuntimeError(f"llama-batched-bench printed {len(out)} results for {len(n_seqs)} counts:\n{p.stdout[-3000:]}")
    return out


def summarize(reps: list[list[dict]]) -> list[dict]:
    """Per count: the median aggregate tok/s over the repetitions, with their min and max."""
    out = []
    for i, first in enumerate(reps[0]):
        vals = [rep[i]["tok_s"] for rep in reps]
        med = float(np.median(vals))
        out.append({"n_seqs": first["n_seqs"], "tok_s": med, "per_seq_tok_s": med / first["n_seqs"],
                    "tok_s_min": min(vals), "tok_s_max": max(vals), "reps": vals})
    return out


def table(ours: list[dict], peer: list[dict] | None) -> str:
    base = next((r["tok_s"] for r in ours if r["n_seqs"] == 1), None)
    rows = ["| sequences | deltaspec tok/s (min-max) | per sequence | vs 1 sequence | llama.cpp tok/s (min-max) | ratio |",
            "|---:|---:|---:|---:|---:|---:|"]
    by_n = {r["n_seqs"]: r for r in (peer or [])}
    for r in ours:
        p = by_n.get(r["n_seqs"])
        scale = f"{r['tok_s'] / base:.2f}x" if base else "-"
        ours_s = f"{r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})"
        rows.append(f"| {r['n_seqs']} | {ours_s} | {r['per_seq_tok_s']:.1f} | {scale} | "
                    f"{p['tok_s']:.1f} ({p['tok_s_min']:.1f}-{p['tok_s_max']:.1f}) | {r['tok_s'] / p['tok_s']:.2f}x |"
                    if p else f"| {r['n_seqs']} | {ours_s} | {r['per_seq_tok_s']:.1f} | {scale} | - | - |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--n-seqs", default="1,4,16,32", help="comma-separated sequence counts")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens per sequence")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median and spread)")
    ap.add_argument("--batched-bench", help="llama-batched-bench binary (without it: deltaspec alone)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    n_seqs = [int(x) for x in args.n_seqs.split(",")]
    if args.gen < 3 or args.prompt < 1 or not n_seqs or min(n_seqs) < 1 or args.reps < 1:
        ap.error("need --gen >= 3, --prompt >= 1, --reps >= 1 and sequence counts >= 1")
    ours_reps, peer_reps = [], []
    runner = Ours(args.model, args.device, n_seqs, args.prompt, args.gen, args.threads)
    try:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            ours_reps.append(runner.run())
            if args.batched_bench:
                peer_reps.append(measure_peer(args.batched_bench, args.model, n_seqs, args.prompt, args.gen,
                                              args.device))
    finally:
        runner.close()
    ours, peer = summarize(ours_reps), (summarize(peer_reps) if peer_reps else None)
    print(table(ours, peer))
    result = {"model": os.path.abspath(args.model), "device": args.device, "host": platform.node(),
              "n_prompt": args.prompt, "n_gen": args.gen, "reps": args.reps, "deltaspec": ours, "llama_cpp": peer,
              "deltaspec_runs": ours_reps, "llama_cpp_runs": peer_reps or None,
              "note": "aggregate decode tok/s (every sequence's tokens after its prefill step, over the time of "
                      "the steps); synthetic weights: the speed of the shapes and quant mix"}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
