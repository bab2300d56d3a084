"""What verifying a draft chain costs next to one decode step, greedy and sampled, and what rolling back costs.

    python bench/verify_cost.py MODEL.gguf [--device cuda] [--out FILE.json]

T is the number of rows a verify pass evaluates: the last committed token + T-1 drafted tokens.
`generate(..., draft_n_max=16)` (the default) verifies T = 17 (csrc/speculative.cpp: the batch is
[next, drafts...] with at most draft_n_max drafts), so T = 17 comes first in every table; the
other chain lengths (--chains) follow.

Two ways to pay for a verify pass, as generate() takes them:
* greedy (temperature 0): `eval_verify_argmax`, every row's argmax computed on the device, T
  integers to the host;
* sampled (temperature > 0): `eval_verify`, T x n_vocab float logits to the host, then the
  sampler's chain (penalties, top-k 40, top-p 0.95, min-p 0.05, temperature 0.8: generate()'s
  defaults) on every row in accept_draft().
Both are timed from Python with keep(1) (the rollback of a fully rejected draft) against a greedy
decode step (`eval_argmax` of one token); median of --steps timings after a warm-up, at a context
depth of --depth tokens; then keep(n) alone after the longest chain for n = 1, half of it and all
of it. The sampler is not reachable from Python, so its cost is taken from generate() itself:
speculative generation with a self-draft (the target's file loaded a second time, draft_n_min =
draft_n_max, so every round drafts T-1 tokens and, the draft being the target, accepts nearly all
of them: a batch's kernels may round differently from one token's, so the acceptance is
printed), greedy and sampled, split by generate()'s own stats into draft, verify
(the pass itself, logits or argmax to the host included), rollback and the rest of a round (for
the sampled path: the sampler on all T rows, the acceptance test, the text pieces out), and the
same for plain decoding (one row: eval_argmax, or the last row's logits + the sampler).
Speculative decoding pays off when verify(T) stays close to one step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "verify_cost.json"
DEFAULT_DRAFT_N_MAX = 16  # Model.generate's draft_n_max
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)  # Model.generate's defaults


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def direct_rows(model, chains: list[int], depth: int, steps: int) -> list[dict]:
    """verify + keep(1), greedy and with full logits, for each T; keep(n) alone; from Python."""
    engine = model._live()
    engine.reserve_slots(max(chains))
    rng = np.random.default_rng(0)
    n_vocab = model.n_vocab
    engine.eval(rng.integers(0, n_vocab, size=depth).astype(np.int32), logits="none")

    def token():
        return np.array([rng.integers(0, n_vocab)], dtype=np.int32)

    for _ in range(3):  # warm-up: graphs built, CUDA graphs captured
        engine.eval_argmax(token())
    step = timed(lambda: engine.eval_argmax(token()), steps)
    rows = [dict(T=1, path="greedy", kind="decode step (eval_argmax)", ms=1e3 * step, ratio=1.0)]
    for T in chains:
        batch = rng.integers(0, n_vocab, size=T).astype(np.int32)
        for path, verify in (("greedy", engine.eval_verify_argmax), ("sampled", engine.eval_verify)):
            def once():
                verify(batch)
                engine.keep(1)

            for _ in range(3):
                once()
            t = timed(once, steps)
            what = "argmax on the device" if path == "greedy" else f"{T} x {n_vocab} logits to the host"
            rows.append(dict(T=T, path=path, kind=f"verify + keep(1), {what}", ms=1e3 * t, ratio=t / step))
    T = max(chains)
    longest = rng.integers(0, n_vocab, size=T).astype(np.int32)
    for n in sorted({1, max(1, T // 2), T}):
        keeps = []
        for _ in range(steps):
            engine.eval_verify_argmax(longest)
            t0 = time.perf_counter()
            engine.keep(n)
            keeps.append(time.perf_counter() - t0)
        t_keep = statistics.median(keeps)
        rows.append(dict(T=T, path="either", kind=f"keep({n}) alone (rollback)", ms=1e3 * t_keep, ratio=t_keep / step))
    return rows


def in_loop_rows(model, draft, draft_n_max: int, rounds: int, step_ms: float) -> list[dict]:
    """generate()'s own split of a speculative round with a self-draft, greedy and sampled, and of a plain step."""
    T = draft_n_max + 1
    # 1 token from the prefill, then `rounds` rounds of T-1 accepted drafts + 1 bonus token each
    n_tokens = 1 + rounds * T
    prompt = np.random.default_rng(1).integers(0, model.n_vocab, size=64).tolist()
    rows = []
    for path, sampling in (("greedy", dict(temperature=0.0)), ("sampled", SAMPLED)):
        plain = model.generate(prompt, max_tokens=n_tokens, seed=1, **sampling)
        per = 1e3 * plain.stats.decode_seconds / max(1, plain.stats.generated_tokens - 1)
        rows.append(dict(T=1, path=path, kind="plain decode step in generate()", ms=per, ratio=per / step_ms,
                         tokens=plain.stats.generated_tokens))
        model.generate(prompt, max_tokens=T + 2, seed=1, draft_model=draft, draft_n_max=draft_n_max,
                       draft_n_min=draft_n_max, **sampling)  # warm-up: the verify graph of T rows
        res = model.generate(prompt, max_tokens=n_tokens, seed=1, draft_model=draft, draft_n_max=draft_n_max,
                             draft_n_min=draft_n_max, **sampling)
        s = res.stats
        n_rounds = s.n_drafted // draft_n_max  # every draft shorter than draft_n_min is dropped
        if n_rounds == 0:
            raise RuntimeError(f"the self-draft drafted nothing ({s})")
        plain_steps = s.n_steps - n_rounds  # their time sits in verify_seconds too (a few, after a rejection)
        rest = s.decode_seconds - s.draft_seconds - s.verify_seconds - s.rollback_seconds
        acc = f"{s.n_accepted}/{s.n_drafted} drafts accepted, {n_rounds} rounds, {plain_steps} plain steps"
        for kind, seconds in (("verify (generate's verify_seconds)", s.verify_seconds),
                              ("rollback keep(1 + accepted)", s.rollback_seconds),
                              ("rest of the round: sampler on every row + acceptance + text out"
                               if path == "sampled" else "rest of the round: acceptance + text out", rest)):
            ms = 1e3 * seconds / n_rounds
            rows.append(dict(T=T, path=path, kind=f"self-draft round: {kind}", ms=ms, ratio=ms / step_ms,
                             acceptance=acc))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chains", default="17,1,2,4,8,9,16,32",
                    help="T, rows verified (default: %(default)s; 17 = generate()'s default draft_n_max 16 + 1)")
    ap.add_argument("--steps", type=int, default=20, help="timings per measurement (default: %(default)s)")
    ap.add_argument("--depth", type=int, default=256, help="context tokens before measuring (default: %(default)s)")
    ap.add_argument("--draft-n-max", type=int, default=DEFAULT_DRAFT_N_MAX,
                    help="draft length of the generate() rounds, T - 1 (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=8, help="generate() rounds per path (default: %(default)s)")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate() rounds (no second model copy)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = ap.parse_args()

    from deltaspec import Model

    chains = [int(x) for x in args.chains.split(",")]
    if any(T < 1 for T in chains):
        raise SystemExit(f"verify_cost: --chains must be positive integers, got {args.chains!r}")
    n_ctx = args.depth + 4096
    model = Model(args.model, n_ctx=n_ctx, n_threads=args.threads, device=args.device, progress=False)
    rows = direct_rows(model, chains, args.depth, args.steps)
    step_ms = rows[0]["ms"]
    if not args.no_generate:
        draft = Model(args.model, n_ctx=n_ctx, n_threads=args.threads, device=args.device, progress=False)
        rows += in_loop_rows(model, draft, args.draft_n_max, args.rounds, step_ms)
        draft.close()
    model.close()

    print(f"Verify cost on {Path(args.model).name}, device {args.device}, depth {args.depth}, median of "
          f"{args.steps}; T = rows verified = 1 + drafted tokens (generate()'s default draft_n_max = 16: T = 17)\n")
    print("| T | path | what | ms | x greedy decode step |")
    print("|---:|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['path']} | {r['kind']} | {r['ms']:.3f} | {r['ratio']:.2f} |")
    for acc in dict.fromkeys(r["acceptance"] for r in rows if "acceptance" in r):
        print(f"\nself-draft: {acc}")
    commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    meta = dict(model=str(args.model), device=args.device, depth=args.depth, steps=args.steps,
                draft_n_max=args.draft_n_max, rounds=args.rounds, sampled=SAMPLED, machine=platform.node(),
                date=time.strftime("%Y-%m-%d %H:%M", time.gmtime()), commit=commit or None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
