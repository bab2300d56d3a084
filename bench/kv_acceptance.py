"""Acceptance length of speculative decoding per KV cache type of the target, on the trained testbed.

    python bench/kv_acceptance.py [--dir /work/testbed_files] [--threads 1]     # ~15 min on one core

The defaults aim at ~15 minutes of one CPU core: T = 0 on 32 of the 64 held-out prompts x 128 new
tokens, T = 1 on 12 prompts x 64 new tokens x 3 seeds, 8 types x 2 drafters each (a greedy
generation of 128 tokens takes 0.1-0.5 s on an idle core, most of it in the DFlash rows, whose
acceptance is low: many passes). The .md gives each part's seconds.
    python bench/kv_acceptance.py report [FILE.json]

Issue 27's quality proof asks, beside KL / top-1 / perplexity (bench/kv_quality.py), whether a
quantized KV cache of the target changes how many drafted tokens it accepts. For each cache type of
the target (K and V alike; the draft model's own cache stays f16, the DFlash drafter keeps its own)
and each drafter deltaspec runs on CPU with the testbed's files:
  - draft model chain k=4 (draft.gguf; 4 drafts every round, as bench/results/latest/acceptance.md),
  - DFlash + DDTree budget 16 (dflash.gguf; a tree every round),
  - (with --drafters ... dflash_chain) the DFlash chain: block - 1 = 15 drafts every round or none,
it generates from the testbed's held-out prompts (manifest.json: fixed at training, held-out files)
and reports the mean acceptance length (tokens committed per target pass: (accepted + passes) /
passes over all prompts), its per-prompt bootstrap 95% interval, and the difference to the f16
cache with a paired bootstrap interval (the same prompts resampled for both; bench/acceptance_stats.py).
"Within noise" = the paired interval holds 0.

T = 0 is greedy and deterministic: one run per type is the measurement; the script checks it by
running the first --check-prompts prompts again and asserting identical counts and tokens. At T = 0
it also reports how much of each type's output is the f16 cache's (same drafter): prompts identical,
the share of generated tokens before the first difference, and the share of equal positions.
T = 1 (plain sampling, no top-k/top-p/min-p, rejection-sampling verification) is random: --seeds
repetitions (seed = base + 1000 * repetition + prompt), interleaved over types; the interval is
over prompts with each prompt's counts pooled over the seeds, and the table gives the median
[min-max] of the per-repetition acceptance length too.

Asserted per type and drafter: the engine allocated the asked-for cache type at every attention
layer (Model.kv_cache_info(), read from its tensors), and drafts were made (drafted > 0).
No llama.cpp peer: llama.cpp has no tq types and no DFlash drafter; the f16 row is the reference.
Writes bench/results/latest/kv_acceptance.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from acceptance_stats import acceptance_length, bootstrap_ci, paired_difference, token_agreement  # noqa: E402

TYPES = ["f16", "q8_0", "q8_0+rot", "q5_0", "q4_0", "q4_0+rot", "tq4", "tq3"]  # f16 first: the reference
DRAFTERS = {  # key -> row name; their generate() arguments: drafter_kwargs
    "draft4": "draft model chain k=4",
    "dflash_chain": "DFlash chain, block - 1 drafts or none",
    "ddtree16": "DFlash + DDTree budget 16",
}
DEFAULT_DIR = Path("/work/testbed_files")
DEFAULT_OUT = HERE / "results" / "latest" / "kv_acceptance.json"


def open_target(path, cache_type: str, n_ctx: int, threads: int):
    """The target with `cache_type` for K and V; asserts the engine allocated it. (model, kv info)."""
    from deltaspec import Model

    # KV_ACCEPTANCE_PLANT=ignore_type: the planted bug of tests/test_kv_acceptance.py (every run
    # silently gets the f16 cache), which the allocation check below must catch
    asked = "f16" if os.environ.get("KV_ACCEPTANCE_PLANT") == "ignore_type" else cache_type
    m = Model(path, n_ctx=n_ctx, n_threads=threads, type_k=asked, type_v=asked, progress=False)
    info = m.kv_cache_info()
    got = {(a["type_k"], a["type_v"]) for a in info["attention_layers"]}
    if got != {(cache_type, cache_type)}:
        m.close()
        raise AssertionError(f"asked for the {cache_type} cache, the engine allocated {sorted(got)}")
    return m, {"type": cache_type, "kv_bytes": info["kv_bytes"], "n_ctx_rows": info["n_ctx"],
               "attention_layers": len(info["attention_layers"])}


def drafter_kwargs(key: str, draft_model, dflash_path, block: int) -> dict:
    """generate() arguments of a drafter, set up as bench/testbed/acceptance.py's rows of that name."""
    if key.startswith("draft"):
        k = int(key[len("draft"):])
        return dict(draft_model=draft_model, draft_n_max=k, draft_n_min=k)
    if key == "dflash_chain":
        return dict(draft_model=dflash_path, spec_type="dflash", draft_n_max=block - 1, draft_n_min=block - 1)
    if key.startswith("ddtree"):
        return dict(draft_model=dflash_path, spec_type="dflash", draft_n_max=block - 1, draft_n_min=1,
                    tree_budget=int(key[len("ddtree"):]))
    raise ValueError(f"unknown drafter {key!r}; known: {list(DRAFTERS)}")


