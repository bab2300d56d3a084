"""What one DFlash round costs, and llama.cpp's draft-dflash end to end on the same files.

    python bench/dflash_bench.py TARGET.gguf DRAFTER.gguf [--device cuda] [--budgets 16 22 32]
        [--depth 512] [--reps 3] [--llama-bin DIR] [--out FILE.json]

Files: a synthetic 27B target (`deltaspec synth --preset 27b --quant q4_k_m`) and a synthetic
drafter of the real Qwen3.5-27B-DFlash shape (`python -m deltaspec.synth_dflash D.gguf`): RANDOM
WEIGHTS, so nothing here measures acceptance; tokens/s are the round cost combined with stated
acceptance lengths (AL).

A round, as deltaspec runs it, at a context of --depth tokens:
  draft   one drafter pass over the block [anchor, mask x 15] (block_top1: argmax on the device)
  verify  the target over budget + 1 rows (the anchor + budget drafted nodes; chain-shaped: the
          tree mask arrives with the tree builders, a tree's rows cost what a chain's do to first
          order), argmax of every row, then keep(1)
  commit  the accepted rows' features injected into the drafter (AL rows)
and a plain decode step (eval_argmax) for reference. Each is timed --reps times, interleaved, after
a warm-up; median and spread (max - min) are reported. tokens/s at AL = AL / (draft + verify +
commit); AL = 8.3 is the seeds' (Qwen3.5-27B, DDTree budget 22, HumanEval), pass more with --al.

Tree rounds (--tree-budgets, default 16 22 32): the real loop, `generate(..., spec_type="dflash",
tree_budget=B, draft_n_min=1)` after a --depth-token prompt, --tree-tokens tokens, greedy, a tree
every round; its own timers per round: draft = the kept rows' features injected + one block pass +
each slot's top-K on the device + the DDTree build (DFlashDrafter::propose_tree), verify = the tree
verify of B + 1 rows (Engine::verify_tree, the rows ops) + the walk, commit = keep_path (KV rows
moved, the path's recurrent state replayed, its taps kept). The random drafter's trees are accepted
~never, so each round keeps one row; at AL n keep_path replays n rows (`commit` above measures the
drafter's side of that). --tree-sampled adds the same at T = 1 (every row's logits to the host, the
rejection walk).

--llama-bin DIR (a llama.cpp build with llama-speculative-simple; build one with --build-llama DIR
on the GPU machine): llama.cpp's draft-dflash chain (block 16: 15 drafts a round) on the same two
files, greedy, --llama-n tokens; its decode speed and acceptance as it prints them. Its drafts are
noise too (random drafter): this is llama.cpp's round cost in practice, not a speed-up.

--llama-bench PATH: llama.cpp's plain decoding of the same target (llama-bench tg128 at --depth, f16
KV, flash attention, one process per repetition, interleaved with the draft-dflash repetitions), the
baseline of the issue's goal: each deltaspec round's tokens/s at an AL as a multiple of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "latest" / "dflash_bench.json"


def stats(xs: list[float]) -> dict:
    return {"median_ms": round(1e3 * statistics.median(xs), 3), "spread_ms": round(1e3 * (max(xs) - min(xs)), 3),
            "n": len(xs)}


def deltaspec_rounds(args) -> dict:
    from deltaspec import Drafter, Model

    budgets = sorted(args.budgets)
    # every verify + keep(1) and plain step appends a row: the depth drifts by at most this much
    drift = (3 + args.reps * args.inner) * (len(budgets) + 1)
    n_ctx = args.depth + drift + max(budgets) + 64
    model = Model(args.target, n_ctx=n_ctx, device=args.device, progress=False)
    engine = model._live()
    engine.reserve_slots(max(budgets) + 1)  # before the context: it empties the sequence
    drafter = Drafter(args.drafter, target=model, n_ctx=n_ctx)
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, model.n_vocab, size=args.depth).tolist()
    drafter.read_context(ctx)  # the target reads the context with taps; the drafter holds its rows
    n_feat = drafter._core.n_feat
    commit_rows = max(1, int(round(max(args.al))))
    feats = rng.standard_normal((commit_rows, n_feat)).astype(np.float32)

    def tok():
        return np.array([rng.integers(0, model.n_vocab)], dtype=np.int32)

    def draft():
        drafter._core.block_top1(int(rng.integers(0, model.n_vocab)))

    verifies = {b: rng.integers(0, model.n_vocab, size=b + 1).astype(np.int32) for b in budgets}

    def verify(b):
        engine.eval_verify_argmax(verifies[b])
        engine.keep(1)

    def commit():
        drafter.inject(feats, args.depth)  # rows after the context, replaced every time

    # a plain decode step (one row, its argmax); as verify + keep(1), it grows the sequence by a row
    def plain():
        engine.eval_verify_argmax(tok())
        engine.keep(1)

    for _ in range(3):  # warm-up: graphs built (and captured on CUDA)
        draft(), commit(), plain()
        for b in budgets:
            verify(b)
    times: dict[str, list[float]] = {k: [] for k in ["draft", "commit", "plain"] + [f"verify_{b}" for b in budgets]}
    jobs = [("draft", draft), ("commit", commit), ("plain", plain)] + [(f"verify_{b}", lambda b=b: verify(b))
                                                                       for b in budgets]
    for _ in range(args.reps):
        for name, fn in jobs:  # interleaved: a slow spell hits every row alike
            for _ in range(args.inner):
                t0 = time.perf_counter()
                fn()
                # every call returns host data (argmax ids), so the device has finished
                times[name].append(time.perf_counter() - t0)
    out = {k: stats(v) for k, v in times.items()}
    d, c, p = out["draft"]["median_ms"], out["commit"]["median_ms"], out["plain"]["median_ms"]
    rounds = []
    for b in budgets:
        v = out[f"verify_{b}"]["median_ms"]
        r = d + v + c
        rounds.append({"budget": b, "verify_rows": b + 1, "draft_ms": d, "verify_ms": v, "commit_ms": c,
                       "round_ms": round(r, 3), "plain_step_ms": p,
                       "tok_s_at_al": {str(al): round(1e3 * al / r, 1) for al in args.al},
                       "plain_tok_s": round(1e3 / p, 1)})
    result = {"timings": out, "rounds": rounds, "depth": args.depth, "depth_end": int(engine.n_past),
            "device": args.device}
    model.close()
    return result


def tree_rounds(args) -> dict:
    """Rounds of the speculative loop with DFlash trees: per budget (and T), --reps runs interleaved."""
    from deltaspec import Drafter, Model

    budgets = sorted(args.tree_budgets)
    n_ctx = args.depth + args.tree_tokens + max(budgets) + 64
    model = Model(args.target, n_ctx=n_ctx, device=args.device, progress=False)
    drafter = Drafter(args.drafter, target=model, n_ctx=n_ctx)
    prompt = np.random.default_rng(1).integers(0, model.n_vocab, size=args.depth).tolist()
    temps = [0.0, 1.0] if args.tree_sampled else [0.0]
    cases = [(b, T) for T in temps for b in budgets]
    per: dict[tuple, dict[str, list[float]]] = {c: {"draft": [], "verify": [], "commit": [], "nodes": [], "al": []}
                                                for c in cases}

    def run(b, T, seed):
        r = model.generate(prompt, max_tokens=args.tree_tokens, temperature=T, top_k=0, top_p=1.0, min_p=0.0,
                           seed=seed, draft_model=drafter, spec_type="dflash", draft_n_max=drafter.block_size - 1,
                           draft_n_min=1, tree_budget=b)
        return r.stats

    for b, T in cases:  # warm-up: graphs of every shape built (and captured on CUDA)
        run(b, T, 0)
    for rep in range(args.reps):
        for b, T in cases:  # interleaved
            s = run(b, T, rep + 1)
            n = s.n_steps
            if s.n_tree_nodes == 0 or n == 0:
                raise RuntimeError(f"budget {b}, T {T}: no tree verified (n_steps {n})")
            v = per[(b, T)]
            v["draft"].append(s.draft_seconds / n)
            v["verify"].append(s.verify_seconds / n)
            v["commit"].append(s.rollback_seconds / n)
            v["nodes"].append(s.n_tree_nodes / n)
            v["al"].append((s.n_accepted + n) / n)
    rows = []
    for (b, T), v in per.items():
        t = {k: stats(v[k]) for k in ("draft", "verify", "commit")}
        rnd = [d + ve + c for d, ve, c in zip(v["draft"], v["verify"], v["commit"])]
        r_ms = stats(rnd)
        rows.append({"budget": b, "temperature": T, "verify_rows": b + 1, **{f"{k}_ms": t[k]["median_ms"] for k in t},
                     "round_ms": r_ms["median_ms"], "round_spread_ms": r_ms["spread_ms"], "runs": len(rnd),
                     "rounds_per_run": args.tree_tokens, "nodes_per_round": round(statistics.median(v["nodes"]), 2),
                     "measured_al": round(statistics.median(v["al"]), 3),
                     "tok_s_at_al": {str(al): round(1e3 * al / r_ms["median_ms"], 1) for al in args.al}})
    model.close()
    return {"rows": rows, "depth": args.depth, "tokens": args.tree_tokens, "device": args.device}


def build_llama(build_dir: Path, cuda: bool) -> Path:
    """llama.cpp's llama-speculative-simple from the pinned tree (the peer's flags, examples on)."""
    sys.path.insert(0, str(REPO / "bench" / "peers"))
    import llama_cpp as peer
    flags = [f for f in peer.cmake_flags(cuda) if "LLAMA_BUILD_EXAMPLES" not in f] + ["-DLLAMA_BUILD_EXAMPLES=ON"]
    subprocess.run(["cmake", "-S", str(peer.upstream_tree()), "-B", str(build_dir), "-G", "Ninja", *flags], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2), "--target",
                    "llama-speculative-simple"], check=True)
    return build_dir / "bin"


def llama_dflash(args, rep: int) -> dict:
    exe = Path(args.llama_bin) / "llama-speculative-simple"
    ngl = ["-ngl", "99", "-ngld", "99"] if args.device == "cuda" else []
    cmd = [str(exe), "-m", args.target, "-md", args.drafter, "--spec-type", "draft-dflash",
           "--spec-draft-n-max", "15", "-n", str(args.llama_n), "--temp", "0", "-c", str(args.depth + args.llama_n + 64),
           "-p", "def fibonacci(n):" * max(1, args.llama_prompt_repeat), "-fa", "on", *ngl]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=900)
    wall = time.perf_counter() - t0
    text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed ({r.returncode}): {text[-3000:]}")
    grab = {k: re.search(p, text) for k, p in {
        "decoded": r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s",
        "n_drafted": r"n_drafted\s*=\s*(\d+)", "n_accept": r"n_accept\s*=\s*(\d+)"}.items()}
    out = {"rep": rep, "wall_s": round(wall, 2), "cmd": " ".join(cmd)}
    if grab["decoded"]:
        out.update(decoded=int(grab["decoded"].group(1)), decode_s=float(grab["decoded"].group(2)),
                   tok_s=float(grab["decoded"].group(3)))
    for k in ("n_drafted", "n_accept"):
        if grab[k]:
            out[k] = int(grab[k].group(1))
    if "tok_s" not in out:
        out["log_tail"] = text[-1500:]
    return out


def llama_plain(args, rep: int) -> dict:
    """llama.cpp's plain decoding of the target: one llama-bench process, tg128 after --depth tokens."""
    cmd = [args.llama_bench, "-m", args.target, "-p", "0", "-n", "128", "-d", str(args.depth), "-fa", "1",
           "-ngl", "99" if args.device == "cuda" else "0", "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    tg = [x for x in json.loads(r.stdout) if x["n_gen"] and not x["n_prompt"]]
    return {"rep": rep, "test": f"tg128@d{args.depth}", "tok_s": float(tg[0]["avg_ts"])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budgets", type=int, nargs="+", default=[15, 16, 22, 32])
    ap.add_argument("--depth", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inner", type=int, default=5, help="timings per rep and row")
    ap.add_argument("--al", type=float, nargs="+", default=[4.0, 8.0, 8.3])
    ap.add_argument("--tree-budgets", type=int, nargs="*", default=[16, 22, 32],
                    help="DFlash + DDTree rounds through the speculative loop (none: skip)")
    ap.add_argument("--tree-tokens", type=int, default=64, help="tokens generated per tree run")
    ap.add_argument("--tree-sampled", action="store_true", help="tree rounds at T = 1 too")
    ap.add_argument("--llama-bin", default=None)
    ap.add_argument("--build-llama", default=None, metavar="DIR", help="build llama-speculative-simple into DIR first")
    ap.add_argument("--llama-bench", default=None, metavar="PATH",
                    help="llama-bench of the same tree: llama.cpp's plain decoding of the target (the goal's baseline)")
    ap.add_argument("--llama-n", type=int, default=256)
    ap.add_argument("--llama-prompt-repeat", type=int, default=8)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.build_llama:
        args.llama_bin = str(build_llama(Path(args.build_llama), args.device == "cuda"))
    report = {"target": os.path.basename(args.target), "drafter": os.path.basename(args.drafter),
              "note": "random weights: round costs only; tok/s at a stated acceptance length"}
    report["deltaspec"] = deltaspec_rounds(args)
    if args.tree_budgets:
        report["deltaspec_tree_rounds"] = tree_rounds(args)
    # llama.cpp's sides interleaved, a fresh process each: draft-dflash, then plain decoding
    for i in range(args.reps if (args.llama_bin or args.llama_bench) else 0):
        if args.llama_bin:
            report.setdefault("llama_cpp_draft_dflash", []).append(llama_dflash(args, i))
        if args.llama_bench:
            report.setdefault("llama_cpp_plain", []).append(llama_plain(args, i))
    if "llama_cpp_plain" in report:
        plain = statistics.median(r["tok_s"] for r in report["llama_cpp_plain"])
        report["llama_cpp_plain_median_tok_s"] = plain
        for r in report["deltaspec"]["rounds"] + report.get("deltaspec_tree_rounds", {}).get("rows", []):
            r["x_llama_plain_at_al"] = {al: round(v / plain, 2) for al, v in r["tok_s_at_al"].items()}
    print(f"deltaspec DFlash round at depth {args.depth} on {args.device} (median of {args.reps}x{args.inner}, ms):")
    print(f"{'budget':>6} {'rows':>4} {'draft':>8} {'verify':>8} {'commit':>8} {'round':>8} {'plain':>8}  tok/s at AL "
          + " / ".join(str(a) for a in args.al))
    for r in report["deltaspec"]["rounds"]:
        print(f"{r['budget']:>6} {r['verify_rows']:>4} {r['draft_ms']:>8.2f} {r['verify_ms']:>8.2f} {r['commit_ms']:>8.2f} "
              f"{r['round_ms']:>8.2f} {r['plain_step_ms']:>8.2f}  "
              + " / ".join(str(v) for v in r["tok_s_at_al"].values()) + f"  (plain {r['plain_tok_s']})")
    if "deltaspec_tree_rounds" in report:
        tr = report["deltaspec_tree_rounds"]
        print(f"deltaspec DFlash + DDTree rounds through generate() at depth {args.depth} on {args.device} "
              f"({args.tree_tokens} tokens a run, median of {args.reps} runs, ms per round):")
        print(f"{'budget':>6} {'T':>3} {'rows':>4} {'draft':>8} {'verify':>8} {'commit':>8} {'round':>8} {'spread':>7} "
              f"{'nodes':>6} {'AL':>5}  tok/s at AL " + " / ".join(str(a) for a in args.al))
        for r in tr["rows"]:
            print(f"{r['budget']:>6} {r['temperature']:>3g} {r['verify_rows']:>4} {r['draft_ms']:>8.2f} "
                  f"{r['verify_ms']:>8.2f} {r['commit_ms']:>8.2f} {r['round_ms']:>8.2f} {r['round_spread_ms']:>7.2f} "
                  f"{r['nodes_per_round']:>6} {r['measured_al']:>5}  " + " / ".join(str(v) for v in r["tok_s_at_al"].values()))
    if "llama_cpp_plain" in report:
        vals = [r["tok_s"] for r in report["llama_cpp_plain"]]
        print(f"llama.cpp plain decoding ({report['llama_cpp_plain'][0]['test']}, f16 KV): median "
              f"{report['llama_cpp_plain_median_tok_s']:.1f} tok/s [{min(vals):.1f}-{max(vals):.1f}]; deltaspec's rounds as multiples "
              "of it at AL " + " / ".join(str(a) for a in args.al) + ":")
        for r in report["deltaspec"]["rounds"]:
            print(f"  chain budget {r['budget']:>3}: " + " / ".join(f"{v}x" for v in r["x_llama_plain_at_al"].values()))
        for r in report.get("deltaspec_tree_rounds", {}).get("rows", []):
            print(f"  DDTree {r['budget']:>3} T={r['temperature']:g}: "
                  + " / ".join(f"{v}x" for v in r["x_llama_plain_at_al"].values()))
    for r in report.get("llama_cpp_draft_dflash", []):
        print(f"llama.cpp draft-dflash rep {r['rep']}: {r.get('tok_s', '?')} tok/s decode, "
              f"drafted {r.get('n_drafted', '?')} accepted {r.get('n_accept', '?')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
