"""What ``llama-quantize --dry-run`` (pinned llama.cpp tree) decides for every tensor of a GGUF.

    from bench.peers.llama_quantize import dry_run
    run = dry_run("model-f16.gguf", "Q4_K_M")   # needs build_llama_cpp(extra_targets=["llama-quantize"])
    run.tensors[0].name, run.tensors[0].new_type  # in the order llama-quantize visits them

Dry run: tools/quantize's ``--dry-run`` picks every tensor's target type exactly as a real run
does (same preliminary pass over the loader's tensors), then only logs, per tensor, its name,
shape, current type and the type it would write, plus the total size. It never reads tensor data
(no ``load_data_range`` in the dry-run branch; the loader mmaps the file and checks only that each
tensor's range lies within it), so a GGUF whose data is a hole (``write_synthetic_gguf(...,
hollow=True)``) is enough: the check costs about a second even for 27B.

Parsed log lines (llama-quant.cpp's main loop, one per tensor, to stderr)::

    [  12/ 320]              blk.0.ffn_down.weight - [ 3584,  1024,     1,     1], type =    f16, size =    7.000 MiB ->     2.871 MiB (q6_K)
    [  13/ 320]             blk.0.ffn_norm.weight - [ 1024,     1,     1,     1], type =    f32, size =    0.004 MiB

The second form is a tensor that keeps its type. Every index 1..N must appear exactly once, or
``PeerError`` is raised (a changed log format must not pass as "no tensors differ").
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from pathlib import Path

from bench.peers.llama_cpp import PeerError, _find_bin

_LINE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]\s+(\S+)\s+- \[([\d,\s]+)\], type =\s*(\w+), size =\s*[\d.]+ MiB"
                   r"(?: ->\s*[\d.]+ MiB \((\w+)\))?\s*$")
_QUANT_SIZE = re.compile(r"quant size\s*=\s*([\d.]+) MiB")


@dataclasses.dataclass(frozen=True)
class DryRunTensor:
    name: str
    shape: tuple[int, ...]  # ggml order, trailing 1s dropped
    old_type: str           # ggml type name as llama.cpp writes it ("f16", "q4_K", ...)
    new_type: str           # the type llama-quantize would write


@dataclasses.dataclass(frozen=True)
class DryRun:
    tensors: list[DryRunTensor]  # in llama-quantize's visiting order
    quant_mib: float             # its "quant size" line (MiB, two decimals)

    def types(self) -> dict[str, str]:
        """Tensor name -> the ggml type name llama-quantize would write, upper case ("Q6_K")."""
        return {t.name: t.new_type.upper() for t in self.tensors}


def parse_dry_run(log: str, source: str = "llama-quantize") -> DryRun:
    """The per-tensor lines and the quant size of a dry-run log; PeerError if any is missing."""
    rows: dict[int, DryRunTensor] = {}
    n_total = None
    for line in log.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        i, n = int(m.group(1)), int(m.group(2))
        if n_total not in (None, n) or i in rows:
            raise PeerError(f"{source}: inconsistent tensor line {line.strip()!r}")
        n_total = n
        shape = tuple(int(x) for x in m.group(4).split(","))
        while len(shape) > 1 and shape[-1] == 1:
            shape = shape[:-1]
        rows[i] = DryRunTensor(m.group(3), shape, m.group(5), m.group(6) or m.group(5))
    if not rows or sorted(rows) != list(range(1, n_total + 1)):
        raise PeerError(f"{source}: expected one line per tensor, got indices {sorted(rows)[:5]}... of "
                        f"{n_total}; log tail:\n{log[-3000:]}")
    sizes = _QUANT_SIZE.findall(log)
    if len(sizes) != 1:
        raise PeerError(f"{source}: expected one 'quant size' line, got {len(sizes)}")
    return DryRun([rows[i] for i in sorted(rows)], float(sizes[0]))


def dry_run(model_gguf: str | os.PathLike, ftype: str = "Q4_K_M", *, bin_dir=None,
            timeout: float = 300) -> DryRun:
    """Run ``llama-quantize --dry-run MODEL FTYPE`` and parse what it would write."""
    exe = _find_bin(bin_dir, "llama-quantize")
    model = Path(model_gguf)
    if not model.is_file():
        raise PeerError(f"{model}: no such GGUF file")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    p = subprocess.run([str(exe), "--dry-run", str(model), ftype], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, errors="replace", timeout=timeout, env=env)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        raise PeerError(f"llama-quantize --dry-run {model.name} {ftype} failed ({p.returncode}):\n{log[-4000:]}")
    return parse_dry_run(log, f"llama-quantize --dry-run {model.name} {ftype}")
