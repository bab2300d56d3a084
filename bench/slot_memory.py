"""Memory per sequence slot (KV cache + recurrent state) of the Qwen3.5 sizes at 4K/32K/128K.

    python bench/slot_memory.py [--presets 0.8b,2b,4b,9b,27b] [--out FILE.json]

Computed from each preset's shapes (python/deltaspec/synth.py, the real models' hyper-parameters)
with the formula the engine allocates by (tests/test_slot_memory.py checks it against a Model's
allocated state); no file or GPU is needed. A server running N sequences at once needs the
weights plus N slots.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deltaspec.slot_memory import REPORT_CONTEXTS, REPORT_TYPES, slot_table
from deltaspec.synth import PRESETS
from bench_cli import write_result

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "slot_memory.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    gib = 2.0**30
    result = {"contexts": list(REPORT_CONTEXTS), "types": list(REPORT_TYPES), "presets": {}}
    print("| model | n_ctx | cache | KV GiB | recurrent GiB | slot GiB |")
    print("|---|---:|---|---:|---:|---:|")
    for name in args.presets.split(","):
        if name not in PRESETS:
            ap.error(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        rows = slot_table(PRESETS[name])
        result["presets"][name] = rows
        for r in rows:
            print(f"| {name} | {r['n_ctx']:,} | {r['type']} | {r['kv'] / gib:.3f} | {r['recurrent'] / gib:.3f} | "
                  f"{r['total'] / gib:.3f} |")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
