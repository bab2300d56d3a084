"""Acceptance report of the trained testbed: mean acceptance length (tokens committed per target
pass) and acceptance rate of every drafter, on the held-out prompts fixed at training time, greedy
(T = 0) and sampled (T = 1, no top-k / top-p / min-p).

    python bench/testbed/acceptance.py --dir /tmp/testbed --out OUT [--device cuda] [--n-new 256]

Measured by deltaspec (on --device) where deltaspec has the drafter: n-gram (prompt lookup), the
draft model (chain and trees), MTP 1-5 and MTP trees, the DFlash chain and DFlash + DDTree budgets.
Everything by the torch reference (bench/testbed/reference.py) too, labelled so, so that deltaspec and torch can be compared
on the same drafter (greedy: the same tokens and, where the rounds are set up alike, the same
acceptance are expected).

Only some of deltaspec's rows, e.g. on a machine without CUDA, merged into an existing report (the
other rows are kept; rows of the same drafter, T and device replaced):

    python bench/testbed/acceptance.py --dir D --out bench/results/latest --device cpu --deltaspec-rows dflash

The torch reference's rows alone on one machine (e.g. the GPU machine, with no deltaspec build),
merged into a report deltaspec measured on another:

    python bench/testbed/acceptance.py --dir D --out OUT --torch-rows            # OUT/acceptance_torch.json
    python bench/testbed/acceptance.py --dir D --out REPORT_DIR --device cpu --merge-torch OUT/acceptance_torch.json

Verification rules, which decide acceptance at T = 1: deltaspec verifies by rejection sampling;
the torch reference by exact match against the target's sample (the DFlash / DDTree reference
rule, algorithms_brief.md §5.2), which accepts less. At T = 0 both are "draft == target argmax".
Writes OUT/acceptance.json, OUT/acceptance.md and OUT/deltaspec.log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402
from heads import MTPHead  # noqa: E402

DDTREE_BUDGETS = (8, 16, 22, 32, 64)
MTP_STEPS = (1, 2, 3, 4, 5)
MTP_TREES = ((3, 8), (5, 16))  # (depth, budget): the shapes bench/mtp_bench.py times on the 27B
DRAFT_TREES = ((4, 8), (6, 16))  # (depth, budget) of the draft model's trees
FAMILIES = ("mtp", "draft", "dflash", "ngram")  # --only: row names and config keys start with these
DRAFT_CHAIN_K = 4      # the fixed draft length at which deltaspec and torch are compared


def load_torch_models(folder: Path, device):
    from dflash.model import DFlashDraftModel
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3Config
    target = Qwen3_5ForCausalLM.from_pretrained(folder / "hf/target", dtype=torch.float32).to(device).eval()
    draft = Qwen3_5ForCausalLM.from_pretrained(folder / "hf/draft", dtype=torch.float32).to(device).eval()
    fcfg = Qwen3Config.from_pretrained(folder / "hf/dflash")
    fcfg._attn_implementation = "sdpa"
    dflash = DFlashDraftModel(fcfg)
    dflash.load_state_dict({k: v.float() for k, v in load_file(folder / "hf/dflash/model.safetensors").items()})
    dflash = dflash.to(device).eval()
    mtp = MTPHead(target.config)
    sd = load_file(folder / "hf/target/model.safetensors")
    mtp.load_state_dict({k[len("mtp."):]: v.float() for k, v in sd.items() if k.startswith("mtp.")})
    mtp = mtp.to(device).eval()
    return target, draft, dflash, mtp


def row(drafter, shape, by, T, steps, drafted, accepted, seconds, **extra):
    return {"drafter": drafter, "shape": shape, "measured_by": by, "temperature": T, "steps": steps,
            "drafted": drafted, "accepted": accepted,
            "mean_acceptance_length": round((accepted + steps) / steps, 3) if steps else 0.0,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "drafted_per_step": round(drafted / steps, 2) if steps else 0.0,
            "seconds": round(seconds, 1), **extra}


def torch_rows(models, prompts, n_new, T, device, mask_id, block, eos_id, seed, only=None):
    target, draft, dflash, mtp = models
    P = prompts.shape[1]
    t0 = time.time()
    cont = reference.continuation(target, prompts, n_new, T, seed)
    n_gen = reference.generated_lengths(cont, P, eos_id)
    t_cont = time.time() - t0
    drafters = reference.Drafters(target, cont, draft=draft, dflash=dflash, mtp=mtp, mask_id=mask_id)
    specs = [(f"draft model chain k={DRAFT_CHAIN_K}", "chain", drafters.draft_model_chain(DRAFT_CHAIN_K),
              DRAFT_CHAIN_K, DRAFT_CHAIN_K),
             *[(f"draft model tree depth {d} budget {b}", "tree", drafters.draft_model_tree(b), d, d)
               for d, b in DRAFT_TREES],
             (f"DFlash chain (block {block})", "chain", drafters.dflash_chain(), block - 1, 1),
             # every round block - 1 drafts or none (deltaspec's draft_n_min = draft_n_max): its twin row
             (DFLASH_FIXED, "chain", drafters.dflash_chain(), block - 1, block - 1)]
    specs += [(f"DFlash + DDTree budget {b}", "tree", drafters.dflash_tree(b), block - 1, 1) for b in DDTREE_BUDGETS]
    # k drafts every round, or a plain step when fewer tokens are left (deltaspec's draft_n_min = k)
    specs += [(f"MTP k={k}", "chain", drafters.mtp_chain(k), k, k) for k in MTP_STEPS]
    specs += [(f"MTP tree depth {d} budget {b}", "tree", drafters.mtp_tree(b), d, d) for d, b in MTP_TREES]
    if only is not None:
        specs = [spec for spec in specs if spec[0].lower().startswith(only)]  # a tuple of prefixes
    rows = []
    for name, shape, propose, max_len, min_len in specs:
        t = time.time()
        acc = reference.simulate(cont, P, n_gen, propose, max_len, min_len)
        rows.append(row(name, shape, "torch reference", T, acc.steps, acc.drafted, acc.accepted, time.time() - t,
                        per_prompt_steps=acc.per_row_steps))
        print(f"  T={T} {name:32s} AL {rows[-1]['mean_acceptance_length']:.3f} ({rows[-1]['seconds']} s)", flush=True)
    return rows, cont, n_gen, t_cont


# deltaspec's rows: key -> (row name, shape); plain decoding only at T = 0, where it is compared
DELTASPEC_CONFIGS = {
    "plain": ("plain", "-"),
    "ngram": ("n-gram (prompt lookup)", "chain"),
    "draft_fixed": (f"draft model chain k={DRAFT_CHAIN_K}", "chain"),
    "draft_adaptive": ("draft model chain adaptive (n_max 16)", "chain"),
    # the draft model's trees: best-first, every node below the depth limit expanded by the draft
    # model; drafted only when d tokens are left (draft_n_min = d), as the torch reference's rows
    **{f"draft_tree{d}x{b}": (f"draft model tree depth {d} budget {b}", "tree") for d, b in DRAFT_TREES},
    # the target's own MTP head (target.gguf keeps it: deltaspec's converter exports the MTP layer),
    # k drafts every round, beside the torch reference's "MTP k=" rows
    **{f"mtp{k}": (f"MTP k={k}", "chain") for k in MTP_STEPS},
    # MTP trees: the top-1 chain d deep plus the chain nodes' best other candidates, b nodes in all;
    # drafted only when d tokens are left (draft_n_min = d), as the torch reference's rows
    **{f"mtp_tree{d}x{b}": (f"MTP tree depth {d} budget {b}", "tree") for d, b in MTP_TREES},
    "dflash_fixed": ("DFlash chain, block - 1 drafts or none", "chain"),
    # DDTree as the torch reference runs it: a tree every round (draft_n_min 1), as deep as the room
    # allows up to block - 1 (DFlash trees ignore the adaptive draft length), so both count the
    # same rounds and T = 0 acceptance must agree
    **{f"dflash_tree{b}": (f"DFlash + DDTree budget {b}", "tree") for b in DDTREE_BUDGETS},
}
DFLASH_FIXED = DELTASPEC_CONFIGS["dflash_fixed"][0]


def deltaspec_row(folder: Path, prompts: list[list[int]], n_new, T, device, seed, key, threads=2):
    """One deltaspec configuration over every prompt: (row or None for plain, the tokens)."""
    import deltaspec
    name, shape = DELTASPEC_CONFIGS[key]
    n_ctx = len(prompts[0]) + n_new + 64
    # two threads each: seven of these run at once beside the torch reference
    model = deltaspec.Model(folder / "target.gguf", n_ctx=n_ctx, device=device, n_threads=threads, progress=False)
    draft = (deltaspec.Model(folder / "draft.gguf", n_ctx=n_ctx, device=device, n_threads=2, progress=False)
             if "draft" in key else None)
    kw = {"plain": {}, "ngram": dict(spec_type="ngram-simple"),
          "draft_fixed": dict(draft_model=draft, draft_n_max=DRAFT_CHAIN_K, draft_n_min=DRAFT_CHAIN_K),
          "draft_adaptive": dict(draft_model=draft, draft_n_max=16),
          **{f"draft_tree{d}x{b}": dict(draft_model=draft, draft_n_max=d, draft_n_min=d, tree_budget=b)
             for d, b in DRAFT_TREES},
          **{f"mtp{k}": dict(spec_type="mtp", draft_n_max=k, draft_n_min=k) for k in MTP_STEPS},
          **{f"mtp_tree{d}x{b}": dict(spec_type="mtp", draft_n_max=d, draft_n_min=d, tree_budget=b)
             for d, b in MTP_TREES}}.get(key)
    if key.startswith("dflash"):
        block = json.loads((folder / "manifest.json").read_text())["training"]["block_size"]
        kw = dict(draft_model=folder / "dflash.gguf", spec_type="dflash", draft_n_max=block - 1, draft_n_min=block - 1)
        if key.startswith("dflash_tree"):
            kw.update(draft_n_min=1, tree_budget=int(key[len("dflash_tree"):]))
    t = time.time()
    steps = drafted = accepted = nodes = 0
    outs, per_prompt_steps = [], []
    for i, p in enumerate(prompts):
        r = model.generate(p, max_tokens=n_new, seed=seed + i, temperature=T, top_k=0, top_p=1.0, min_p=0.0, **kw)
        outs.append(r.tokens)
        per_prompt_steps.append(r.stats.n_steps)
        steps += r.stats.n_steps
        drafted += r.stats.n_drafted
        accepted += r.stats.n_accepted
        nodes += r.stats.n_tree_nodes
    model.close()
    if draft is not None:
        draft.close()
    if key == "plain":
        return None, outs
    r = row(name, shape, f"deltaspec ({device})", T, steps, drafted, accepted, time.time() - t,
            per_prompt_steps=per_prompt_steps, **({"tree_nodes": nodes} if nodes else {}))
    print(f"  T={T:g} {name:32s} AL {r['mean_acceptance_length']:.3f} ({r['seconds']} s)", flush=True)
    return r, outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Per prompt: identical token lists? and where the first difference is."""
    same, first = 0, []
    for x, y in zip(a, b):
        if x == y:
            same += 1
        else:
            first.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
    return {"identical": same, "prompts": len(a), "first_divergence": sorted(first)}


