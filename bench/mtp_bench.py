"""MTP drafting (spec_type "mtp"): the cost of a round with N = 1..5 drafts, and llama.cpp's
draft-mtp on the same file in the same run.

    python bench/mtp_bench.py MODEL.gguf [--device cuda] [--llama-build DIR] [--acceptance 1:1.7,2:2.2,...]

MODEL is a qwen35 GGUF with an MTP layer, e.g. the shape-faithful synthetic 27B:
`deltaspec synth 27b-mtp.gguf --preset 27b --quant q4_k_m --mtp`. Its weights are RANDOM: drafts are almost never
accepted, so what is measured is the cost of a round (N head steps + a verify of N + 1 tokens +
the rollback), not a speed-up. draft_n_min = draft_n_max = N makes every round draft exactly N.
Tokens/s at an acceptance length L (mean tokens a round emits, 1 + accepted drafts, e.g. from
the testbed) is L / round time: pass --acceptance to get that column.

llama.cpp: with --llama-build DIR (a build folder of the pinned tree, e.g. the one
`bench/peers/llama_cpp.py build --cuda` made), its `llama-speculative-simple` is built there
(LLAMA_BUILD_EXAMPLES turned on in the same folder: only that target compiles) and run with
`--spec-type draft-mtp --spec-draft-n-max N` on the same file and prompt; its round time is its
decode time over its rounds (tokens - accepted drafts).

Reps are interleaved (deltaspec N=1..5, llama.cpp N=1..5, again); medians and spreads are printed
and written to bench/results/latest/mtp_bench.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n"


def deltaspec_run(model, ids, n_tokens, n_draft):
    kw = dict(temperature=0, max_tokens=n_tokens)
    if n_draft:
        kw.update(spec_type="mtp", draft_n_max=n_draft, draft_n_min=n_draft)
    r = model.generate(ids, **kw)
    s = r.stats
    out = dict(tokens=len(r.tokens), decode_s=s.decode_seconds, tok_s=len(r.tokens) / s.decode_seconds)
    if n_draft:
        rounds = max(1, s.n_steps)
        out.update(rounds=rounds, drafted=s.n_drafted, accepted=s.n_accepted,
                   round_ms=1e3 * s.decode_seconds / rounds, draft_ms=1e3 * s.draft_seconds / rounds,
                   verify_ms=1e3 * s.verify_seconds / rounds, rollback_ms=1e3 * s.rollback_seconds / rounds)
    return out


def build_speculative_simple(build: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from bench.peers.llama_cpp import upstream_tree

    subprocess.run(["cmake", "-S", str(upstream_tree()), "-B", str(build), "-DLLAMA_BUILD_EXAMPLES=ON"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-speculative-simple", "-j"], check=True,
                   stdout=subprocess.DEVNULL)
    return build / "bin" / "llama-speculative-simple"


def llama_run(tool: Path, path: str, n_tokens: int, n_draft: int, gpu: bool) -> dict:
    cmd = [str(tool), "-m", path, "-p", PROMPT, "-n", str(n_tokens), "--temp", "0", "--spec-type", "draft-mtp",
           "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", str(n_draft), "-c", "4096", "--seed", "1"]
    if gpu:
        cmd += ["-ngl", "99", "--spec-draft-ngl", "99", "-fa", "on"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = proc.stdout
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    acc = re.search(r"n_accept\s+=\s+(\d+)", text)
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", text)
    if proc.returncode != 0 or not m or not acc:
        raise RuntimeError(f"llama-speculative-simple failed ({proc.returncode}):\n{text[-3000:]}")
    tokens, secs, accepted = int(m.group(1)), float(m.group(2)), int(acc.group(1))
    rounds = max(1, tokens - accepted)
    return dict(tokens=tokens, decode_s=secs, tok_s=tokens / secs, accepted=accepted,
                drafted=int(drafted.group(1)) if drafted else None, round_ms=1e3 * secs / rounds)


def med(rows, key):
    vals = [r[key] for r in rows]
    return statistics.median(vals), (max(vals) - min(vals)) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("-n", "--n-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-draft", type=int, default=5)
    ap.add_argument("--llama-build", type=Path, default=None, help="llama.cpp build folder of the pinned tree")
    ap.add_argument("--acceptance", default="", help="N:L pairs (mean tokens per round at N drafts), comma-separated")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "latest" / "mtp_bench.json")
    args = ap.parse_args()
    acceptance = {int(k): float(v) for k, v in (p.split(":") for p in args.acceptance.split(",") if p)}

    from deltaspec import Model

    gpu = args.device != "cpu"
    tool = build_speculative_simple(args.llama_build) if args.llama_build else None
    ns = list(range(0, args.max_draft + 1))  # 0: plain decoding
    ours = {n: [] for n in ns}
    peer = {n: [] for n in ns[1:]}
    with Model(args.model, n_ctx=4096, device=args.device) as model:
        ids = model.tokenize(PROMPT)
        deltaspec_run(model, ids, 16, 2)  # warm-up: graphs, head, CUDA kernels
        for rep in range(args.reps):
            for n in ns:
                ours[n].append(deltaspec_run(model, ids, args.n_tokens, n))
            if tool:
                model_path = model.path
                for n in ns[1:]:
                    peer[n].append(llama_run(tool, model_path, args.n_tokens, n, gpu))
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    plain_ms = 1e3 / med(ours[0], "tok_s")[0]
    print(f"{args.model} on {args.device}; {args.n_tokens} tokens, {args.reps} reps, median (± half range)")
    print(f"plain decoding: {med(ours[0], 'tok_s')[0]:.1f} tok/s ({plain_ms:.2f} ms/token)")
    head = f"{'N':>2} | {'round ms':>14} | {'draft':>7} | {'verify':>7} | {'rollbk':>7} | {'x plain':>7} | {'acc':>5}"
    if acceptance:
        head += f" | {'tok/s @L':>12}"
    if tool:
        head += f" | {'llama round ms':>16} | {'llama acc':>9}"
    print(head)
    summary = {"model": args.model, "device": args.device, "n_tokens": args.n_tokens, "reps": args.reps,
               "weights": "random (synthetic): round costs, not speed-ups",
               "plain": {"tok_s": med(ours[0], "tok_s")}, "mtp": {}, "llama_cpp_draft_mtp": {}}
    for n in ns[1:]:
        r, spread = med(ours[n], "round_ms")
        row = f"{n:>2} | {r:8.2f} ±{spread:5.2f} | {med(ours[n], 'draft_ms')[0]:7.2f} | " \
              f"{med(ours[n], 'verify_ms')[0]:7.2f} | {med(ours[n], 'rollback_ms')[0]:7.2f} | {r / plain_ms:7.2f} | " \
              f"{sum(x['accepted'] for x in ours[n]):>5}"
        entry = {k: med(ours[n], k) for k in ("round_ms", "draft_ms", "verify_ms", "rollback_ms", "tok_s")}
        if acceptance:
            L = acceptance.get(n)
            tps = 1e3 * L / r if L else None
            row += f" | {tps:12.1f}" if tps else f" | {'-':>12}"
            entry["tok_s_at_acceptance"] = (L, tps)
        if tool:
            pr, ps = med(peer[n], "round_ms")
            row += f" | {pr:9.2f} ±{ps:5.2f} | {sum(x['accepted'] for x in peer[n]):>9}"
            summary["llama_cpp_draft_mtp"][n] = {k: med(peer[n], k) for k in ("round_ms", "tok_s")}
        summary["mtp"][n] = entry
        print(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": {"deltaspec": ours, "llama_cpp": peer}}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
