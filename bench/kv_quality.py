"""KV cache quality: each cache type against the f16 cache, on the trained testbed and a tiny model.

    python bench/kv_quality.py [--model /work/testbed_files/target.gguf] [--windows 3] [--threads 2]
    python bench/kv_quality.py report [FILE.json]
    python bench/kv_quality.py --types f16 q4_0 tq4/tq3 --out ...  # K/V: different types for K and V

Two measurements, both written to bench/results/latest/kv_quality.json with their table (.md):

1. End to end (the model's next-token distributions). Held-out text: Python files of the packages
   the testbed's corpus split holds out (bench/testbed/corpus.py; the split is a hash of the package
   name, so it is the same on any machine), tokenized by the testbed's own tokenizer and cut into
   windows of n_ctx_train tokens. Each window runs once per cache type (one prompt, logits at every
   position); since the model is causal, position p's distribution is the one at context length p,
   so one pass gives every context length. Per type and context bin (positions [lo, hi)):
     KL(f16 || type) of the next-token distributions (nats, mean over the bin's positions),
     top-1 agreement with the f16 cache, and the held-out perplexity of the whole window.
   Windows are the repetitions (median [min-max] over them); the types run interleaved per window.
   A tiny random-weight model (deltaspec.testing.tiny_vocab, random tokens) gives the same metrics.
2. The cache alone: real K and V rows of the testbed (the f16 cache after a held-out window, its
   attention layers), each quantized by every type, as relative MSE |x - x_hat|^2 / |x|^2, for the
   ggml types with and without the rotation of the tq types (the Hadamard-with-signs transform of
   each head vector; llama.cpp rotates its quantized caches with the plain Hadamard transform, spec
   §7.2). ggml types are quantized by gguf-py (ggml's reference rounding), tq types by deltaspec's codec.

No llama.cpp peer runs here: its KV quality tool (llama-perplexity --kl-divergence) needs a
llama.cpp build, and llama.cpp has no tq types; its q4_0 rotation is the row "q4_0 + rotation" of
measurement 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "testbed"))

TYPES = ["f16", "q8_0", "q8_0+rot", "q5_0", "q5_0+rot", "q4_0", "q4_0+rot", "tq4", "tq3"]  # f16 first: the reference
ROTATABLE = ["q8_0", "q5_0", "q4_0"]
DEFAULT_MODEL = "/work/testbed_files/target.gguf"
DEFAULT_OUT = HERE / "results" / "latest" / "kv_quality.json"


def heldout_windows(model, n_windows: int, length: int) -> list[list[int]]:
    """n_windows windows of `length` + 1 tokens of held-out text, spread over the held-out files."""
    from corpus import collect, split

    _, heldout = split(collect(40_000_000))
    if not heldout:
        raise RuntimeError("no held-out package of the testbed's split is installed here")
    tokens: list[int] = []
    for f in heldout:
        tokens += model.tokenize(f.text) + [0]  # 0: the testbed's end-of-file token
        if len(tokens) >= 4 * n_windows * (length + 1):
            break
    stride = (len(tokens) - length - 1) // max(1, n_windows)
    if stride <= 0:
        raise RuntimeError(f"only {len(tokens)} held-out tokens here, {length + 1} needed per window")
    return [tokens[i * stride: i * stride + length + 1] for i in range(n_windows)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def bins_for(length: int) -> list[tuple[int, int]]:
    """Context bins: the last 256 positions before each power of two from 512 up to length."""
    out, n = [], 512
    while n <= length:
        out.append((n - 256, n))
        n *= 2
    return out or [(0, length)]


def compare(ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray, bins) -> dict:
    lp_ref, lp = log_softmax(ref_logits), log_softmax(logits)
    kl = (np.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1)
    top1 = ref_logits.argmax(-1) == logits.argmax(-1)
    nll = -lp[np.arange(len(targets)), targets]
    return {"ppl": float(np.exp(nll.mean())),
            "bins": {f"{lo}-{hi}": {"kl": float(kl[lo:hi].mean()), "top1": float(top1[lo:hi].mean())}
                     for lo, hi in bins}}


def pair(name: str) -> tuple[str, str]:
    """A --types entry: "q4_0" (K and V alike) or "tq4/tq3" (K, then V)."""
    type_k, _, type_v = name.partition("/")
    return type_k, type_v or type_k


def end_to_end(model_path: str, windows: list[list[int]], threads: int, types: list[str]) -> list[dict]:
    """Per window, per type (interleaved): logits of the window, compared with the f16 cache's."""
    from deltaspec import Model

    length = len(windows[0]) - 1
    bins = bins_for(length)
    runs = []
    for w, window in enumerate(windows):
        ids, targets = window[:-1], np.array(window[1:])
        ref = None
        for t in types:
            t0 = time.perf_counter()
            type_k, type_v = pair(t)
            with Model(model_path, n_ctx=length, n_threads=threads, type_k=type_k, type_v=type_v, progress=False) as m:
                got = {(a["type_k"], a["type_v"]) for a in m.kv_cache_info()["attention_layers"]}
                assert got == {(type_k, type_v)}, f"asked for {t}, the engine allocated {got}"
                logits = m.logits(ids)
            if ref is None:
                ref = logits
            row = {"window": w, "type": t, **compare(ref, logits, targets, bins),
                   "seconds": round(time.perf_counter() - t0, 1)}
            runs.append(row)
            print(f"  window {w} {t:<5} ppl {row['ppl']:.3f} " + " ".join(
                f"{b}: kl {v['kl']:.2e} top1 {v['top1']:.3f}" for b, v in row["bins"].items()), file=sys.stderr,
                flush=True)
    return runs


