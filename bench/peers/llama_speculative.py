"""llama.cpp's end-to-end speculative decoding with its MTP drafter (`--spec-type draft-mtp`), as
the peer of deltaspec's spec_type "mtp".

The program that drives it is the pinned tree's `examples/speculative-simple` (the one stock tool
whose loop is speculation alone: no server, no chat; llama-server and llama-cli take the same
`--spec-type` but wrap it in HTTP or a conversation). The example is not among the targets the peer
build makes (examples are off there), so it is compiled here, one source file against the libraries
of any finished build folder of the pinned tree (CPU or CUDA): about 3 s, and the build folder, its
CMake cache and its stamp are left alone. With it goes log_flush_at_exit.cpp: llama.cpp's logger
prints from a thread that is never joined, and the summary lines read here were lost in about one
run of three without it.

    from bench.peers.llama_speculative import build_speculative_simple, run_draft_mtp
    tool = build_speculative_simple(bin_dir)            # bin_dir: a build's bin folder
    run = run_draft_mtp(tool, "model.gguf", "text", n_predict=64, n_draft=3)
    run.tok_s, run.n_drafted, run.n_accept

What it prints and what is read from it (speculative-simple.cpp): "decoded N tokens in S seconds"
(N: tokens generated, S: the decode loop, prompt excluded), "n_drafted" and "n_accept".

Counting: with draft-mtp the target context keeps n_max recurrent-state snapshots per sequence
(common_params_speculative::need_n_rs_seq), so it can drop a rejected draft's positions and the
example never restores a checkpoint: every round is one target pass, n_accept the drafts the
target took, and the rounds are n_predict - n_accept.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.peers.llama_cpp import PeerError, upstream_tree

EXAMPLE = Path("examples") / "speculative-simple" / "speculative-simple.cpp"
# llama.cpp's logger is leaked at exit and can lose the summary lines read here: this flushes it
FLUSH_AT_EXIT = Path(__file__).resolve().parent / "log_flush_at_exit.cpp"


def build_speculative_simple(bin_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Compiles llama-speculative-simple against the libllama / libllama-common of `bin_dir` (a
    build of the pinned tree); reuses `out` when it is newer than the source and the libraries."""
    bin_dir = Path(bin_dir).resolve()
    libs = [bin_dir / "libllama.so", bin_dir / "libllama-common.so"]
    missing = [str(p) for p in libs if not p.exists()]
    if missing:
        raise PeerError(f"{bin_dir} is not a shared-library build of llama.cpp: {missing} missing")
    tree = upstream_tree()
    src = tree / EXAMPLE
    if not src.exists():
        raise PeerError(f"{src} is missing: the llama.cpp tree at {tree} was copied without {EXAMPLE.parent} "
                        "(copy that folder from the pinned tree's vendor/llama.cpp)")
    tool = Path(out) if out else bin_dir / "llama-speculative-simple"
    if tool.exists() and all(tool.stat().st_mtime > p.stat().st_mtime for p in [src, FLUSH_AT_EXIT, *libs]):
        return tool
    cmd = ["c++", "-std=c++17", "-O2", f"-I{tree / 'common'}", f"-I{tree / 'include'}", f"-I{tree / 'ggml' / 'include'}",
           str(src), str(FLUSH_AT_EXIT), f"-L{bin_dir}", "-lllama-common", "-lllama", "-lggml", "-lggml-base", "-lpthread",
           f"-Wl,-rpath,{bin_dir}", "-o", str(tool)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise PeerError(f"compiling {src} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return tool


@dataclass
class DraftMtpRun:
    n_predict: int      # tokens generated
    decode_s: float     # the decode loop (prompt excluded)
    n_drafted: int
    n_accept: int       # as the example counts it (see the module's docstring)
    text: str           # everything the example printed
    command: list[str]

    @property
    def tok_s(self) -> float:
        return self.n_predict / self.decode_s


def _int(pattern: str, text: str, what: str) -> int:
    m = re.search(pattern, text)
    if not m:
        raise PeerError(f"llama-speculative-simple printed no {what}:\n{text[-3000:]}")
    return int(m.group(1))


def run_draft_mtp(tool: str | os.PathLike, model: str | os.PathLike, prompt: str, n_predict: int, n_draft: int, *,
                  gpu: bool = False, threads: int | None = None, n_ctx: int = 4096) -> DraftMtpRun:
    """One greedy generation of n_predict tokens after `prompt`, drafting exactly n_draft tokens a
    round with the file's MTP layer."""
    cmd = [str(tool), "-m", str(model), "-p", prompt, "-n", str(n_predict), "--temp", "0", "--seed", "1",
           "-c", str(n_ctx), "--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_draft),
           "--spec-draft-n-min", str(n_draft)]
    if gpu:
        cmd += ["-ngl", "99", "--spec-draft-ngl", "99", "-fa", "on"]
    else:
        t = str(threads or os.cpu_count() or 1)
        cmd += ["-ngl", "0", "--spec-draft-ngl", "0", "-t", t, "-tb", t]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace",
                          env=env)
    text = proc.stdout
    if proc.returncode != 0:
        raise PeerError(f"llama-speculative-simple failed ({proc.returncode}):\n{text[-3000:]}")
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    if not m:
        raise PeerError(f"llama-speculative-simple printed no decode time:\n{text[-3000:]}")
    return DraftMtpRun(n_predict=int(m.group(1)), decode_s=float(m.group(2)),
                       n_drafted=_int(r"n_drafted\s+=\s+(\d+)", text, "n_drafted"),
                       n_accept=_int(r"n_accept\s+=\s+(\d+)", text, "n_accept"),
                       text=text, command=cmd)
