"""Aggregate decode throughput with speculation across several sequences (prompt lookup, DFlash, the
MTP head), beside plain batched decoding, at 1/4/16 sequences.

    python bench/batch_spec_bench.py MODEL.gguf [--device cuda] [--n-seqs 1,4,16] [--prompt 128] [--gen 128]
                                     [--draft-n-max 8] [--draft-n-min 0] [--reps 3] [--batched-bench BIN]
                                     [--out FILE.json] [--temperature 0] [--whole-rows]
                                     [--modes plain,ngram,ref,ref/4] [--dflash DRAFTER.gguf]
                                     [--tree-budget 16] [--prompts-json MANIFEST.json]

Each count N runs N greedy requests (distinct random prompts of --prompt tokens, exactly --gen tokens
each: no end-of-generation ids) through add_request / step, in these modes:
  plain     no drafter: one decode row per sequence per step (bench/batch_bench.py's measure);
  ngram     prompt lookup in the sequence's own text (spec_type "ngram-simple"): on random weights
            it finds little to draft, so this row shows what speculation costs when it does not pay;
  ref       prompt lookup that also searches a reference text holding the plain run's output for the
            same prompt: drafts are the target's own greedy continuation, so nearly all are accepted
            (a GPU batch may part from the plain run at near-ties; the table states the acceptance);
  ref/4     the same reference with every 4th token replaced: drafts break off at the replaced
            tokens (and lookups miss near them), a lower acceptance, stated in the table;
  dflash    (with --dflash) the DFlash drafter's chains, one block pass per sequence and round;
  ddtree    the same drafter's DDTree trees of --tree-budget nodes;
  mtp       the model's own MTP head (a head per sequence), chains; mtp-tree: its trees of
            --tree-budget nodes.
--temperature T > 0 samples every request at T (generate()'s other defaults: top_k 40, top_p 0.95,
min_p 0.05; seed = the request's index) instead of greedy; --whole-rows adds, for each mode, a run
"MODE/whole" with the engine's top rows off (Model._engine.top_rows_enabled = False: every row's
whole logits cross to the host and are sampled there) beside the default (each decode and verify
row reduced to its 64 best candidates on the device, top_rows.h), interleaved. --draft-n-min 1 makes
every round draft and verify, also after rejections (no back-off pauses): with a drafter that always
proposes (dflash, mtp), every step is a verify pass.
--prompts-json takes the prompts (token ids, cut to --prompt) from a JSON file's "prompts" (or
"training" -> "prompts", as the testbed's manifest.json holds its held-out prompts) instead of
random ids: a trained model (the testbed) then drafts what it would on real text.
Every step after the first (which admits and prefills all N) is timed; the rate is the tokens those
steps committed over their time, summed over the sequences (aggregate tok/s, as batch_bench.py).
The speculative modes verify every running sequence's rows in ONE target pass per step
(Engine::verify_rows) and commit each sequence's accepted prefix (Engine::keep_paths).

Repetitions interleave (every mode and count, then llama-batched-bench's plain S_TG on the same file
when --batched-bench is given: llama.cpp has no batched prompt-lookup bench to set beside ours), --reps
times; each cell reports the median and the spread (min, max). Synthetic GGUFs have random weights: the
speed is that of the shapes and quant mix, the acceptance is the stated one (say so with every number).
Writes bench/results/latest/batch_spec_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_bench import measure_peer  # noqa: E402  (llama-batched-bench's plain rows)
from bench_cli import write_result  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "batch_spec_bench.json"
MODES = ("plain", "ngram", "ref", "ref/4")
ALL_MODES = MODES + ("dflash", "ddtree", "mtp", "mtp-tree")


def load_prompts(path: str, n: int, n_prompt: int) -> list[list[int]]:
    """n prompts of n_prompt token ids from a JSON file's "prompts" (or "training" -> "prompts"),
    repeated in turn when it holds fewer."""
    data = json.loads(Path(path).read_text())
    prompts = data.get("prompts") or data.get("training", {}).get("prompts")
    if not prompts:
        raise SystemExit(f"{path}: no 'prompts' (or 'training' -> 'prompts') list of token id lists")
    return [list(prompts[k % len(prompts)][:n_prompt]) for k in range(n)]


class Ours:
    def __init__(self, model_path: str, device: str, n_seqs: list[int], n_prompt: int, n_gen: int, n_draft: int,
                 threads: int | None = None, modes=MODES, dflash: str | None = None, tree_budget: int = 16,
                 prompts: list[list[int]] | None = None, n_min: int = 0, temperature: float = 0.0):
        from deltaspec import Drafter, Model
        from deltaspec.sampling import SamplingOptions

        kw = dict(n_threads=threads) if threads else {}
        self.model = Model(model_path, n_ctx=n_prompt + n_gen + 1, device=device, n_seq_max=max(n_seqs),
                           progress=False, **kw)
        # every request's sampler: greedy, or sampled at `temperature` with a seed of its own
        self.sampling = [SamplingOptions(temperature=temperature, seed=k).native() for k in range(max(n_seqs))]
        self.n_seqs, self.n_prompt, self.n_gen, self.n_draft, self.n_min = n_seqs, n_prompt, n_gen, n_draft, n_min
        self.modes, self.tree_budget = tuple(modes), tree_budget
        self.drafter = Drafter(dflash, target=self.model) if dflash else None
        rng = np.random.default_rng(0)
        self.prompts = prompts or [rng.integers(0, self.model.n_vocab, size=n_prompt).tolist()
                                   for _ in range(max(n_seqs))]
        self.plain_out: dict[int, list[list[int]]] = {}  # N -> the plain run's greedy tokens per prompt
        self.run(warm=True)

    def _speculation(self, mode: str, n: int, k: int):
        if mode == "plain":
            return None
        if mode == "ngram":
            return (self.n_draft, self.n_min, 3)
        if mode in ("dflash", "ddtree", "mtp", "mtp-tree"):
            tree = self.tree_budget if mode in ("ddtree", "mtp-tree") else 0
            n_max = min(self.n_draft, self.drafter.block_size - 1) if self.drafter and "mtp" not in mode else self.n_draft
            return (n_max, min(self.n_min, n_max), 3, [], tree, False, mode in ("dflash", "ddtree"), mode.startswith("mtp"))
        ref = list(self.prompts[k]) + list(self.plain_out[n][k])
        if mode == "ref/4":
            ref = [(t + 1) % self.model.n_vocab if i % 4 == 3 else t for i, t in enumerate(ref)]
        return (self.n_draft, self.n_min, 3, ref)

    def _one(self, n: int, run: str, gen: int) -> dict:
        mode, whole = run.removesuffix("/whole"), run.endswith("/whole")
        engine = self.model._engine
        before = dict(engine.rows_stats)
        top_before = engine.decode_stats["top_rows"]
        dflash = self.drafter._core if mode in ("dflash", "ddtree") else None
        engine.top_rows_enabled = not whole
        ids = [engine.add_request(self.prompts[k], gen, self.sampling[k], [], [], speculation=self._speculation(mode, n, k),
                                  dflash=dflash)
               for k in range(n)]
        tokens = {i: [] for i in ids}
        results = {}

        def step() -> int:
            got = 0
            for ev in engine.step():
                tokens[ev["id"]].extend(ev["tokens"])
                got += len(ev["tokens"])
                if ev["finished"]:
                    results[ev["id"]] = ev["result"]
            return got

        step()  # admits and prefills every request (and takes their first step)
        t1 = time.perf_counter()
        n_tokens = 0
        while engine.n_requests:
            n_tokens += step()
        t2 = time.perf_counter()
        engine.top_rows_enabled = True
        assert all(len(tokens[i]) == gen for i in ids), "a request did not make exactly --gen tokens"
        outs = [tokens[i] for i in ids]
        if run == "plain":  # the same count's plain run is the reference (a GPU batch may part at near-ties)
            self.plain_out[n] = outs
        drafted = sum(results[i].get("n_drafted", 0) for i in ids)
        accepted = sum(results[i].get("n_accepted", 0) for i in ids)
        rounds = sum(len(results[i].get("accepted_lengths", [])) for i in ids)
        after = engine.rows_stats
        same = sum(out == ref for out, ref in zip(outs, self.plain_out[n]))
        return {"n_seqs": n, "mode": run, "decode_s": t2 - t1, "decode_tokens": n_tokens,
                "tok_s": n_tokens / (t2 - t1), "n_drafted": drafted, "n_accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_accepted_per_round": accepted / rounds if rounds else 0.0,
                "verify_passes": after["calls"] - before["calls"],
                "multi_slot_passes": after["multi_slot_calls"] - before["multi_slot_calls"],
                "padded_rows": after["padded_rows"] - before["padded_rows"],
                "rows": after["rows"] - before["rows"], "same_as_plain": same,
                "top_rows": engine.decode_stats["top_rows"] - top_before}

    def run(self, warm: bool = False) -> list[dict]:
        out = []
        for n in self.n_seqs:
            for mode in self.modes:
                r = self._one(n, mode, 8 if warm else self.n_gen)
                if warm:
                    continue
                out.append(r)
                print(f"N={n:3d} {mode:6s}: {r['tok_s']:9.1f} tok/s aggregate, acceptance {r['acceptance_rate']:.2f} "
                      f"({r['n_accepted']}/{r['n_drafted']}), {r['verify_passes']} verify passes "
                      f"({r['multi_slot_passes']} of 2+ slots), {r['same_as_plain']}/{n} same as plain, "
                      f"{r['top_rows']} top rows", flush=True)
        return out

    def close(self) -> None:
        self.model.close()


def summarize(reps: list[list[dict]]) -> list[dict]:
    out = []
    for i, first in enumerate(reps[0]):
        vals = [rep[i]["tok_s"] for rep in reps]
        med = float(np.median(vals))
        cell = {k: first[k] for k in ("n_seqs", "mode")}
        cell.update(tok_s=med, tok_s_min=min(vals), tok_s_max=max(vals), reps=vals,
                    acceptance_rate=float(np.median([rep[i]["acceptance_rate"] for rep in reps])),
                    mean_accepted_per_round=float(np.median([rep[i]["mean_accepted_per_round"] for rep in reps])),
                    same_as_plain=min(rep[i]["same_as_plain"] for rep in reps), top_rows=first["top_rows"])
        out.append(cell)
    return out


def table(ours: list[dict], peer: list[dict] | None) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in ours))
    best = [m for m in modes if m != "plain"]
    head = "| sequences | " + " | ".join(f"{m} tok/s (min-max) [acc]" for m in modes) + \
           " | best / plain | llama.cpp plain tok/s |"
    rows = [head, "|" + "---:|" * (len(modes) + 3)]
    peer_by_n = {r["n_seqs"]: r for r in (peer or [])}
    for n in dict.fromkeys(r["n_seqs"] for r in ours):
        cells = {r["mode"]: r for r in ours if r["n_seqs"] == n}
        text = []
        for m in modes:
            c = cells[m]
            acc = "" if m == "plain" else f" [{c['acceptance_rate']:.2f}, {c['mean_accepted_per_round']:.1f}/round]"
            text.append(f"{c['tok_s']:.1f} ({c['tok_s_min']:.1f}-{c['tok_s_max']:.1f}){acc}")
        p = peer_by_n.get(n)
        ratio = max((cells[m]["tok_s"] for m in best), default=0.0) / cells["plain"]["tok_s"] if "plain" in cells else 0
        rows.append(f"| {n} | " + " | ".join(text) + f" | {ratio:.2f}x | " +
                    (f"{np.median(p['reps']):.1f}" if p else "-") + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--n-seqs", default="1,4,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--draft-n-max", type=int, default=8)
    ap.add_argument("--draft-n-min", type=int, default=0,
                    help="1: every round drafts and verifies, also after rejections (no back-off pauses)")
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (a seed each)")
    ap.add_argument("--whole-rows", action="store_true", help="also run each mode with the engine's top rows off")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batched-bench", help="llama-batched-bench binary (plain batched decode of the same file)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(ALL_MODES)} (plain first)")
    ap.add_argument("--dflash", default=None, metavar="DRAFTER.gguf", help="the DFlash drafter of modes dflash, ddtree")
    ap.add_argument("--tree-budget", type=int, default=16, help="nodes of the ddtree and mtp-tree modes' trees")
    ap.add_argument("--prompts-json", default=None, metavar="FILE", help="prompts (token ids) instead of random ids")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != "plain" or any(m not in ALL_MODES for m in modes):
        ap.error(f"--modes: a comma list of {', '.join(ALL_MODES)}, plain first (the reference of ref, ref/4)")
    if any(m in ("dflash", "ddtree") for m in modes) and not args.dflash:
        ap.error("--modes dflash / ddtree need --dflash DRAFTER.gguf")
    n_seqs = [int(x) for x in args.n_seqs.split(",")]
    if (args.gen < 8 or args.prompt < 1 or not n_seqs or min(n_seqs) < 1 or args.reps < 1 or args.draft_n_max < 1
            or not 0 <= args.draft_n_min <= args.draft_n_max or args.temperature < 0):
        ap.error("need --gen >= 8, --prompt >= 1, --reps >= 1, 0 <= --draft-n-min <= --draft-n-max, 1 <= "
                 "--draft-n-max, --temperature >= 0 and sequence counts >= 1")
    if args.whole_rows:
        modes = [run for m in modes for run in (m, m + "/whole")]
    ours_reps, peer_reps = [], []
    prompts = load_prompts(args.prompts_json, max(n_seqs), args.prompt) if args.prompts_json else None
    runner = Ours(args.model, args.device, n_seqs, args.prompt, args.gen, args.draft_n_max, args.threads, modes,
                  args.dflash, args.tree_budget, prompts, args.draft_n_min, args.temperature)
    try:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            ours_reps.append(runner.run())
            if args.batched_bench:
                peer_reps.append(measure_peer(args.batched_bench, args.model, n_seqs, args.prompt, args.gen, args.device))
    finally:
        runner.close()
    ours = summarize(ours_reps)
    peer = None
    if peer_reps:
        peer = [{"n_seqs": r["n_seqs"], "reps": [rep[i]["tok_s"] for rep in peer_reps]} for i, r in enumerate(peer_reps[0])]
    print(table(ours, peer))
    result = {"model": os.path.abspath(args.model), "device": args.device, "host": platform.node(),
              "n_prompt": args.prompt, "n_gen": args.gen, "draft_n_max": args.draft_n_max,
              "draft_n_min": args.draft_n_min, "temperature": args.temperature, "reps": args.reps,
              "modes": modes, "dflash": args.dflash and os.path.abspath(args.dflash), "tree_budget": args.tree_budget,
              "prompts": args.prompts_json and os.path.abspath(args.prompts_json),
              "deltaspec": ours, "deltaspec_runs": ours_reps, "llama_cpp_plain": peer,
              "note": "aggregate decode tok/s after the prefill step; ngram: prompt lookup in the own text; ref: "
                      "lookup also in a reference holding the plain run's output (stated ~full acceptance); ref/4: "
                      "the reference with every 4th token wrong; MODE/whole: top rows off; synthetic weights: the "
                      "speed of the shapes"}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