def cache_rows(model_path: str, window: list[int], threads: int) -> dict[str, np.ndarray]:
    """The f16 cache's K and V rows after `window`, every attention layer: {"k": (n, D), "v": (n, D)}."""
    from deltaspec import Model

    with Model(model_path, n_ctx=len(window), n_threads=threads, progress=False) as m:
        m.eval(window, logits="none")
        state = m._engine.state_arrays()
        D = m.hparams.head_dim
    out = {}
    for kind in ("k", "v"):
        rows = [np.frombuffer(a.tobytes(), np.float16).reshape(-1, D)[: len(window) * m.hparams.n_head_kv]
                for name, a in state.items() if name.startswith(kind + ".")]
        out[kind] = np.concatenate(rows).astype(np.float32)
    return out


def relative_mse(x: np.ndarray, name: str, rotate: bool) -> float:
    from gguf import quants

    from deltaspec import _core
    from deltaspec.kv_cache import CACHE_TYPES, TQ_CACHE_TYPES

    if name in TQ_CACHE_TYPES:
        bits = TQ_CACHE_TYPES[name]
        back = _core.tq_rotate(_core.tq_dequantize_rotated(bits, _core.tq_quantize(bits, x), x.shape[1]),
                               inverse=True)
    else:
        y = _core.tq_rotate(x) if rotate else x
        t = CACHE_TYPES[name]
        back = quants.dequantize(quants.quantize(y, t), t).reshape(y.shape)
        back = _core.tq_rotate(back, inverse=True) if rotate else back
    return float(((x - back) ** 2).sum() / (x ** 2).sum())


def cache_alone(model_path: str, windows: list[list[int]], threads: int) -> list[dict]:
    out = []
    for w, window in enumerate(windows):
        rows = cache_rows(model_path, window[:-1], threads)
        for kind, x in rows.items():
            for t in (t for t in TYPES[1:] if not t.endswith("+rot")):
                out.append({"window": w, "kind": kind, "type": t, "rotated": t.startswith("tq"),
                            "rel_mse": relative_mse(x, t, False)})
            for t in ROTATABLE:
                out.append({"window": w, "kind": kind, "type": t, "rotated": True, "rel_mse": relative_mse(x, t, True)})
    return out