def markdown(report: dict) -> str:
    only = f", {' and '.join(report['only'])} drafters only" if report.get("only") else ""
    out = [f"# Testbed acceptance ({report['n_prompts']} held-out prompts x {report['n_new']} new tokens{only})", "",
           "Acceptance length = tokens committed per target pass (accepted drafts + the target's own token). "
           "T = 1 is plain sampling; deltaspec verifies by rejection sampling, the torch reference by exact match "
           "against the target's sample (the DFlash/DDTree rule), so at T = 1 the two are different rules.", "",
           "| drafter | shape | measured by | T | mean acceptance length | acceptance rate | drafted/step | steps |",
           "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        out.append(f"| {r['drafter']} | {r['shape']} | {r['measured_by']} | {r['temperature']:g} | "
                   f"{r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.3f} | {r['drafted_per_step']} | {r['steps']} |")
    same = report.get("same_drafter_greedy", [])
    per_prompt = any("same_steps_where_text_agrees" in r for r in same)
    if per_prompt:
        n = len(report["greedy_same_text_prompts"])
        out += ["", f"## The same drafter measured by torch and by deltaspec, T = 0, on the {n} prompts whose "
                "plain greedy texts agree", "",
                "Prompts on which each side's steps (target passes) equal the other's, per drafter; elsewhere each "
                "side's rounds follow its own text.", "",
                "| drafter | deltaspec | prompts with the same steps |", "|---|---|---|"]
        out += [f"| {r['drafter']} | {r['deltaspec']} | {r['same_steps_where_text_agrees']} |"
                for r in same if "same_steps_where_text_agrees" in r]
    if same:
        out += ["", "## The same drafter measured by torch and by deltaspec, T = 0", "",
                "Where deltaspec's rounds are set up as the torch reference's (the rows' names say how), the "
                "acceptance is the same: the same steps, drafted and accepted counts.", "",
                "| drafter | deltaspec | torch AL | deltaspec AL | same counts |", "|---|---|---|---|---|"]
        out += [f"| {r['drafter']} | {r['deltaspec']} | {r['torch_al']:.3f} | {r['deltaspec_al']:.3f} | "
                f"{'yes' if r['same_counts'] else 'no'} |" for r in same]
    ag = report["agreement_greedy"]
    out += ["", "## deltaspec vs torch, greedy", ""]
    for k, v in ag.items():
        out.append(f"- {k}: {v['identical']}/{v['prompts']} prompts token-identical"
                   + (f"; first differences at tokens {v['first_divergence'][:12]}" if v["first_divergence"] else ""))
    if report.get("samples"):  # the torch reference's greedy text: absent from a report of deltaspec rows alone
        out += ["", "## The target's greedy completions (held-out prompts)", ""]
        for s in report["samples"]:
            out += ["```python", s["prompt_tail"] + "⟨" + s["completion"] + "⟩", "```", ""]
    out += ([] if out[-1] == "" else [""]) + [f"Training: {json.dumps(report['losses'])}", ""]
    return "\n".join(out)


