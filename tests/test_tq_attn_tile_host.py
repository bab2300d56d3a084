"""The CUDA tile kernel for one-token attention over tq rows (tq_decode_attn_tile,
ggml/cuda/deltaspec_tq_attn_tile.cuh) checked on the host: its source is compiled with the host C++
compiler by tests/host/tq_attn_tile_host.cpp (a block's threads as std::threads, __syncthreads and
the shuffles as barriers) and run over random tq rows against a float64 reference, for head dims 128
and 256, 1..8 query heads per KV head, every tq3/tq4 mix, several streams, masked rows whose scales are
NaN, partial tiles and blocks of several tiles. The device run is tests/test_gpu_turboquant.py's.

Planted bug: the kernel's own switch (skip_last_row: each tile's last row left out, as
DELTASPEC_TEST_TQ_ATTN_BUG=skip_last_row sets it on the device) makes every case differ by 5e-2 or
more (seen: 0.036 .. 0.23), test_planted_row_skip_is_caught.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "host" / "tq_attn_tile_host.cpp"
N_CASES = 8
HOST_REL = 1e-5  # float32 sums in the kernel's order against float64 (seen: < 1e-6)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx, "no host C++ compiler (c++ or g++) on PATH"
    exe = tmp_path_factory.mktemp("tq_attn_tile") / "tq_attn_tile_host"
    subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", "-I", str(ROOT / "ggml" / "cuda"),
                    "-I", str(ROOT / "ggml"), str(SOURCE), "-o", str(exe)], check=True, timeout=300)
    return exe


def _run(exe, *args):
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, check=True).stdout
    cases = re.findall(r"^case (.*) rel (\S+) blocks (\d+)$", out, re.M)
    assert len(cases) == N_CASES and all(int(b) > 0 for _, _, b in cases), out
    return [(shape, float(rel)) for shape, rel, _ in cases]


def test_tile_kernel_source_matches_float64_attention(harness):
    bad = [(shape, rel) for shape, rel in _run(harness) if not rel <= HOST_REL]
    assert not bad, f"the tile kernel's source differs from float64 attention: {bad}"


def test_planted_row_skip_is_caught(harness):
    missed = [(shape, rel) for shape, rel in _run(harness, "skip_last_row") if not rel > 100 * HOST_REL]
    assert not missed, f"skip_last_row left these cases within the bound: {missed}"