def one_generation(model, prompt, n_new: int, T: float, seed: int, kw: dict) -> dict:
    r = model.generate(prompt, max_tokens=n_new, temperature=T, top_k=0, top_p=1.0, min_p=0.0, seed=seed, **kw)
    s = r.stats
    return {"steps": s.n_steps, "drafted": s.n_drafted, "accepted": s.n_accepted, "tokens": list(r.tokens)}


class TypeRun:
    """One target cache type, with its drafters: the draft model (its own f16 cache) and DFlash."""

    def __init__(self, target_path, draft_path, dflash_path, block, cache_type, n_ctx, threads, drafters):
        from deltaspec import Model

        self.model, self.kv = open_target(target_path, cache_type, n_ctx, threads)
        self.draft = Model(draft_path, n_ctx=n_ctx, n_threads=threads, progress=False) if draft_path else None
        self.kwargs = {d: drafter_kwargs(d, self.draft, dflash_path, block) for d in drafters}

    def run(self, drafter, prompt, n_new, T, seed) -> dict:
        return one_generation(self.model, prompt, n_new, T, seed, self.kwargs[drafter])

    def close(self):
        self.model.close()
        if self.draft is not None:
            self.draft.close()


def check_drafted(counts: dict) -> None:
    """Every (type, drafter) drafted something: a drafter that silently did not run would show the
    plain decoder's acceptance length 1.0 for every type, i.e. 'no difference'."""
    empty = [f"T={T} {d} {t}" for T, by_d in counts.items() for d, by_t in by_d.items()
             for t, c in by_t.items() if sum(c["drafted"]) <= 0]
    if empty:
        raise AssertionError(f"no drafts were made for {empty}")


def measure(target_path, draft_path, dflash_path, block, prompts, types, drafters, threads, n_new, T, seeds,
            n_ctx) -> tuple[dict, dict]:
    """counts[drafter][type] = per prompt (pooled over seeds) steps / drafted / accepted, per-seed
    acceptance lengths, and the tokens of the first seed; plus each type's allocation info."""
    runs = {t: TypeRun(target_path, draft_path, dflash_path, block, t, n_ctx, threads, drafters) for t in types}
    counts = {d: {t: {"steps": [0] * len(prompts), "drafted": [0] * len(prompts), "accepted": [0] * len(prompts),
                      "per_seed": [], "tokens": []} for t in types} for d in drafters}
    try:
        for rep, base in enumerate(seeds):
            # one repetition: every prompt, every type, every drafter (the types interleaved)
            per_seed = {(d, t): [0, 0] for d in drafters for t in types}
            for i, p in enumerate(prompts):
                for t in types:
                    for d in drafters:
                        g = runs[t].run(d, p, n_new, T, base + 1000 * rep + i)
                        c = counts[d][t]
                        for k in ("steps", "drafted", "accepted"):
                            c[k][i] += g[k]
                        per_seed[(d, t)][0] += g["steps"]
                        per_seed[(d, t)][1] += g["accepted"]
                        if rep == 0:
                            c["tokens"].append(g["tokens"])
                if (i + 1) % 8 == 0 or i + 1 == len(prompts):
                    print(f"  T={T:g} repetition {rep + 1}: {i + 1}/{len(prompts)} prompts", file=sys.stderr, flush=True)
            for (d, t), (s, a) in per_seed.items():
                counts[d][t]["per_seed"].append(acceptance_length([s], [a]))
            print(f"  T={T:g} repetition {rep + 1}/{len(seeds)}: " + " ".join(
                f"{d}/{t} {counts[d][t]['per_seed'][-1]:.3f}" for d in drafters for t in types[:1] + types[-1:]),
                file=sys.stderr, flush=True)
        return counts, {t: runs[t].kv for t in types}
    finally:
        for r in runs.values():
            r.close()


