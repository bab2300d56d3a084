"""A drafter under a grammar: drafting within it (each draft row masked with the grammar's state
after the drafts before it, the default) against drafting unconstrained and having the forbidden
proposals cut (DELTASPEC_DRAFT_IN_GRAMMAR=0), and against no speculation.

    python bench/grammar_draft_bench.py [--spec-type draft|mtp|dflash] [--target T.gguf [--draft D.gguf]]
                                        [--reps 3] [--draft-n-max 8] [--tree-budget 0] [--threads 1]
                                        [--out FILE.json]

--spec-type draft (a draft model, --draft), mtp (the target's own MTP head) or dflash (a DFlash
drafter, --draft). Without --target: tiny-vocabulary models with random weights, made to agree in
part so that acceptance is neither nil nor total: for draft, the target (seed 0) and the same
weights with one FFN scaled by 1.5 (as tests/test_structured_tree.py uses); for mtp, a target
with an MTP head that mixes in its hidden input at 0.5 (tests/test_batch_structured.py's); for
dflash, the target and the sharpened seed-3 tiny drafter (needs torch and the dflash package).
Workload: 4 JSON schemas x 3 prompts, greedy and sampled (3 seeds), max 400 tokens, each output
ended by its grammar. Per mode and sampler: tokens per target pass (generated tokens / verify
passes; 1.0 without speculation), drafted / accepted / cut tokens and masked draft rows (sums over
the workload), and decode tok/s; each repetition runs every mode in turn, and rows give the median
(min-max) over repetitions. Greedy outputs are checked
identical across modes (they must be: the grammar masks every verified row).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_cli import write_result

RESULTS = Path(__file__).resolve().parent / "results" / "latest"
SPEC_TYPES = ("draft", "mtp", "dflash")
PROMPTS = ["Hello", "the cat sat", "{"]
SAMPLERS = {"greedy": [dict(temperature=0.0)],
            "sampled": [dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, seed=s) for s in range(3)]}
MODES = ("within-grammar", "unconstrained", "no-speculation")
COUNTS = ("generated", "passes", "drafted", "accepted", "cut", "draft_rows")


def default_models(folder: Path, spec_type: str) -> tuple[Path, Path | None]:
    """The target and drafter files of --spec-type without --target (the drafter None for mtp; a
    DFlash drafter is written once the target is loaded, see main)."""
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    if spec_type == "mtp":
        return write_tiny_vocab_model(folder / "target.gguf", seed=0, mtp=True, mtp_hidden_scale=0.5), None
    target = write_tiny_vocab_model(folder / "target.gguf", seed=0)
    if spec_type == "dflash":
        return target, None
    draft = write_tiny_vocab_model(folder / "draft.gguf", seed=0,
                                   weight_map=lambda name, x: x * 1.5 if name == "blk.1.ffn_down.weight" else x)
    return target, draft


def run_mode(target, draft, grammars, mode: str, sampler: str, spec: dict) -> tuple[dict, list]:
    """The workload once in `mode`: summed counts, decode seconds, and the outputs' tokens."""
    os.environ["DELTASPEC_DRAFT_IN_GRAMMAR"] = "0" if mode == "unconstrained" else "1"
    sums = dict.fromkeys(COUNTS, 0)
    seconds, outputs = 0.0, []
    for name, grammar in grammars.items():
        for prompt in PROMPTS:
            for sampling in SAMPLERS[sampler]:
                kw = dict(max_tokens=400, grammar=grammar, **sampling)
                if mode != "no-speculation":
                    kw.update(spec)
                    if draft is not None:
                        kw["draft_model"] = draft
                r = target.generate(prompt, **kw)
                st = r.stats
                sums["generated"] += st.generated_tokens
                sums["passes"] += st.n_steps if mode != "no-speculation" else st.generated_tokens
                sums["drafted"] += st.n_drafted
                sums["accepted"] += st.n_accepted
                sums["cut"] += st.grammar_cut_tokens
                sums["draft_rows"] += st.grammar_draft_rows
                seconds += st.decode_seconds
                outputs.append(r.tokens)
    return {**sums, "decode_s": seconds}, outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec-type", choices=SPEC_TYPES, default="draft")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft-n-max", type=int, default=8)
    ap.add_argument("--tree-budget", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="default: results/latest/grammar_draft_bench[_mtp|_dflash].json")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.draft_n_max < 1 or args.tree_budget < 0:
        ap.error("--reps and --draft-n-max must be >= 1, --tree-budget >= 0")
    if args.spec_type == "mtp" and args.draft is not None:
        ap.error("--spec-type mtp drafts with the target's own MTP head: no --draft")
    if args.spec_type != "mtp" and (args.target is None) != (args.draft is None):
        ap.error(f"--spec-type {args.spec_type}: give --target and --draft together (or neither)")
    suffix = "" if args.spec_type == "draft" else f"_{args.spec_type}"
    out = args.out or str(RESULTS / f"grammar_draft_bench{suffix}.json")

    from deltaspec import Drafter, Grammar, Model
    from deltaspec.testing.json_schemas import BOUNDED_SCHEMAS

    folder = tempfile.TemporaryDirectory()
    if args.target:
        target_path, draft_path = Path(args.target), Path(args.draft) if args.draft else None
    else:
        target_path, draft_path = default_models(Path(folder.name), args.spec_type)
    kw = dict(n_ctx=768, n_threads=args.threads, progress=False)
    grammars = {name: Grammar.from_json_schema(schema) for name, schema in BOUNDED_SCHEMAS.items()}
    spec = dict(draft_n_max=args.draft_n_max, draft_n_min=1, tree_budget=args.tree_budget)
    if args.spec_type != "draft":
        spec["spec_type"] = args.spec_type
    runs: dict[tuple[str, str], list[dict]] = {}
    with Model(target_path, **kw) as target:
        draft = None
        if args.spec_type == "draft":
            draft = Model(draft_path, **kw)
        elif args.spec_type == "dflash":
            if draft_path is None:
                from deltaspec.testing.tiny_dflash import write_sharp_tiny_dflash

                draft_path = write_sharp_tiny_dflash(target, Path(folder.name) / "dflash.gguf")
            draft = Drafter(draft_path, target=target)
        try:
            for rep in range(args.reps):
                for sampler in SAMPLERS:
                    greedy_outputs = {}
                    for mode in MODES:
                        print(f"repetition {rep + 1} of {args.reps}: {sampler}, {mode}", file=sys.stderr)
                        counts, outputs = run_mode(target, draft, grammars, mode, sampler, spec)
                        runs.setdefault((sampler, mode), []).append(counts)
                        greedy_outputs[mode] = outputs
                    if sampler == "greedy" and len({str(o) for o in greedy_outputs.values()}) != 1:
                        raise SystemExit("greedy outputs differ between modes: a bug (every verified row is masked)")
        finally:
            if isinstance(draft, Model):
                draft.close()
    os.environ.pop("DELTASPEC_DRAFT_IN_GRAMMAR", None)

    rows = []
    for (sampler, mode), reps in runs.items():
        per_pass = [r["generated"] / r["passes"] for r in reps]
        tok_s = [r["generated"] / r["decode_s"] for r in reps]
        rows.append({"sampler": sampler, "mode": mode, "tokens_per_pass": float(np.median(per_pass)),
                     "tokens_per_pass_range": [min(per_pass), max(per_pass)], "tok_s": float(np.median(tok_s)),
                     "tok_s_range": [min(tok_s), max(tok_s)], **{k: reps[-1][k] for k in COUNTS}})
    drafter = {"draft": f"draft model {draft_path.name if draft_path else ''}", "mtp": "the target's MTP head",
               "dflash": f"DFlash drafter {draft_path.name if draft_path else ''}"}[args.spec_type]
    print(f"\nDrafting under a grammar: target {target_path.name}, {drafter}, "
          f"draft_n_max {args.draft_n_max}, tree budget {args.tree_budget}, {args.reps} repetitions, "
          f"{args.threads} thread(s); counts are one repetition's (the same in each: greedy and seeded)\n")
    print("| sampler | mode | tokens per target pass | decode tok/s | drafted | accepted | cut | masked draft rows |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lo, hi = r["tokens_per_pass_range"]
        tlo, thi = r["tok_s_range"]
        print(f"| {r['sampler']} | {r['mode']} | {r['tokens_per_pass']:.2f} ({lo:.2f}-{hi:.2f}) | "
              f"{r['tok_s']:.1f} ({tlo:.1f}-{thi:.1f}) | {r['drafted']} | {r['accepted']} | {r['cut']} | "
              f"{r['draft_rows']} |")
    meta = {"spec_type": args.spec_type, "target": str(target_path), "draft": str(draft_path) if draft_path else None,
            "reps": args.reps, "draft_n_max": args.draft_n_max,
            "tree_budget": args.tree_budget, "threads": args.threads, "machine": platform.node()}
    write_result(out, {"meta": meta, "rows": rows})
    folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