def start_worker(args, work: Path, T: float, key: str):
    """One deltaspec row in a process of its own (--deltaspec-only): (process, log, result file)."""
    result = work / f"T{T:g}_{key}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", str(args.dir), "--out", str(result),
           "--device", args.device, "--n-new", str(args.n_new), "--seed", str(args.seed), "--threads", str(args.threads),
           "--deltaspec-only", f"{T:g}:{key}"] + (["--n-prompts", str(args.n_prompts)] if args.n_prompts else [])
    log = open(result.with_suffix(".log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, result


def finish_worker(T, key, worker, all_logs) -> dict:
    """Waits for a worker; its {"row", "tokens"} (raises with its log's tail when it failed)."""
    proc, log, result = worker
    rc = proc.wait()
    log.close()
    text = result.with_suffix(".log").read_text()
    all_logs.write(f"== T={T:g} {key} (exit {rc})\n{text}")
    print(text, end="", flush=True)
    if rc != 0:
        raise RuntimeError(f"deltaspec {key} at T={T:g} failed (exit {rc}): {text[-2000:]}")
    return json.loads(result.read_text())


def same_rows(report: dict) -> list[dict]:
    """T = 0 rows of one drafter measured by torch and by deltaspec: their acceptance side by side."""
    torch_rows = {(r["drafter"], r["temperature"]): r for r in report["rows"] if r["measured_by"] == "torch reference"}
    out = []
    for r in report["rows"]:
        ref = torch_rows.get((r["drafter"], r["temperature"]))
        if r["measured_by"] != "torch reference" and ref is not None and r["temperature"] == 0:
            out.append({"drafter": r["drafter"], "deltaspec": r["measured_by"],
                        "torch_al": ref["mean_acceptance_length"], "deltaspec_al": r["mean_acceptance_length"],
                        "same_counts": all(r[k] == ref[k] for k in ("steps", "drafted", "accepted"))})
            # where the two plain greedy texts differ (near-ties of two implementations), each side's
            # rounds follow its own text: compare the steps on the prompts whose texts are the same
            same_text = report.get("greedy_same_text_prompts")
            if same_text is not None and "per_prompt_steps" in r and "per_prompt_steps" in ref:
                differ = [i for i in same_text if r["per_prompt_steps"][i] != ref["per_prompt_steps"][i]]
                out[-1]["same_steps_where_text_agrees"] = f"{len(same_text) - len(differ)}/{len(same_text)}"
    return out


def write_report(out: Path, report: dict) -> dict:
    """The report's same-drafter comparison brought up to date, then OUT/acceptance.json and .md."""
    report["same_drafter_greedy"] = same_rows(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    (out / "acceptance.md").write_text(md)
    print(md)
    return report


def generated(cont: torch.Tensor, prompt_len: int, n_gen: list[int]) -> list[list[int]]:
    """Each row's generated tokens (after the prompt, up to its length)."""
    return [cont[i, prompt_len:prompt_len + n].tolist() for i, n in enumerate(n_gen)]


def merge_deltaspec_rows(args, keys: list[str]) -> dict:
    """Runs deltaspec's rows `keys` (T = 0 and 1; plain at T = 0 for the token comparison) at most
    --jobs at a time, and merges them into the report in --out: rows of the same drafter, T and
    measured_by are replaced, the others kept."""
    report = json.loads((args.out / "acceptance.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="testbed_acceptance_"))
    temps = [float(t) for t in args.temps.split(",")]
    todo = ([(0.0, "plain")] if 0.0 in temps else []) + [(T, k) for T in temps for k in keys]
    results, running = {}, {}
    t0 = time.time()
    with open(work / "deltaspec.log", "w") as all_logs:
        while todo or running:
            while todo and len(running) < args.jobs:
                T, key = todo.pop(0)
                running[(T, key)] = start_worker(args, work, T, key)
            done = next(iter(running))  # the oldest: workers of one size take about as long
            results[done] = finish_worker(*done, running.pop(done), all_logs)
    device = f"deltaspec ({args.device})"
    new_rows = [results[(T, k)]["row"] for T in temps for k in keys]
    replaced = {(r["drafter"], r["temperature"], r["measured_by"]) for r in new_rows}
    report["rows"] = [r for r in report["rows"]
                      if (r["drafter"], r["temperature"], r["measured_by"]) not in replaced] + new_rows
    for k in keys if 0.0 in temps else []:
        name = DELTASPEC_CONFIGS[k][0]
        report["agreement_greedy"][f"{device} {name} vs {device} plain"] = \
            agreement(results[(0.0, k)]["tokens"], results[(0.0, "plain")]["tokens"])
    if args.n_prompts is not None and args.n_prompts != report["n_prompts"]:
        raise ValueError(f"--n-prompts {args.n_prompts}: the report in {args.out} has {report['n_prompts']} prompts")
    report.setdefault("merged_runs", []).append({"device": args.device, "keys": keys, "temps": temps, "jobs": args.jobs,
                                                 "threads": args.threads, "seconds": round(time.time() - t0, 1)})
    return write_report(args.out, report)


def torch_only(args, prompts_list: list[list[int]], training: dict) -> dict:
    """The torch reference's rows alone (--torch-rows), e.g. on a GPU machine without a deltaspec
    build: OUT/acceptance_torch.json with the rows and the greedy continuation, which --merge-torch
    merges into a report measured by deltaspec elsewhere."""
    tdev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = load_torch_models(args.dir, tdev)
    prompts = torch.tensor(prompts_list, device=tdev)
    rows, times, greedy = [], {}, None
    for T in [float(x) for x in args.temps.split(",")]:
        t = time.time()
        r, cont, n_gen, t_cont = torch_rows(models, prompts, args.n_new, T, tdev, training["mask_token_id"],
                                            training["block_size"], 0, args.seed, args.only)
        rows += r
        if T == 0.0:
            greedy = generated(cont, prompts.shape[1], n_gen)
        times[f"torch_T{T:g}_s"] = round(time.time() - t, 1)
    out = {"n_prompts": len(prompts_list), "n_new": args.n_new, "torch_device": str(tdev), "only": args.only,
           "rows": rows, "greedy_tokens": greedy, "times": times}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance_torch.json").write_text(json.dumps(out))
    return out


def merge_torch_rows(args, torch_file: Path) -> dict:
    """Merges a --torch-rows result into the report in --out: torch rows of the same drafter and T
    replaced, the others kept; deltaspec's plain greedy (run here, on --device) compared with the
    torch reference's greedy continuation token by token."""
    report = json.loads((args.out / "acceptance.json").read_text())
    got = json.loads(torch_file.read_text())
    if (got["n_prompts"], got["n_new"]) != (report["n_prompts"], report["n_new"]):
        raise ValueError(f"{torch_file}: {got['n_prompts']} prompts x {got['n_new']} tokens, the report in {args.out} "
                         f"{report['n_prompts']} x {report['n_new']}")
    replaced = {(r["drafter"], r["temperature"]) for r in got["rows"]}
    report["rows"] = [r for r in report["rows"] if r["measured_by"] != "torch reference"
                      or (r["drafter"], r["temperature"]) not in replaced] + got["rows"]
    work = Path(tempfile.mkdtemp(prefix="testbed_acceptance_"))
    with open(work / "deltaspec.log", "w") as log:
        plain = finish_worker(0.0, "plain", start_worker(args, work, 0.0, "plain"), log)
    report["agreement_greedy"][f"deltaspec ({args.device}) plain vs torch greedy"] = \
        agreement(plain["tokens"], got["greedy_tokens"])
    report["greedy_same_text_prompts"] = [i for i, (a, b) in enumerate(zip(plain["tokens"], got["greedy_tokens"]))
                                          if a == b]
    report.pop("torch_reference_al", None)  # the rows of an unfinished run, now measured in full
    report.setdefault("merged_runs", []).append({"torch_rows": str(torch_file), "torch_device": got["torch_device"],
                                                 "only": got["only"], "times": got["times"]})
    return write_report(args.out, report)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path, help="what train.py + export.py wrote")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="deltaspec's device (the torch reference uses CUDA when it exists)")
    ap.add_argument("--n-new", type=int, default=256)
    ap.add_argument("--n-prompts", type=int, default=None, help="default: every prompt fixed at training")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deltaspec-only", default=None, metavar="T:CONFIG",
                    help="(internal) run one of deltaspec's rows and write it to the file --out")
    ap.add_argument("--deltaspec-rows", default=None, metavar="KEYS",
                    help="only these deltaspec rows (comma-separated keys of DELTASPEC_CONFIGS, or 'dflash' for "
                         "every DFlash row), at T = 0 and 1, merged into the report already in --out")
    ap.add_argument("--jobs", type=int, default=1, help="--deltaspec-rows: rows run at once")
    ap.add_argument("--jobs-full", type=int, default=0, metavar="N",
                    help="the whole report: deltaspec rows run at once beside the torch reference (default: all)")
    ap.add_argument("--temps", default="0,1", help="--deltaspec-rows, --torch-rows: temperatures (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each deltaspec row")
    ap.add_argument("--only", default=None, metavar="FAMILIES",
                    help="a report of some drafter families alone (comma-separated: mtp, draft, dflash, ngram), "
                         "torch and deltaspec side by side (plain decoding kept for the token comparison), e.g. "
                         "on a CPU where the whole report is too long")
    ap.add_argument("--torch-rows", action="store_true",
                    help="the torch reference's rows alone -> OUT/acceptance_torch.json (no deltaspec needed)")
    ap.add_argument("--merge-torch", type=Path, default=None, metavar="FILE",
                    help="merge a --torch-rows result into the report in --out (deltaspec's plain greedy run here)")
    args = ap.parse_args(argv)
    if args.only is not None:
        args.only = tuple(args.only.split(","))
        unknown = [f for f in args.only if f not in FAMILIES]
        if unknown:
            ap.error(f"--only: unknown families {unknown}; known: {', '.join(FAMILIES)}")
    manifest = json.loads((args.dir / "manifest.json").read_text())
    training = manifest["training"]
    prompts_list = training["prompts"][:args.n_prompts]
    if args.torch_rows:
        return torch_only(args, prompts_list, training)
    if args.merge_torch is not None:
        return merge_torch_rows(args, args.merge_torch)
    if args.deltaspec_only is not None:
        T, key = args.deltaspec_only.split(":")
        r, toks = deltaspec_row(args.dir, prompts_list, args.n_new, float(T), args.device, args.seed, key, args.threads)
        args.out.write_text(json.dumps({"row": r, "tokens": toks}))
        return {}
    if args.deltaspec_rows is not None:
        keys = [k for k in DELTASPEC_CONFIGS if k.startswith("dflash")] if args.deltaspec_rows == "dflash" \
            else args.deltaspec_rows.split(",")
        unknown = [k for k in keys if k not in DELTASPEC_CONFIGS or k == "plain"]
        if unknown:
            raise SystemExit(f"--deltaspec-rows: unknown keys {unknown}; known: {list(DELTASPEC_CONFIGS)[1:]}")
        return merge_deltaspec_rows(args, keys)
    # deltaspec's rows run in processes of their own, one per configuration and temperature, beside
    # the torch reference: each decodes token by token (its speed is not what is measured here), so
    # together they take the time of the slowest instead of the sum. Their files stay out of OUT
    # (the GPU machine hands back few files). --jobs bounds how many run at once (a CPU machine's
    # cores and memory): a thread starts the next as one ends.
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="testbed_acceptance_"))
    todo = [(T, key) for T in (0.0, 1.0) for key in DELTASPEC_CONFIGS
            if not (key == "plain" and T != 0)
            and (args.only is None or key == "plain" or key.startswith(args.only))]
    jobs = args.jobs_full or len(todo)
    finished: dict = {}
    all_logs = open(args.out / "deltaspec.log", "w")

    def run_workers():
        queue, running = list(todo), {}
        while queue or running:
            while queue and len(running) < jobs:
                T, key = queue.pop(0)
                running[(T, key)] = start_worker(args, work, T, key)
            done = next(iter(running))
            try:
                finished[done] = finish_worker(*done, running.pop(done), all_logs)
            except RuntimeError as e:
                finished[done] = e

    runner = threading.Thread(target=run_workers, daemon=True)
    runner.start()
    tdev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = load_torch_models(args.dir, tdev)
    prompts = torch.tensor(prompts_list, device=tdev)
    mask_id, block = training["mask_token_id"], training["block_size"]
    eos_id = 0
    t_start = time.time()
    rows, conts, times = [], {}, {}
    for T in (0.0, 1.0):
        t = time.time()
        r, cont, n_gen, t_cont = torch_rows(models, prompts, args.n_new, T, tdev, mask_id, block, eos_id, args.seed,
                                            args.only)
        rows += r
        conts[T] = generated(cont, prompts.shape[1], n_gen)
        times[f"torch_T{T:g}_s"] = round(time.time() - t, 1)
        times[f"torch_continuation_T{T:g}_s"] = round(t_cont, 1)
    ds_tokens: dict[float, dict[str, list]] = {0.0: {}, 1.0: {}}
    t = time.time()
    runner.join()
    all_logs.close()
    for T, key in todo:
        got = finished[(T, key)]
        if isinstance(got, Exception):
            raise got
        if got["row"] is not None:
            rows.append(got["row"])
        ds_tokens[T][DELTASPEC_CONFIGS[key][0]] = got["tokens"]
    times["deltaspec_wait_after_torch_s"] = round(time.time() - t, 1)
    greedy = ds_tokens[0.0]
    ag = {"deltaspec plain vs torch greedy": agreement(greedy["plain"], conts[0.0]),
          **{f"deltaspec {name} vs torch greedy": agreement(toks, conts[0.0])
             for name, toks in greedy.items() if name != "plain"},
          **{f"deltaspec {name} vs deltaspec plain": agreement(toks, greedy["plain"])
             for name, toks in greedy.items() if name != "plain"}}
    import tokenizers
    tk = tokenizers.Tokenizer.from_file(str(args.dir / "hf/target/tokenizer.json"))
    samples = [{"prompt_tail": tk.decode(prompts_list[i])[-300:], "completion": tk.decode(conts[0.0][i][:96])}
               for i in range(min(3, len(prompts_list)))]
    report = {"n_prompts": len(prompts_list), "n_new": args.n_new, "prompt_tokens": len(prompts_list[0]), "only": args.only,
              "deltaspec_device": args.device, "torch_device": str(tdev), "rows": rows, "agreement_greedy": ag,
              "samples": samples, "losses": manifest["losses"], "files": manifest["files"], "times": times,
              "total_seconds": round(time.time() - t_start, 1)}
    return write_report(args.out, report)


if __name__ == "__main__":
    main()