def check_deterministic(target_path, draft_path, dflash_path, block, prompts, types, drafters, threads, n_new,
                        seed, n_ctx, counts) -> int:
    """T = 0 again on the first prompts: the same counts and tokens (so one greedy run per type is
    the measurement). Returns the generations compared."""
    again, _ = measure(target_path, draft_path, dflash_path, block, prompts, types, drafters, threads, n_new, 0.0,
                       [seed], n_ctx)
    n = 0
    for d in drafters:
        for t in types:
            for k in ("steps", "drafted", "accepted", "tokens"):
                first = counts[d][t][k][:len(prompts)]
                if again[d][t][k] != first:
                    raise AssertionError(f"T=0 is not deterministic: {d} with the {t} cache gave {k} "
                                         f"{again[d][t][k]} then {first}")
            n += len(prompts)
    return n


def summarize(counts: dict, kv: dict, T: float, head_dim: int) -> list[dict]:
    """One row per drafter and type: acceptance length, its interval, the paired difference to f16."""
    from kv_quality import bits_per_value

    rows = []
    for d, by_type in counts.items():
        ref = by_type["f16"]
        for t, c in by_type.items():
            steps, acc, drafted = sum(c["steps"]), sum(c["accepted"]), sum(c["drafted"])
            row = {"temperature": T, "drafter": DRAFTERS[d], "drafter_key": d, "type": t,
                   "bits_per_value": bits_per_value(t, head_dim), "kv_bytes": kv[t]["kv_bytes"],
                   "steps": steps, "drafted": drafted, "accepted": acc,
                   "mean_acceptance_length": acceptance_length(c["steps"], c["accepted"]),
                   "ci95": bootstrap_ci(c["steps"], c["accepted"]),
                   "acceptance_rate": acc / drafted, "drafted_per_step": drafted / steps,
                   "per_seed_al": c["per_seed"],
                   "vs_f16": paired_difference(ref["steps"], ref["accepted"], c["steps"], c["accepted"])}
            if T == 0:
                row["tokens_vs_f16"] = token_agreement(c["tokens"], ref["tokens"])
            rows.append(row)
    return rows


def _median_spread(v: list[float]) -> str:
    return f"{statistics.median(v):.3f}" + (f" [{min(v):.3f}-{max(v):.3f}]" if len(v) > 1 else "")