def _spread(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def bits_per_value(name: str, head_dim: int) -> float:
    """Bits per cached value of a type, or the mean of K's and V's for a "K/V" pair."""
    from deltaspec.kv_cache import bytes_per_element

    one = lambda t: 8 * bytes_per_element(t, head_dim) if t.startswith("tq") else 8 * bytes_per_element(t)
    return sum(one(t) for t in pair(name)) / 2


def table(result: dict) -> str:
    lines = []
    for model in result["models"]:
        runs, D = model["runs"], model["head_dim"]
        bins = list(runs[0]["bins"])
        lines += [f"### {model['name']}: {model['what']}", "",
                  f"{model['windows']} windows of {model['length']} tokens; median [min-max] over windows; "
                  "KL(f16 || type) in nats and top-1 agreement with the f16 cache at context positions lo-hi.", "",
                  "| type | bits/value | ppl | " + " | ".join(f"KL {b}" for b in bins) + " | "
                  + " | ".join(f"top-1 {b}" for b in bins) + " |",
                  "|---|---:|---:|" + "---:|" * (2 * len(bins))]
        for t in model["types"]:
            rs = [r for r in runs if r["type"] == t]
            lines.append(f"| {t} | {bits_per_value(t, D):.3f} | {_spread([r['ppl'] for r in rs], '.3f')} | "
                         + " | ".join(_spread([r["bins"][b]["kl"] for r in rs], ".2e") for b in bins) + " | "
                         + " | ".join(_spread([r["bins"][b]["top1"] for r in rs], ".3f") for b in bins) + " |")
        lines.append("")
        if model.get("cache_alone"):
            rows = model["cache_alone"]
            lines += [f"Cache alone, {model['name']}: relative MSE of real K and V rows (median [min-max] over "
                      "windows); 'rotated' = the ggml type applied after the tq types' rotation.", "",
                      "| type | rotated | bits/value | K rel. MSE | V rel. MSE |", "|---|---|---:|---:|---:|"]
            seen = []
            for r in rows:
                key = (r["type"], r["rotated"])
                if key in seen:
                    continue
                seen.append(key)
                by_kind = {k: [x["rel_mse"] for x in rows if (x["type"], x["rotated"], x["kind"]) == (*key, k)]
                           for k in ("k", "v")}
                lines.append(f"| {key[0]} | {'yes' if key[1] else 'no'} | {bits_per_value(key[0], D):.3f} | "
                             f"{_spread(by_kind['k'], '.2e')} | {_spread(by_kind['v'], '.2e')} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", default="run", choices=["run", "report"])
    ap.add_argument("result", nargs="?", type=Path, default=DEFAULT_OUT, help="report: the JSON")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the testbed target (default: %(default)s)")
    ap.add_argument("--windows", type=int, default=3, help="held-out windows (the repetitions)")
    ap.add_argument("--length", type=int, default=0, help="window tokens (default: the model's n_ctx_train)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=TYPES,
                    help="f16 first (the reference); K/V for a pair of different types, e.g. tq4/tq3")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.cmd == "report":
        print(table(json.loads(args.result.read_text())))
        return 0
    if args.types[0] != "f16":
        ap.error("--types: f16 must come first (the reference)")

    from deltaspec import Model
    from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

    models = []
    with Model(args.model, n_ctx=256, n_threads=args.threads, progress=False) as m:
        length = args.length or min(m.hparams.n_ctx_train, 4096)
        windows = heldout_windows(m, args.windows, length)
        D = m.hparams.head_dim
    print(f"testbed: {len(windows)} held-out windows of {length} tokens", file=sys.stderr)
    models.append({"name": "testbed", "what": f"trained target {args.model}, held-out Python source",
                   "path": args.model, "head_dim": D, "length": length, "windows": len(windows), "types": args.types,
                   "runs": end_to_end(args.model, windows, args.threads, args.types),
                   "cache_alone": cache_alone(args.model, windows, args.threads)})
    tiny = tiny_vocab_model_path(n_layer=8, n_head=4, n_head_kv=1)
    rng = np.random.default_rng(0)
    tiny_windows = [rng.integers(0, 256, 1025).tolist() for _ in range(args.windows)]
    models.append({"name": "tiny", "what": "random-weight tiny model (tiny_vocab, head dim 64), random tokens",
                   "path": "tiny_vocab n_layer=8 n_head=4 n_head_kv=1", "head_dim": 64, "length": 1024,
                   "windows": len(tiny_windows), "types": args.types,
                   "runs": end_to_end(tiny, tiny_windows, args.threads, args.types)})
    commit = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"what": "KV cache quality against the f16 cache (bench/kv_quality.py)", "models": models,
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit or None,
              "threads": args.threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
