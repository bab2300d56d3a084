"""What a constraint costs per decoded token: plain decoding against a reasoning budget that never
runs out and a tool-call grammar whose call never starts (both leave every row free: the device's
argmax / top rows, TokenConstraint::allows_every_token), and against a grammar that masks every row
(a regex that allows any text), its masks applied on the device (masked-grammar: the argmax or top
candidates of the masked row cross over, Engine's `allowed`) or on the host (masked-host: every row
crosses over whole; Runner.device_masks_enabled off).

    python bench/constraint_cost.py MODEL.gguf [--device cuda] [--n-seqs 1,16] [--gen 128] [--reps 3]
                                    [--out FILE.json]

Each run decodes --gen tokens after a chat prompt that opens a <think> block (so that the budget
counts), greedy and sampled (temperature 0.8, top_k 40: top rows serve it), one sequence
(generate) or N at once (generate_batch); tok/s is generated tokens over decode seconds (a random
model may end early: the rate is per token either way). Each repetition runs every mode, sampler
and N, interleaved; rows give the median and spread of the repetitions and the rows each mode
masked (grammar_masked_rows: 0 for the free modes, asserted; every row for the masked ones, on the
device for masked-grammar and never for masked-host, asserted). The model needs <think> and
<tool_call> tokens (Qwen3.5's vocabulary: `deltaspec synth` models have it). Weights of a
synthetic GGUF are random: the speed is that of the model's shapes and quant mix.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import numpy as np
from bench_cli import batch_decode_args, write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "constraint_cost.json"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
MODES = ("plain", "budget", "tool-grammar", "masked-grammar", "masked-host")
MASKED = ("masked-grammar", "masked-host")
SAMPLERS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.8, top_k=40, top_p=1.0, min_p=0.0)}


def mode_options(mode: str) -> dict:
    from deltaspec import Grammar
    from deltaspec.tool_call_grammar import chosen_call_grammar

    if mode == "budget":
        return {"reasoning_budget": 1 << 20}  # never runs out: every row free
    if mode == "tool-grammar":
        return {"grammar": chosen_call_grammar(TOOLS)}  # free until a <tool_call> the model never writes
    if mode in MASKED:
        return {"grammar": Grammar.from_regex("(?s:.*)")}  # any text, but every row masked
    return {}


def run_once(model, prompts: list[list[int]], n_gen: int, mode: str, sampler: str, seed: int) -> dict:
    kw = dict(max_tokens=n_gen, seed=seed, **SAMPLERS[sampler], **mode_options(mode))
    engine = model._engine
    before = engine.decode_stats["masked_rows"]
    engine.device_masks_enabled = mode != "masked-host"
    try:
        if len(prompts) == 1:
            results = [model.generate(prompts[0], **kw)]
        else:
            results = model.generate_batch(prompts, **kw)
    finally:
        engine.device_masks_enabled = True
    tokens = sum(r.stats.generated_tokens for r in results)
    seconds = max(r.stats.decode_seconds for r in results)  # a batch's sequences decode together
    return {"n_seqs": len(prompts), "mode": mode, "sampler": sampler, "tokens": tokens, "decode_s": seconds,
            "tok_s": tokens / seconds, "masked_rows": sum(r.stats.grammar_masked_rows for r in results),
            "device_masked_rows": engine.decode_stats["masked_rows"] - before}


def main(argv=None) -> int:
    args, n_seqs = batch_decode_args(__doc__.splitlines()[0], DEFAULT_OUT, n_seqs="1,16", gen=128, min_gen=2,
                                     argv=argv, prompt_help="random tokens before the chat turn")
    from deltaspec import Model

    kw = dict(n_threads=args.threads) if args.threads else {}
    runs = []
    with Model(args.model, n_ctx=args.prompt + args.gen + 64, device=args.device, n_seq_max=max(n_seqs),
               progress=False, **kw) as model:
        turn = model.tokenize("<|im_start|>user\nTell me about the weather.<|im_end|>\n<|im_start|>assistant\n"
                              "<think>\n", special=True)
        rng = np.random.default_rng(0)
        prompts = {n: [rng.integers(0, model.n_vocab, size=args.prompt).tolist() + turn for _ in range(n)]
                   for n in n_seqs}
        for n in n_seqs:  # untimed: every graph shape and grammar built once
            for mode in MODES:
                run_once(model, prompts[n], 4, mode, "sampled", seed=99)
        for rep in range(args.reps):
            for n in n_seqs:
                for sampler in SAMPLERS:
                    for mode in MODES:
                        r = run_once(model, prompts[n], args.gen, mode, sampler, seed=rep)
                        if mode not in MASKED and mode != "plain" and r["masked_rows"]:
                            raise AssertionError(f"{mode} masked {r['masked_rows']} rows: its rows were not free")
                        if mode in MASKED and r["masked_rows"] < r["tokens"]:
                            raise AssertionError(f"the masked grammar masked {r['masked_rows']} of {r['tokens']} rows")
                        if (mode == "masked-grammar" and r["device_masked_rows"] < r["masked_rows"]) or \
                                (mode == "masked-host" and r["device_masked_rows"]):
                            raise AssertionError(f"{mode}: {r['device_masked_rows']} of {r['masked_rows']} masked rows "
                                                 f"were masked on the device")
                        r["rep"] = rep
                        runs.append(r)
                        print(f"rep {rep + 1} N={n:3d} {sampler:7s} {mode:15s}: {r['tok_s']:8.1f} tok/s, "
                              f"{r['masked_rows']} rows masked ({r['device_masked_rows']} on the device)", flush=True)
    rows = []
    for n in n_seqs:
        for sampler in SAMPLERS:
            base = None
            for mode in MODES:
                sel = [r for r in runs if r["n_seqs"] == n and r["mode"] == mode and r["sampler"] == sampler]
                tok = [r["tok_s"] for r in sel]
                row = {"n_seqs": n, "sampler": sampler, "mode": mode, "tok_s": float(np.median(tok)),
                       "tok_s_min": min(tok), "tok_s_max": max(tok),
                       "masked_rows_per_token": float(np.median([r["masked_rows"] / r["tokens"] for r in sel]))}
                base = base or row["tok_s"]
                row["vs_plain"] = row["tok_s"] / base
                rows.append(row)
    lines = ["| N | sampler | mode | tok/s (min-max) | vs plain | rows masked per token |",
             "|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['n_seqs']} | {r['sampler']} | {r['mode']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-"
                     f"{r['tok_s_max']:.1f}) | {r['vs_plain']:.3f}x | {r['masked_rows_per_token']:.2f} |")
    print("\n".join(lines))
    result = {"model": os.path.abspath(args.model), "device": args.device, "host": platform.node(),
              "n_prompt": args.prompt, "n_gen": args.gen, "reps": args.reps, "rows": rows, "runs": runs,
              "note": "decode with no constraint, a reasoning budget that never runs out, a tool-call grammar whose "
                      "call never starts, and a grammar masking every row (masks applied on the device, or on the "
                      "host: masked-host); synthetic weights: the speed of the shapes and quant mix"}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
