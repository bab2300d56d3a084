"""The pinned llama.cpp tree (fetched, never committed) and its reference converter, for tests."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def llama_cpp_tree() -> Path:
    """Path of the extracted llama.cpp tree; fetched (pip download + sha256 check) on first use."""
    proc = subprocess.run([sys.executable, "deps/fetch_upstream.py", ".deps"], cwd=REPO,
                          check=True, stdout=subprocess.PIPE, text=True)
    tree = Path(proc.stdout.strip().splitlines()[-1])
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"fetch_upstream.py printed {tree}, which has no convert_hf_to_gguf.py")
    return tree


# Runs the tree's own convert_hf_to_gguf.main() once per job inside one interpreter: importing torch,
# transformers and the conversion package dominates a single run, and this keeps the suite fast.
_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for hf_dir, out, outtype, no_mtp in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", out, "--outtype", outtype] + (["--no-mtp"] if no_mtp else [])
    convert_hf_to_gguf.main()
"""


def run_reference_converter(jobs: list[tuple]) -> None:
    """Convert each (hf_dir, out_gguf, outtype[, keep_mtp]) with llama.cpp's convert_hf_to_gguf.py,
    with `--no-mtp` unless keep_mtp is given and true.

    `--no-mtp` by default because a checkpoint without MTP tensors or `mtp_num_hidden_layers` makes
    the reference abort otherwise (deltaspec's converter then writes no MTP layer either). The
    tree's gguf-py is put first on PYTHONPATH, as the script expects.
    """
    tree = llama_cpp_tree()
    paths = [str(tree / "gguf-py"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    # jobs keeping MTP first: --no-mtp sets a class attribute of the converter's model class, which
    # stays set for the later jobs of the same interpreter
    rows = sorted(([str(job[0]), str(job[1]), job[2], not (len(job) > 3 and job[3])] for job in jobs),
                  key=lambda row: row[3])
    spec = json.dumps(rows)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, str(tree), spec], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp convert_hf_to_gguf.py failed (exit {proc.returncode}):\n"
                           + proc.stdout[-6000:])


_DFLASH_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for hf_dir, target, out, outtype in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--target-model-dir", target, "--outfile", out, "--outtype", outtype]
    convert_hf_to_gguf.main()
"""


def run_reference_dflash_converter(jobs: list[tuple]) -> None:
    """Convert each (drafter_dir, target_dir, out_gguf, outtype) with llama.cpp's convert_hf_to_gguf.py
    and its `--target-model-dir` (the DFlash drafter takes the target's vocabulary), all in one
    interpreter as run_reference_converter does."""
    tree = llama_cpp_tree()
    paths = [str(tree / "gguf-py"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    spec = json.dumps([[str(x) for x in job[:3]] + [job[3]] for job in jobs])
    proc = subprocess.run([sys.executable, "-c", _DFLASH_DRIVER, str(tree), spec], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp convert_hf_to_gguf.py (DFlash) failed (exit {proc.returncode}):\n"
                           + proc.stdout[-6000:])
