"""What the bench scripts share: the options of a decode benchmark over N sequences, and how a result
is written (bench/results/latest/ by default; bench/archive_latest.sh moves older ones)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def batch_decode_args(description: str, default_out: Path, n_seqs: str, gen: int, min_gen: int, argv=None,
                      prompt_help: str | None = None) -> tuple[argparse.Namespace, list[int]]:
    """model, --device, --n-seqs (comma-separated counts), --prompt, --gen, --threads, --reps, --out;
    returns the options and the sequence counts (a usage error for --gen < min_gen, --reps < 1 or a
    count < 1)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--n-seqs", default=n_seqs)
    ap.add_argument("--prompt", type=int, default=64, help=prompt_help)
    ap.add_argument("--gen", type=int, default=gen)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.n_seqs.split(",")]
    if args.gen < min_gen or args.reps < 1 or min(counts) < 1:
        ap.error(f"need --gen >= {min_gen}, --reps >= 1 and sequence counts >= 1")
    return args, counts


def write_result(out: str | Path, result: dict) -> None:
    """The result as indented JSON at `out` (its folder made), and a line saying so."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
