"""Where a batch-invariant model's rows still part from its one-token steps, if they do: the
largest |batch - steps| logit difference (tests' batch_vs_steps: `--rows` rows after `--context`
tokens) of each model under each environment variant, one process each (the variables are read
when a model is built), printed as JSON lines and written as JSON.

    python bench/invariance_probe.py A.gguf B.gguf --variants "" "DELTASPEC_CUDA_DELTANET=0" --out probe.json

`--shapes DIR` bisects by shape instead of taking models: it writes small synthetic models (4
layers: 3 DeltaNet + 1 attention, Q4_K_M) of a base preset's widths, each with one width taken
from a smaller preset (DeltaNet value heads, FFN width, embedding width, a tied head), and probes
each. A model that parts while its neighbour with one width changed does not names the width
whose kernels are not invariant; the variants then name the kernel (k-split, DeltaNet).

    python bench/invariance_probe.py --shapes /tmp/shapes --base 27b --variants "" "DELTASPEC_MMA_K_SPLIT=1"

`--products` looks at one piece instead: a weight product alone (random weights quantized to each
--types, K from --embd-widths, --rows-out output rows), its --rows columns in one product
against each column alone, and its first half of rows against those rows as a matrix of their own
(a stack's part, as a batch multiplies stacked weights that a one-token step multiplies apart),
with and without the batch-invariant registration, and prints the largest difference of each.

    python bench/invariance_probe.py --products --types q4_K q6_K --embd-widths 1024 2048 5120

`--nodes` adds to each model's probe where its rows part: every node of the batch's step graph against
the one-token steps' (deltaspec.testing.batch_rows.node_differences: nodes captured as computed,
matched by op, first source (a weight's name) and occurrence), the first that differ.

    python bench/invariance_probe.py --shapes /tmp/shapes --only 27b --embd-widths 2048 --nodes --context 0
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
from typing import Iterable, Iterator


def worker(path: str, rows: int, context: int, device: str, nodes: bool = False) -> dict:
    import numpy as np

    from deltaspec import Model, _core
    from deltaspec.testing.batch_rows import batch_vs_steps, node_differences

    cuda = device.startswith("cuda")
    routes = lambda: [_core.cuda_invariant_count(w) for w in range(4)] if cuda else []  # noqa: E731
    before = routes()
    with Model(path, device=device, n_ctx=max(1024, 2 * (rows + context)), batch_invariant=True, progress=False) as m:
        diff = batch_vs_steps(m, rows, context, np.random.default_rng(rows))
        compared = node_differences(m, rows, context, np.random.default_rng(rows)) if nodes else None
    # routes: products on our tensor cores, column by column, invariant attention calls, misses
    out = {"max_diff": diff, "routes": [a - b for a, b in zip(routes(), before)]}
    if compared is not None:  # the first nodes whose rows differ, in the batch graph's order
        out["nodes_compared"] = len(compared)
        out["first_differing_nodes"] = [n for n in compared if n["max_diff"] > 0][:8]
    return out


def shape_models(folder: str, base: str, small: str, embd_widths: Iterable[int] = (),
                 only: Iterable[str] = ()) -> Iterator[tuple[str, str]]:
    """(label, path) of the bisection models, each written into `folder` (once) when its turn comes,
    so that a run cut short has probed the first ones. `embd_widths` adds the base with each of those
    embedding widths (between the small preset's and the base's: where the parting starts); `only`
    keeps the bisection models whose labels it names (a call's time covers few models under many
    variants), the embedding widths always."""
    from deltaspec.synth import PRESETS, write_synthetic_gguf

    b, s = PRESETS[base], PRESETS[small]
    four = dict(n_layer=4)
    shapes = {
        f"{base}": dataclasses.replace(b, **four),
        f"{base} Hv={s.ssm_n_v_heads}": dataclasses.replace(b, **four, ssm_n_v_heads=s.ssm_n_v_heads),
        f"{base} n_ff={s.n_ff}": dataclasses.replace(b, **four, n_ff=s.n_ff),
        f"{base} n_embd={s.n_embd}": dataclasses.replace(b, **four, n_embd=s.n_embd),
        f"{base} heads={s.n_head}/{s.n_head_kv}": dataclasses.replace(b, **four, n_head=s.n_head, n_head_kv=s.n_head_kv),
        f"{base} tied={s.tied}": dataclasses.replace(b, **four, tied=s.tied),
        f"{small}": dataclasses.replace(s, **four),
    }
    wanted = set(only)
    unknown = wanted - set(shapes)
    if unknown:
        raise ValueError(f"--only: no shape model named {sorted(unknown)}; there are {sorted(shapes)}")
    kept = {label: preset for label, preset in shapes.items() if not wanted or label in wanted}
    for width in embd_widths:
        kept[f"{base} n_embd={width}"] = dataclasses.replace(b, **four, n_embd=width)
    os.makedirs(folder, exist_ok=True)
    for label, preset in kept.items():
        if label != base and preset == shapes[base]:
            continue  # the small preset has the base's value there: nothing to bisect
        path = os.path.join(folder, label.replace(" ", "_").replace("/", "-").replace("=", "") + ".gguf")
        if not os.path.exists(path):
            write_synthetic_gguf(path, dataclasses.replace(preset, name=label), "q4_k_m", seed=0)
        yield label, path


def probe_products(types: list[str], widths: list[int], rows: int, n_cols: int, device: str,
                   out_path: str | None) -> list[dict]:
    """Each type and K: max |one product of n_cols columns - each column alone| ("default",
    "invariant") and max |the matrix's first rows / 2 rows in the product - those rows as a
    matrix of their own| ("head_default", "head_invariant": a batch's stacked weights against a
    one-token step's separate products), without and with the batch-invariant registration."""
    import numpy as np

    from deltaspec import _core

    results = []
    rng = np.random.default_rng(0)
    for type_name, k in itertools.product(types, widths):
        w = rng.standard_normal((rows, k), dtype=np.float32)
        x = rng.standard_normal((n_cols, k), dtype=np.float32)
        row = {"type": type_name, "K": k, "rows": rows, "columns": n_cols}
        head = rows // 2
        for invariant in (False, True):
            got = _core.matmul_columns(device, w, type_name, x, batch_invariant=invariant, head_rows=head)
            name = "invariant" if invariant else "default"
            row[name] = float(np.abs(got["batch"] - got["alone"]).max())
            row["head_" + name] = float(np.abs(got["batch"][:, :head] - got["head"]).max())
        keep(results, row, out_path)
    return results


def keep(results: list[dict], row: dict, out_path: str | None) -> None:
    """One more result: printed as a JSON line, and the JSON file rewritten (a run cut short keeps it)."""
    results.append(row)
    print(json.dumps(row), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)


def probe(models: Iterable[tuple[str, str]], variants: list[str], rows: int, contexts: list[int], device: str,
          out_path: str | None, nodes: bool = False) -> list[dict]:
    """Each model under each variant at each context; the JSON file is rewritten after every row."""
    results = []
    for label, path in models:
        for variant, context in itertools.product(variants, contexts):
            env = {**os.environ, **dict(kv.split("=", 1) for kv in variant.split())}
            out = subprocess.run([sys.executable, __file__, "--worker", path, "--rows", str(rows),
                                  "--context", str(context), "--device", device] + (["--nodes"] if nodes else []),
                                 env=env, capture_output=True, text=True)
            row = {"model": label, "variant": variant or "(none)", "rows": rows, "context": context}
            row.update(json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0
                       else {"error": out.stderr.strip().splitlines()[-1:]})
            keep(results, row, out_path)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--shapes", metavar="DIR", help="bisect by shape: write the models into DIR (kept between runs)")
    ap.add_argument("--base", default="27b", help="--shapes: the preset whose widths part (default 27b)")
    ap.add_argument("--small", default="0.8b", help="--shapes: the preset whose widths do not (default 0.8b)")
    ap.add_argument("--embd-widths", type=int, nargs="*", default=[],
                    help="--shapes: also the base with each of these embedding widths")
    ap.add_argument("--only", nargs="*", default=[], help="--shapes: only the models of these labels")
    ap.add_argument("--products", action="store_true", help="probe weight products alone (see above)")
    ap.add_argument("--nodes", action="store_true",
                    help="also compare the batch's graph nodes with the steps' (see above): the first that differ")
    ap.add_argument("--types", nargs="+", default=["q4_K", "q6_K"], help="--products: weight types")
    ap.add_argument("--rows-out", type=int, default=5120, help="--products: output rows (default 5120)")
    ap.add_argument("--variants", nargs="+", default=[""], help="space-separated VAR=VALUE lists ('' = none)")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--context", type=int, nargs="+", default=[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.context[0], args.device, args.nodes)))
        return
    if args.products:
        probe_products(args.types, args.embd_widths or [1024, 2048, 5120], args.rows_out, args.rows, args.device,
                       args.out)
        return
    if bool(args.models) == bool(args.shapes):
        ap.error("give models, --shapes DIR or --products (one of them)")
    models = shape_models(args.shapes, args.base, args.small, args.embd_widths, args.only) if args.shapes else [(os.path.basename(p), p) for p in args.models]
    probe(models, args.variants, args.rows, args.context, args.device, args.out, args.nodes)


if __name__ == "__main__":
    main()