def markdown(result: dict) -> str:
    out = [f"# KV cache type vs acceptance length, trained testbed ({result['target']})", ""]
    for part in result["parts"]:
        T = part["temperature"]
        head = (f"## T = {T:g}: {part['n_prompts']} held-out prompts x {part['n_new']} new tokens"
                + (", deterministic (checked: the first "
                   f"{part['deterministic_check'] // len(part['rows'])} prompts run again with every type and drafter, "
                   f"{part['deterministic_check']} generations with identical counts and tokens)" if T == 0 else
                   f", {len(part['seeds'])} seed repetitions (interleaved over types)"))
        out += [head, "",
                "AL = mean acceptance length (tokens committed per target pass, pooled over prompts); CI: "
                "per-prompt bootstrap 95%; diff: AL - AL(f16 cache), paired by prompt, with its 95% CI ('*': "
                "the CI excludes 0)." + (" T = 1: AL pooled over seeds, per-seed AL median [min-max]." if T else
                                         " Tokens vs f16: prompts identical / share of generated tokens before "
                                         "the first difference / share of equal positions (same drafter, f16 cache)."),
                ""]
        extra = "per-seed AL" if T else "tokens vs f16"
        out += [f"| drafter | type | bits/value | AL | AL 95% CI | diff to f16 | diff 95% CI | accept rate | {extra} |",
                "|---|---|---:|---:|---|---:|---|---:|---|"]
        for r in part["rows"]:
            v = r["vs_f16"]
            if T:
                ext = _median_spread(r["per_seed_al"])
            else:
                a = r["tokens_vs_f16"]
                ext = f"{a['identical_prompts']}/{a['prompts']} / {a['prefix_fraction']:.3f} / {a['position_fraction']:.3f}"
            out.append(f"| {r['drafter']} | {r['type']} | {r['bits_per_value']:.2f} | {r['mean_acceptance_length']:.3f} | "
                       f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | {v['diff']:+.3f}{'*' if v['excludes_zero'] else ''} | "
                       f"[{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}] | {r['acceptance_rate']:.3f} | {ext} |")
        out += [f"", f"({part['seconds']:.0f} s)", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="run", choices=["run", "report"])
    ap.add_argument("result", nargs="?", type=Path, default=DEFAULT_OUT, help="report: the JSON")
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="target.gguf, draft.gguf, dflash.gguf, manifest.json")
    ap.add_argument("--types", nargs="+", default=TYPES, help="target cache types, f16 first (the reference)")
    # the DFlash chain (15 drafts a round, AL ~1.6) costs as much as the other two together and is
    # DDTree's first branch: run it with --drafters draft4 dflash_chain ddtree16
    ap.add_argument("--drafters", nargs="+", default=["draft4", "ddtree16"], choices=list(DRAFTERS))
    ap.add_argument("--n-prompts", type=int, default=32, help="T = 0 prompts (the manifest has 64)")
    ap.add_argument("--n-new", type=int, default=128, help="T = 0 new tokens per prompt")
    ap.add_argument("--check-prompts", type=int, default=3, help="T = 0 prompts run twice (determinism check)")
    ap.add_argument("--t1-prompts", type=int, default=12, help="T = 1 prompts (0: no T = 1 part)")
    ap.add_argument("--t1-new", type=int, default=64, help="T = 1 new tokens per prompt")
    ap.add_argument("--seeds", type=int, default=3, help="T = 1 repetitions")
    ap.add_argument("--seed", type=int, default=1234)
    # one thread: the target is 13 MB, and on a shared machine ggml's second thread waits spinning for
    # the first (measured: 3 DDTree generations took 9.9 s with 1 thread, 78 s with 2, load ~10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.cmd == "report":
        print(markdown(json.loads(args.result.read_text())))
        return 0
    if args.types[0] != "f16":
        ap.error("--types: f16 must come first (the reference)")

    from deltaspec import Model

    manifest = json.loads((args.dir / "manifest.json").read_text())
    prompts_all, block = manifest["training"]["prompts"], manifest["training"]["block_size"]
    files = [args.dir / f for f in ("target.gguf", "draft.gguf", "dflash.gguf")]
    with Model(files[0], n_ctx=64, progress=False) as m:
        head_dim = m.hparams.head_dim
    parts = []
    t_all = time.time()
    for T, n_prompts, n_new, n_seeds in ((0.0, args.n_prompts, args.n_new, 1),
                                        (1.0, args.t1_prompts, args.t1_new, args.seeds)):
        if n_prompts <= 0:
            continue
        prompts = prompts_all[:n_prompts]
        n_ctx = len(prompts[0]) + n_new + 64
        seeds = [args.seed] * n_seeds
        t0 = time.time()
        print(f"T={T:g}: {len(prompts)} prompts x {n_new} tokens x {n_seeds} seed(s), types {args.types}, "
              f"drafters {args.drafters}", file=sys.stderr, flush=True)
        common = (files[0], files[1], files[2], block)
        counts, kv = measure(*common, prompts, args.types, args.drafters, args.threads, n_new, T, seeds, n_ctx)
        check_drafted({T: counts})
        part = {"temperature": T, "n_prompts": len(prompts), "n_new": n_new, "seeds": seeds, "kv": kv}
        if T == 0:
            part["deterministic_check"] = check_deterministic(
                *common, prompts[:args.check_prompts], args.types, args.drafters, args.threads, n_new, args.seed,
                n_ctx, counts)
        part["rows"] = summarize(counts, kv, T, head_dim)
        part["seconds"] = round(time.time() - t0, 1)
        part["per_prompt"] = {d: {t: {k: c[k] for k in ("steps", "drafted", "accepted")} for t, c in by_t.items()}
                              for d, by_t in counts.items()}
        parts.append(part)
        # written after each part, so that a long T = 1 part leaves the T = 0 result behind
        result = write_result(args, files, manifest, parts, t_all)
    print(markdown(result))
    return 0


def write_result(args, files, manifest, parts, t_all) -> dict:
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"what": "acceptance length per target KV cache type (bench/kv_acceptance.py)",
              "target": str(files[0]), "files_sha256": manifest.get("files"), "parts": parts,
              "threads": args.threads, "seconds": round(time.time() - t_all, 1),
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit or None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
