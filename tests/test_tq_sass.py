"""The CUDA tq quantizer as the device runs it: ggml/cuda/deltaspec_tq_warp.cuh compiled by nvcc for the
H200 (sm_90a, ggml-cuda's -use_fast_math) and read back as SASS.

The host run of the kernel's source (tests/test_turboquant.py) checks the source's arithmetic, not what
the compiler makes of it: nvcc 13.0's ptxas compiled a byte-wise copy of the fp16 scale into
F2I.U8.F16.TRUNC (the scale's value converted to a saturated integer) for its low byte, so the device
wrote min(255, trunc(d)) there while the host run wrote the right byte (issue 27). This checks, in the
machine code of every tq_quantize instantiation, that the scale leaves as one 16-bit store and that no
fp16 value goes through a float-to-integer conversion. Seen to fail: the same check on the header with
the byte-wise copy put back (planted below) finds the F2I.U8.F16 and no 16-bit store.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "ggml" / "cuda" / "deltaspec_tq_warp.cuh"
SCALE_STORE = "*reinterpret_cast<uint16_t *>(out) = __half_as_ushort(__float2half_rn(d));"
# the store as it was when the device wrote the wrong low byte
BYTEWISE_STORE = "const half hd = __float2half_rn(d); memcpy(out, &hd, 2);"

DRIVER = """#include <cuda_fp16.h>
#include "deltaspec_tq_warp.cuh"
#define INST(B, D) template __global__ void deltaspec_tq_warp::tq_quantize<B, D>(const char *, size_t, \\
    const int64_t *, char *, size_t, int64_t, int64_t);
INST(3, 32) INST(4, 32) INST(3, 64) INST(4, 64) INST(3, 128) INST(4, 128) INST(3, 256) INST(4, 256)
"""


def nvdisasm():
    try:
        import nvidia.cu13  # the nvidia-cuda-nvdisasm wheel (test extra)
    except ImportError:
        return shutil.which("nvdisasm")
    found = sorted(pathlib.Path(list(nvidia.cu13.__path__)[0]).glob("bin/nvdisasm*"))
    return str(found[0]) if found else shutil.which("nvdisasm")


def quantizer_sass(tmp_path, header_text):
    """SASS of each tq_quantize<BITS, D>, by function name."""
    (tmp_path / "deltaspec_tq_warp.cuh").write_text(header_text)
    (tmp_path / "k.cu").write_text(DRIVER)
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90a", "-use_fast_math", "-cubin", f"-I{tmp_path}",
                    f"-I{ROOT / 'ggml'}", "-o", str(tmp_path / "k.cubin"), str(tmp_path / "k.cu")], check=True,
                   capture_output=True, text=True)
    sass = subprocess.run([nvdisasm(), "-c", str(tmp_path / "k.cubin")], check=True, capture_output=True,
                          text=True).stdout
    functions = {}
    for block in re.split(r"^//-+ \.text\.", sass, flags=re.M)[1:]:
        name = block.split()[0]
        if "tq_quantize" in name:
            functions[name] = block
    return functions


def scale_problems(functions):
    """What is wrong with the scale's store in each function (empty when nothing)."""
    problems = {}
    for name, sass in functions.items():
        found = []
        if len(re.findall(r"\bSTG\.E\.U16\b", sass)) != 1:
            found.append("not one 16-bit global store")
        if re.search(r"\bF2I\.[\w.]*F16\b", sass):
            found.append("an fp16 value converted to an integer")
        if found:
            problems[name] = found
    return problems


needs_tools = pytest.mark.skipif(shutil.which("nvcc") is None or nvdisasm() is None,
                                 reason="needs nvcc and nvdisasm (the nvidia-cuda-nvdisasm wheel)")


@needs_tools
def test_quantizer_stores_the_scale_bits_in_machine_code(tmp_path):
    text = HEADER.read_text()
    assert SCALE_STORE in text, "the scale's store changed: update this test's SCALE_STORE"
    functions = quantizer_sass(tmp_path, text)
    assert len(functions) == 8, sorted(functions)
    assert scale_problems(functions) == {}


@needs_tools
def test_the_check_catches_the_bytewise_scale_copy(tmp_path):
    """The planted bug: the byte-wise copy that nvcc 13.0 miscompiled, put back."""
    functions = quantizer_sass(tmp_path, HEADER.read_text().replace(SCALE_STORE, BYTEWISE_STORE))
    problems = scale_problems(functions)
    assert len(functions) == 8 and set(problems) == set(functions), problems
