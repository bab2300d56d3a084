"""MTP drafting (spec_type "mtp"): the cost of a round with N = 1..5 drafts, chains and trees, and
llama.cpp's draft-mtp on the same file in the same run.

    python bench/mtp_bench.py MODEL.gguf [--device cuda] [--llama-build DIR] [--trees 3:8,5:16]
                              [--acceptance 1:1.7,2:2.2,...]

MODEL is a qwen35 GGUF with an MTP layer, e.g. the shape-faithful synthetic 27B:
`deltaspec synth 27b-mtp.gguf --preset 27b --quant q4_k_m --mtp`. Its weights are RANDOM: drafts are almost never
accepted, so what is measured is the cost of a round (N head steps + a verify of N + 1 tokens +
the rollback), not a speed-up. draft_n_min = draft_n_max = N makes every round draft exactly N.
Tokens/s at an acceptance length L (mean tokens a round emits, 1 + accepted drafts, e.g. from
the testbed) is L / round time: pass --acceptance to get that column.

Trees (--trees N:B,...): spec_type "mtp" with tree_budget B, depth N: the head's top-1 chain of N
with its next-best tokens as extra leaves, B nodes in all, verified in one pass of B + 1 rows
(Engine::verify_tree) and the accepted path kept (keep_path). Same head steps as the chain of N.

llama.cpp: with --llama-build DIR (a build folder of the pinned tree, or its bin folder, e.g. the
one `bench/peers/llama_cpp.py build --cuda` made), llama-speculative-simple is compiled against
its libraries (bench/peers/llama_speculative.py: one source file, seconds) and run with
`--spec-type draft-mtp --spec-draft-n-max N --spec-draft-n-min N`, greedy, on the same file and
prompt; its tokens/s is tokens over its decode loop's time, its round time that time over its
rounds (tokens - accepted drafts: with draft-mtp it keeps N recurrent-state snapshots, so a
rejected draft costs no second target pass).

Reps are interleaved (deltaspec plain, N=1..5, the trees, then llama.cpp N=1..5, again); medians and
spreads (half the range) are printed and written to bench/results/latest/mtp_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.peers.llama_cpp import PeerError  # noqa: E402
from bench.peers.llama_speculative import build_speculative_simple, run_draft_mtp  # noqa: E402

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n"


def deltaspec_run(model, ids, n_tokens, n_draft, tree_budget=0):
    kw = dict(temperature=0, max_tokens=n_tokens)
    if n_draft:
        kw.update(spec_type="mtp", draft_n_max=n_draft, draft_n_min=n_draft, tree_budget=tree_budget)
    r = model.generate(ids, **kw)
    s = r.stats
    out = dict(tokens=len(r.tokens), decode_s=s.decode_seconds, tok_s=len(r.tokens) / s.decode_seconds)
    if n_draft:
        rounds = max(1, s.n_steps)
        out.update(rounds=rounds, drafted=s.n_drafted, accepted=s.n_accepted, tree_nodes=s.n_tree_nodes,
                   round_ms=1e3 * s.decode_seconds / rounds, draft_ms=1e3 * s.draft_seconds / rounds,
                   verify_ms=1e3 * s.verify_seconds / rounds, rollback_ms=1e3 * s.rollback_seconds / rounds)
    return out


def llama_run(tool: Path, path: str, n_tokens: int, n_draft: int, gpu: bool, threads: int | None = None) -> dict:
    r = run_draft_mtp(tool, path, PROMPT, n_tokens, n_draft, gpu=gpu, threads=threads)
    rounds = max(1, r.n_predict - r.n_accept)
    return dict(tokens=r.n_predict, decode_s=r.decode_s, tok_s=r.tok_s, accepted=r.n_accept, drafted=r.n_drafted,
                round_ms=1e3 * r.decode_s / rounds)


def med(rows, key):
    vals = [r[key] for r in rows]
    return statistics.median(vals), (max(vals) - min(vals)) / 2


def llama_bin(build: Path) -> Path:
    return build if (build / "libllama.so").exists() else build / "bin"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", "--n-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--trees", default="3:8,5:16", help="N:B pairs (tree depth N, tree_budget B), comma-separated")
    ap.add_argument("--llama-build", type=Path, default=None, help="llama.cpp build folder of the pinned tree")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of deltaspec and llama.cpp (--device cpu)")
    ap.add_argument("--acceptance", default="", help="N:L pairs (mean tokens per round at N drafts), comma-separated")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "latest" / "mtp_bench.json")
    args = ap.parse_args()
    acceptance = {int(k): float(v) for k, v in (p.split(":") for p in args.acceptance.split(",") if p)}
    trees = [tuple(int(x) for x in p.split(":")) for p in args.trees.split(",") if p]

    from deltaspec import Model

    gpu = args.device != "cpu"
    tool, peer_error = None, None
    if args.llama_build:
        try:
            tool = build_speculative_simple(llama_bin(args.llama_build))
        except PeerError as e:  # the deltaspec rows are still worth having; the table says the peer is missing
            peer_error = str(e)
            print(f"llama.cpp's draft-mtp peer unavailable: {e}", file=sys.stderr)
    # (label, N, tree_budget); N = 0: plain decoding
    configs = [("plain", 0, 0)] + [(f"chain {n}", n, 0) for n in range(1, args.max_draft + 1)]
    configs += [(f"tree {n}/{b}", n, b) for n, b in trees]
    ours = {c[0]: [] for c in configs}
    peer = {f"chain {n}": [] for n in range(1, args.max_draft + 1)} if tool else {}
    kw = {"n_threads": args.threads} if args.threads else {}
    with Model(args.model, n_ctx=4096, device=args.device, **kw) as model:
        ids = model.tokenize(PROMPT)
        deltaspec_run(model, ids, 16, 2)  # warm-up: graphs, head, CUDA kernels
        for n, b in trees:
            deltaspec_run(model, ids, 16, n, b)
        for rep in range(args.reps):
            for label, n, b in configs:
                ours[label].append(deltaspec_run(model, ids, args.n_tokens, n, b))
            for label in peer:
                n = int(label.split()[1])
                peer[label].append(llama_run(tool, model.path, args.n_tokens, n, gpu, args.threads))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    plain_ms = 1e3 / med(ours["plain"], "tok_s")[0]
    print(f"{args.model} on {args.device}; {args.n_tokens} tokens, {args.reps} reps, median (± half range)")
    print(f"plain decoding: {med(ours['plain'], 'tok_s')[0]:.1f} tok/s ({plain_ms:.2f} ms/token)")
    if peer_error:
        print(f"llama.cpp draft-mtp: NOT RUN ({peer_error.splitlines()[0]})")
    head = f"{'drafts':>10} | {'tok/s':>13} | {'round ms':>14} | {'draft':>6} | {'verify':>6} | {'rollbk':>6} | " \
           f"{'x plain':>7} | {'acc':>4}"
    if acceptance:
        head += f" | {'tok/s @L':>8}"
    if tool:
        head += f" | {'llama tok/s':>13} | {'llama round ms':>14} | {'l.acc':>5}"
    print(head)
    summary = {"model": args.model, "device": args.device, "n_tokens": args.n_tokens, "reps": args.reps,
               "weights": "random (synthetic): round costs, not speed-ups",
               "plain": {"tok_s": med(ours["plain"], "tok_s")}, "mtp": {}, "mtp_tree": {},
               "llama_cpp_draft_mtp": {"error": peer_error} if peer_error else {}}
    for label, n, b in configs[1:]:
        rows = ours[label]
        r, spread = med(rows, "round_ms")
        t, t_spread = med(rows, "tok_s")
        row = f"{label:>10} | {t:7.1f} ±{t_spread:4.1f} | {r:7.2f} ±{spread:5.2f} | {med(rows, 'draft_ms')[0]:6.2f} | " \
              f"{med(rows, 'verify_ms')[0]:6.2f} | {med(rows, 'rollback_ms')[0]:6.2f} | {r / plain_ms:7.2f} | " \
              f"{sum(x['accepted'] for x in rows):>4}"
        entry = {k: med(rows, k) for k in ("round_ms", "draft_ms", "verify_ms", "rollback_ms", "tok_s")}
        if acceptance:
            L = acceptance.get(n) if not b else None
            tps = 1e3 * L / r if L else None
            row += f" | {tps:8.1f}" if tps else f" | {'-':>8}"
            entry["tok_s_at_acceptance"] = (L, tps)
        if label in peer:
            pt, pts = med(peer[label], "tok_s")
            pr, ps = med(peer[label], "round_ms")
            row += f" | {pt:7.1f} ±{pts:4.1f} | {pr:7.2f} ±{ps:5.2f} | {sum(x['accepted'] for x in peer[label]):>5}"
            summary["llama_cpp_draft_mtp"][n] = {k: med(peer[label], k) for k in ("round_ms", "tok_s")}
        elif tool:
            row += f" | {'-':>13} | {'-':>14} | {'-':>5}"
        if b:
            entry["tree_nodes_per_round"] = sum(x["tree_nodes"] for x in rows) / max(1, sum(x["rounds"] for x in rows))
            summary["mtp_tree"][f"{n}/{b}"] = entry
        else:
            summary["mtp"][n] = entry
        print(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": {"deltaspec": ours, "llama_cpp": peer}}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
