"""A/B of a tree verify's cost under environment switches read once per process (DELTASPEC_*):
bench/tree_verify_cost.py run in a fresh process per configuration, the configurations interleaved.

    python bench/tree_ab.py MODEL.gguf --device cuda --configs '|DELTASPEC_ROWS_DEFER_OUTPUT=0' \
        [--widths 22] [--reps 3] [--steps 20] [--out FILE.json]

--configs: '|'-separated configurations, each a space-separated list of VAR=VALUE (the empty one is
the default build's behaviour). Switches such as DELTASPEC_ROWS_DEFER_OUTPUT are read once in a
process, so two models in one process cannot compare them; here every repetition runs each
configuration once, in turn (config 1, 2, ..., then again), each a tree_verify_cost.py --reps 1 of
its own, so that a drift of the machine spreads over all of them. The table gives per configuration
the decode step, the tree verify and the chain verify of 1 + W rows (median over repetitions
[min-max] of medians of --steps) and the tree verify in decode steps of the same process; the JSON
keeps every child's measurements and the DELTASPEC_* environment it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from tree_verify_cost import spread  # noqa: E402


def parse_configs(text: str) -> list[dict[str, str]]:
    """'A=1 B=2|C=3' -> [{'A': '1', 'B': '2'}, {'C': '3'}]; '' is one default configuration."""
    configs = []
    for part in text.split("|"):
        config = {}
        for word in part.split():
            name, sep, value = word.partition("=")
            if not sep or not name:
                raise SystemExit(f"tree_ab: a configuration is VAR=VALUE words, got {word!r} in {part!r}")
            config[name] = value
        configs.append(config)
    return configs


def label(config: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items()) or "default"


def run_child(args, config: dict[str, str], out: Path) -> dict:
    env = {**os.environ, **config}
    cmd = [sys.executable, str(HERE / "tree_verify_cost.py"), args.model, "--device", args.device,
           "--widths", args.widths, "--reps", "1", "--steps", str(args.steps), "--depth", str(args.depth),
           "--out", str(out)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"tree_ab: tree_verify_cost.py failed under {label(config)}:\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", required=True, help="'|'-separated VAR=VALUE lists ('' = default)")
    ap.add_argument("--widths", default="22", help="tree nodes N, verified as 1 + N rows (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=20, help="timings per measurement (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=256, help="context tokens before measuring (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest" / "tree_ab.json")
    args = ap.parse_args()
    configs = parse_configs(args.configs)
    if len(configs) < 2:
        raise SystemExit("tree_ab: --configs needs two configurations or more (an A and a B), e.g. '|VAR=0'")
    if args.reps < 1:
        raise SystemExit(f"tree_ab: --reps must be >= 1, got {args.reps}")
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        widths = []
    if not widths or any(w < 1 for w in widths):
        raise SystemExit(f"tree_ab: --widths must be positive integers separated by commas, got {args.widths!r}")

    children = []  # in the order they ran
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for i, config in enumerate(configs):
                print(f"repetition {rep + 1} of {args.reps}: {label(config)}", file=sys.stderr, flush=True)
                result = run_child(args, config, Path(tmp) / f"{rep}_{i}.json")
                children.append(dict(config=i, rep=rep + 1, env=result["meta"].get("env", {}),
                                     ms=result["runs"][0]["ms"]))

    print(f"\nTree verify A/B on {Path(args.model).name}, device {args.device}, depth {args.depth}: "
          f"ms = median over {args.reps} interleaved repetitions [min-max] of medians of {args.steps}, "
          f"each configuration in processes of its own\n")
    names = ["decode step"] + [f"{kind} verify 1+{w}" for w in widths for kind in ("tree", "chain")]
    print("| configuration | " + " | ".join(names) + " | " + " | ".join(f"tree 1+{w} in steps" for w in widths) + " |")
    print("|---|" + "---:|" * (len(names) + len(widths)))
    table = []
    for i, config in enumerate(configs):
        ms = {name: [c["ms"][name] for c in children if c["config"] == i] for name in names}
        step = statistics.median(ms["decode step"])
        steps = {w: statistics.median(ms[f"tree verify 1+{w}"]) / step for w in widths}
        table.append(dict(config=config, ms=ms, tree_steps={str(w): s for w, s in steps.items()}))
        print(f"| {label(config)} | " + " | ".join(spread(ms[n]) for n in names) + " | "
              + " | ".join(f"{steps[w]:.3f}" for w in widths) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=dict(model=str(args.model), device=args.device, depth=args.depth,
                                                  steps=args.steps, reps=args.reps, widths=widths),
                                        table=table, children=children), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
