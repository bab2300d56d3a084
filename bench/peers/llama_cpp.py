"""llama.cpp, built from the pinned upstream tree, as the end-to-end peer for parity and speed.

Script and importable module. Nothing from llama.cpp is copied here: the pinned
llama-cpp-python sdist is fetched by ``deps/fetch_upstream.py`` (sha256-checked) and llama.cpp
is built from its ``vendor/llama.cpp`` tree into an ignored folder.

Usage (script)::

    python bench/peers/llama_cpp.py build [--cuda] [--build-dir DIR] [--target T ...]
    python bench/peers/llama_cpp.py greedy MODEL.gguf (--prompt TEXT | --ids 1,2,3) [-n 64]

Usage (module, e.g. from pytest)::

    from bench.peers.llama_cpp import build_llama_cpp, greedy_continuation
    bin_dir = build_llama_cpp()                       # reuses a finished build (stamp file)
    ids = greedy_continuation("tiny.gguf", [9707, 11, 847], n_predict=16)   # -> list[int]
    ids = greedy_continuation("tiny.gguf", "Hello, my", n_predict=16)       # -> list[int]
    run = greedy_run("tiny.gguf", "Hello, my", 16)    # PeerRun: prompt ids, ids, text, timings

Build
-----
Configured with CMake + Ninja, Release, ``-j os.cpu_count()``::

    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    -DGGML_CCACHE=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=ON
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_OPENSSL=OFF
    (--cuda adds) -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a
    (on the CPU, -DLLAMA_BUILD_SERVER=ON instead: llama-server is a target, built only when asked,
    ``extra_targets=["llama-server"]``, about 2 more minutes on 2 cores)

Only the targets ``llama-completion`` and ``llama-tokenize`` are built (plus ``llama-bench`` and
``llama-batched-bench`` with ``--cuda``; on CPU add it with ``--target llama-bench`` / ``extra_targets=["llama-bench"]``, 17 s
more); that pulls in ggml, ggml-base, ggml-cpu, llama and llama-common and nothing else. With
GGML_NATIVE=OFF ggml-cpu gets exactly ``-msse4.2 -mf16c -mfma -mbmi2 -mavx -mavx2``, so neither
``__AMX_INT8__`` nor ``__AVX512VNNI__`` is defined and the AMX code (ggml-cpu/amx/*, the
``ggml_backend_amx_buffer_type`` extra buffer) is compiled out (checked: no AMX or zmm
instructions in libggml-cpu.so; ``ggml_cpu_has_amx_int8`` returns 0). The AMX/AVX-512 options are
also named explicitly, so a cached ``-DGGML_NATIVE=ON`` can never leak in. A stamp file
(``deltaspec-build.json``) in the build folder records the tree (sdist sha256 and path), the CMake
flags and the targets built. Same tree and flags: the build is reused, missing targets are built
incrementally. Anything else: the folder is wiped (only if it looks like a build folder) and
rebuilt. The CUDA flags were checked by configuring here: CMake accepts them
(``Using CMAKE_CUDA_ARCHITECTURES=90a``, nvcc 13.0) and stops only at the missing ``CUDA::cublas``.
With a CUDA build, llama-completion offloads all layers by default (``-ngl`` auto); pass
``bin_dir=build_llama_cpp(cuda=True)`` to ``greedy_run``.

Measured on the 2-core dev machine (AMD EPYC Zen 4, KVM, 24 GiB, gcc 12.2, Ninja, -j2): a clean
CPU build (141 Ninja steps) took 676 s wall (configure 1.2 s + build 675 s), 415 s user + 30 s
sys CPU, 0.6 GiB peak RSS; the machine was shared with other jobs at the time (load average 2-4,
the build got 65 % of one core on average), so an idle 2-core box should need about 4 min (CPU time / 2; not measured).
Reusing a finished build (stamp check only) takes 0.4 s. Output: 41 MB in the build folder.

Greedy generation: which tool, and why
--------------------------------------
``llama-completion`` (tools/completion). ``llama-simple`` (examples/simple) is the smallest
program but only prints text pieces, stops at EOG without saying so, and cannot be told anything
but ``-m -n -ngl``; ``llama-cli`` is now the chat front-end (built only with LLAMA_BUILD_SERVER).
No stock tool prints the generated token *ids*, but llama-completion can save them exactly:
with ``--prompt-cache FILE --prompt-cache-all`` it writes a session file at exit whose header is
``u32 magic 'ggsn' | u32 version | u32 n_tokens | i32 tokens[n_tokens]`` followed by the context
state (``llama_context::state_save_file``). The token list is the prompt followed by every sampled
token (including a final EOG token, if one was sampled), so the generated ids are read exactly
from that header, with no re-tokenization. ``--verbose-prompt`` prints
"number of tokens in prompt = N" (and the prompt ids), which splits the list.

Flags used: ``-no-cnv`` (qwen35 GGUFs carry a chat template, which would otherwise switch on
conversation mode), ``--no-escape`` (keep backslashes in the prompt verbatim), ``--samplers
temperature --temp 0`` (sampler chain = [model suppress-token bias] -> temp(0) -> dist; temp<=0
keeps only the first maximal logit, i.e. plain argmax with ties going to the lowest id),
``-n N``, ``-c`` sized to the prompt + N (rounded up to 256), ``--no-warmup``, ``--seed 0``,
``-sp`` (special tokens in the printed text), ``-t``/``-tb`` ``os.cpu_count()``, stdin closed,
``OMP_WAIT_POLICY=PASSIVE``.

BOS: the prompt is tokenized by ``common_tokenize(ctx, prompt, add_special=true,
parse_special=true)``, which adds BOS only when the GGUF says ``tokenizer.ggml.add_bos_token`` =
true; qwen35 GGUFs say false, so no BOS is added. Check ``PeerRun.prompt_ids``.

Token-id prompts: llama-completion only takes text. For a list of ids the prompt text is rebuilt
from the GGUF vocabulary by deltaspec's tokenizer (``Tokenizer.decode_bytes(ids, special=True)``:
byte-level BPE pieces, as in the GPT-2 / Qwen tokenizers; control and user-defined tokens
verbatim, so that llama.cpp's parse_special tokenization maps them back to one id), and the prompt
ids llama.cpp actually used (from the session file) are checked against the ids given; a mismatch
raises ``PromptMismatch`` rather than silently comparing different prompts. Ids that come from
tokenizing text always round-trip; arbitrary id sequences may not.

Caveats (they matter for bit-level parity, not for usability):
  * While a prompt cache is being written, llama-completion decodes the prompt as (n-1 tokens)
    then (last token alone), so that the recurrent state before the last token can be saved
    (``common_prompt_batch_decode``). Generation is one token per decode as usual. So the peer's
    prompt pass is "batch of n-1, then 1", not one batch of n. ``greedy_run(...,
    check_plain=True)`` re-runs without the cache (one batch of n) and raises if the text differs.
  * The CPU backend picks kernels by batch size: weight repacking (GGML_CPU_REPACK, on by
    default; ``--no-repack`` / ``-nr`` turns it off at run time), the K-quant "tiled" matmul for
    batches (env ``GGML_CPU_TILED_MM=0`` turns it off), llamafile sgemm (GGML_LLAMAFILE, on by
    default in llama.cpp builds). Pass ``extra_args`` / ``env`` to ``greedy_run`` to pin these.
  * Generation stops early at an EOG token (which is returned as the last id); ``--ignore-eos``
    is NOT used because it biases EOG logits to -inf and so changes the greedy path.

Measured per call (one llama-completion process, 2-core dev box under load average ~4): with a
tiny random qwen35 GGUF (4 layers, n_embd 64, f32, 152k-token vocab, 45 MB) 0.9-1.9 s per call
(median 1.1 s) for 16 or 64 tokens, nearly all of it process start + model/vocab load (prompt
eval ~10 ms, 64 generated tokens ~40-300 ms). ``OMP_WAIT_POLICY=PASSIVE`` is set by default
because with OpenMP's active spinning two threads on the loaded box took 3-46 s per call.
Token ids were identical with 1 and 2 threads, and with and without the prompt cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
DEPS = REPO / ".deps"
DEFAULT_BUILD_DIR_CPU = DEPS / "llama.cpp-build-cpu"
DEFAULT_BUILD_DIR_CUDA = DEPS / "llama.cpp-build-cuda"
STAMP_NAME = "deltaspec-build.json"

CPU_TARGETS = ("llama-completion", "llama-tokenize")
CUDA_EXTRA_TARGETS = ("llama-bench", "llama-batched-bench")  # the second: bench/batch_bench.py's peer

COMMON_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    # x86 instruction sets: AVX2 level, never -march=native, never AMX / AVX-512.
    "-DGGML_NATIVE=OFF",
    "-DGGML_SSE42=ON",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX_VNNI=OFF",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF",
    "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF",
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_CCACHE=OFF",
    "-DGGML_OPENMP=ON",
    "-DBUILD_SHARED_LIBS=ON",
    # only what the peer needs: no tests, examples, server (cmake_flags turns it on for the CPU), ui, app,
    # network
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
)
CUDA_CMAKE_FLAGS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90a")


class PeerError(RuntimeError):
    """llama.cpp could not be built or run."""


class PromptMismatch(PeerError):
    """llama.cpp tokenized the rebuilt prompt text into other ids than the ones given."""


# ----------------------------------------------------------------------------------------- build


def upstream_tree() -> Path:
    """The extracted llama.cpp tree of the pinned sdist (fetched and sha256-checked if needed), or
    the already extracted tree named by $DELTASPEC_GGML_SOURCE (offline machines)."""
    if os.environ.get("DELTASPEC_GGML_SOURCE"):
        return Path(os.environ["DELTASPEC_GGML_SOURCE"]).resolve()
    sys.path.insert(0, str(REPO / "deps"))
    try:
        import fetch_upstream  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return fetch_upstream.fetch(DEPS)


def _tree_digest() -> str:
    sys.path.insert(0, str(REPO / "deps"))
    try:
        import fetch_upstream  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    return fetch_upstream.expected_sha256()[0]


# With it, ggml-cuda also carries deltaspec's kernels and its mat-vec dispatcher (ggml/cuda/),
# switched off: llama.cpp still runs ggml's own kernels, and a deltaspec built against this ggml
# (DELTASPEC_GGML_LIB_DIR) switches ours on. One ggml-cuda compile then serves both.
DELTASPEC_KERNELS_FLAG = f"-DCMAKE_PROJECT_INCLUDE={REPO / 'ggml' / 'cuda' / 'inject.cmake'}"


def cmake_flags(cuda: bool = False, deltaspec_kernels: bool = False) -> list[str]:
    flags = list(COMMON_CMAKE_FLAGS) + (list(CUDA_CMAKE_FLAGS) if cuda else ["-DGGML_CUDA=OFF"])
    if not cuda:  # llama-server's target, built when asked (tests/test_server_peer.py: extra_targets)
        flags = [f.replace("-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_SERVER=ON") for f in flags]
    return flags + ([DELTASPEC_KERNELS_FLAG] if cuda and deltaspec_kernels else [])


def build_targets(cuda: bool = False, extra: Sequence[str] = ()) -> list[str]:
    """llama-completion (greedy ids), llama-tokenize; llama-bench and llama-batched-bench too for CUDA;
    plus ``extra``."""
    targets = list(CPU_TARGETS) + (list(CUDA_EXTRA_TARGETS) if cuda else [])
    return targets + [t for t in extra if t not in targets]


def _stamp(tree: Path, flags: list[str]) -> dict:
    return {"tree": str(tree), "tree_sha256": _tree_digest(), "cmake_flags": flags}


def _run_step(cmd: list[str], quiet: bool) -> None:
    if quiet:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True)
        if p.returncode != 0:
            log = (p.stdout + p.stderr).decode("utf-8", "replace")
            raise PeerError(f"{' '.join(cmd[:4])} ... failed ({p.returncode}):\n{log[-6000:]}")
    else:  # progress to our stderr, so that stdout stays the bin folder in script use
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr)
        if p.returncode != 0:
            raise PeerError(f"{' '.join(cmd[:4])} ... failed ({p.returncode})")


def build_llama_cpp(cuda: bool = False, build_dir: str | os.PathLike | None = None, *,
                    extra_targets: Sequence[str] = (), jobs: int | None = None,
                    quiet: bool = False, deltaspec_kernels: bool = False) -> Path:
    """Build llama.cpp from the pinned tree (or reuse a matching build); return its bin folder.

    A build folder whose stamp has the same tree and CMake flags is reused; targets it lacks are
    built into it incrementally. Other flags or another tree: the folder is wiped and rebuilt.
    """
    tree = upstream_tree()
    build = Path(build_dir) if build_dir else (DEFAULT_BUILD_DIR_CUDA if cuda else DEFAULT_BUILD_DIR_CPU)
    build = build.resolve()
    flags = cmake_flags(cuda, deltaspec_kernels)
    targets = build_targets(cuda, extra_targets)
    want = _stamp(tree, flags)
    stamp_file = build / STAMP_NAME
    bin_dir = build / "bin"
    have = None
    if stamp_file.exists():
        try:
            have = json.loads(stamp_file.read_text())
        except ValueError:
            have = None
    same = have is not None and {k: have.get(k) for k in want} == want
    if same and all((bin_dir / t).exists() for t in targets):
        return bin_dir
    if shutil.which("ninja") is None:
        raise PeerError("ninja not found on PATH")
    jobs = jobs or os.cpu_count() or 1
    t0 = time.monotonic()
    if not same:
        if build.exists() and any(build.iterdir()):
            if not (stamp_file.exists() or (build / "CMakeCache.txt").exists()):
                raise PeerError(f"{build} is not empty and is not a llama.cpp build folder; "
                                "refusing to wipe it")
            shutil.rmtree(build)  # other flags or tree, or an unfinished build
        build.mkdir(parents=True, exist_ok=True)
        _run_step(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *flags], quiet)
        built: list[str] = []
    else:
        built = list(have.get("targets", []))
    t1 = time.monotonic()
    _run_step(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
               "--target", *targets], quiet)
    t2 = time.monotonic()
    missing = [t for t in targets if not (bin_dir / t).exists()]
    if missing:
        raise PeerError(f"build finished but {missing} are missing from {bin_dir}")
    want.update(targets=sorted(set(built) | set(targets)), jobs=jobs,
                configure_seconds=round(t1 - t0, 1), build_seconds=round(t2 - t1, 1))
    if same:
        want.update(first_build_seconds=have.get("first_build_seconds", have.get("build_seconds")))
    else:
        want.update(first_build_seconds=round(t2 - t1, 1))
    stamp_file.write_text(json.dumps(want, indent=1) + "\n")
    if not quiet:
        print(f"llama.cpp built in {bin_dir}: configure {t1 - t0:.1f} s, build {t2 - t1:.1f} s "
              f"with -j{jobs}", file=sys.stderr)
    return bin_dir


# ------------------------------------------------------------------------------- prompt from ids


@lru_cache(maxsize=8)
def _tokenizer(model_gguf: str):
    """deltaspec's tokenizer of the GGUF (its byte-level BPE pieces are what llama.cpp prints)."""
    from deltaspec.errors import DeltaspecError  # imported here: `build` needs no deltaspec
    from deltaspec.gguf_file import read_gguf
    from deltaspec.tokenizer import Tokenizer

    try:
        return Tokenizer.from_metadata(read_gguf(model_gguf).metadata)
    except FileNotFoundError:
        raise
    except DeltaspecError as e:  # not a GGUF, or a vocabulary deltaspec's tokenizer does not take
        raise PeerError(f"{model_gguf}: cannot rebuild prompt text from ids ({e}); "
                        "pass the prompt as text") from None


def ids_to_text(model_gguf: str | os.PathLike, ids: Sequence[int]) -> str:
    """Rebuild prompt text from ids with the GGUF's byte-level BPE vocabulary.

    Normal pieces are mapped back to bytes; control / user-defined tokens (e.g. <|im_start|>) are
    kept as written, so llama.cpp's parse_special=true tokenization turns them back into one id.
    """
    tok = _tokenizer(str(model_gguf))
    for i in ids:
        if not 0 <= i < tok.n_vocab:
            raise ValueError(f"token id {i} is outside the vocabulary (0..{tok.n_vocab - 1})")
        if not tok.token_to_piece(i, special=True):  # e.g. Qwen's UNUSED [PADn] rows: no text maps to them
            raise PromptMismatch(f"token id {i} ({tok.token_text(i)!r}) has no text, so no prompt text "
                                 "tokenizes to it; llama-completion takes the prompt as text")
    try:
        return tok.decode_bytes(ids, special=True).decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptMismatch(f"prompt ids do not decode to valid UTF-8 text ({e}); "
                             "llama-completion takes the prompt as text") from None


# ---------------------------------------------------------------------------------------- greedy


@dataclasses.dataclass
class PeerRun:
    prompt_ids: list[int]      # the ids llama.cpp evaluated for the prompt
    ids: list[int]             # generated ids (last one is EOG if generation stopped there)
    text: str                  # generated text as printed by llama-completion (-sp: specials too)
    text_bytes: bytes          # the same, undecoded (pieces of a random model need not be UTF-8)
    seconds: float             # wall time of the llama-completion process
    command: list[str]
    stderr: str


SESSION_MAGIC = 0x6767736E  # 'ggsn'


def read_session_tokens(path: str | os.PathLike) -> list[int]:
    """Token ids from a llama.cpp session file (``llama_state_save_file``)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) != 12:
            raise PeerError(f"{path}: truncated session file")
        magic, version, n = struct.unpack("<III", head)
        if magic != SESSION_MAGIC:
            raise PeerError(f"{path}: not a llama.cpp session file (magic {magic:#x})")
        raw = f.read(4 * n)
    if len(raw) != 4 * n:
        raise PeerError(f"{path}: truncated token list")
    return list(struct.unpack(f"<{n}i", raw))


def _find_bin(bin_dir, name: str) -> Path:
    bin_dir = Path(bin_dir) if bin_dir else build_llama_cpp(quiet=True)
    exe = bin_dir / name
    if not exe.exists():
        raise PeerError(f"{exe} does not exist (build it with build_llama_cpp)")
    return exe


def greedy_run(model_gguf: str | os.PathLike, prompt: str | Sequence[int], n_predict: int = 64, *,
               bin_dir: str | os.PathLike | None = None, threads: int | None = None,
               n_ctx: int | None = None, extra_args: Sequence[str] = (),
               env: dict[str, str] | None = None, timeout: float = 600,
               check_plain: bool = False) -> PeerRun:
    """Run llama-completion greedily for ``n_predict`` tokens; return ids, text and timings.

    ``check_plain``: also run once more without the prompt cache (prompt in one batch, the
    unmodified llama-completion path) and raise ``PeerError`` if its text differs.
    """
    if n_predict < 1:
        raise ValueError("n_predict must be >= 1")
    exe = _find_bin(bin_dir, "llama-completion")
    given_ids = None
    if isinstance(prompt, str):
        text = prompt
    else:
        given_ids = [int(i) for i in prompt]
        if not given_ids:
            raise ValueError("empty prompt")
        text = ids_to_text(model_gguf, given_ids)
    if n_ctx is None:
        n_prompt_max = len(given_ids) if given_ids is not None else len(text.encode()) + 4
        n_ctx = -(-(n_prompt_max + n_predict + 8) // 256) * 256
    threads = threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="llama-peer-") as tmp:
        session = Path(tmp) / "session.bin"
        cmd = [str(exe), "-m", str(model_gguf), "-p", text, "-n", str(n_predict),
               "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
               "-no-cnv", "--no-escape", "--samplers", "temperature", "--temp", "0",
               "--seed", "0", "--no-warmup", "-sp", "--verbose-prompt", "--no-display-prompt",
               "--prompt-cache", str(session), "--prompt-cache-all",
               "--log-colors", "off", *extra_args]
        run_env = dict(os.environ)
        # ggml-cpu is built with OpenMP; with the default (active) wait policy, 2 threads on the
        # shared 2-core box took 3-46 s instead of ~1.5 s for the same call (spinning threads
        # descheduled). Results do not depend on the thread count or the wait policy.
        run_env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        run_env.update(env or {})
        t0 = time.monotonic()
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, env=run_env,
                           timeout=timeout)
        seconds = time.monotonic() - t0
        stderr = p.stderr.decode("utf-8", errors="replace")
        if p.returncode != 0:
            raise PeerError(f"llama-completion exited with {p.returncode}:\n{stderr[-4000:]}")
        if not session.exists():
            raise PeerError(f"llama-completion wrote no session file:\n{stderr[-4000:]}")
        tokens = read_session_tokens(session)
    m = re.search(r"number of tokens in prompt = (\d+)", stderr) or \
        re.search(r"number of tokens in prompt = (\d+)", p.stdout.decode("utf-8", "replace"))
    if not m:
        raise PeerError("could not find the prompt length in llama-completion's log")
    n_prompt = int(m.group(1))
    prompt_ids, ids = tokens[:n_prompt], tokens[n_prompt:]
    if given_ids is not None and prompt_ids != given_ids:
        raise PromptMismatch(f"llama.cpp tokenized the prompt as {prompt_ids[:32]}... "
                             f"({len(prompt_ids)} ids), not as the {len(given_ids)} ids given "
                             f"{given_ids[:32]}...")
    # stdout: generated text, " [end of text]\n" if an EOG token ended it, then
    # "\nllama_completion: saving final output to session file '<path>'\n", then "\n\n".
    out = p.stdout
    for tail in (b"\n\n", f"\nllama_completion: saving final output to session file '{session}'\n".encode(),
                 b" [end of text]\n"):
        if out.endswith(tail):
            out = out[: -len(tail)]
    if check_plain:
        i = cmd.index("--prompt-cache")
        plain_cmd = cmd[:i] + cmd[i + 3:]
        q = subprocess.run(plain_cmd, stdin=subprocess.DEVNULL, capture_output=True, env=run_env,
                           timeout=timeout)
        plain = q.stdout
        for tail in (b"\n\n", b" [end of text]\n"):
            if plain.endswith(tail):
                plain = plain[: -len(tail)]
        if q.returncode != 0 or plain != out:
            raise PeerError(f"llama-completion without a prompt cache printed {plain[:200]!r}, "
                            f"with it {out[:200]!r} (rc {q.returncode})")
    return PeerRun(prompt_ids=prompt_ids, ids=ids, text=out.decode("utf-8", errors="replace"),
                   text_bytes=out, seconds=seconds, command=cmd, stderr=stderr)


def greedy_continuation(model_gguf: str | os.PathLike, prompt_token_ids_or_text: str | Sequence[int],
                        n_predict: int = 64, **kwargs) -> list[int]:
    """Greedy (argmax) continuation by llama.cpp: the ``n_predict`` generated token ids.

    ``prompt_token_ids_or_text``: prompt text, or prompt token ids (no BOS is added for qwen35).
    Fewer than ``n_predict`` ids come back only when an EOG token was generated (it is the last
    id). Keyword arguments go to :func:`greedy_run` (bin_dir, threads, n_ctx, extra_args, env).
    """
    return greedy_run(model_gguf, prompt_token_ids_or_text, n_predict, **kwargs).ids


def tokenize(model_gguf: str | os.PathLike, text: str, *, bin_dir=None) -> list[int]:
    """Token ids of ``text`` by llama-tokenize (BOS only if the GGUF asks for it; specials parsed)."""
    exe = _find_bin(bin_dir, "llama-tokenize")
    p = subprocess.run([str(exe), "-m", str(model_gguf), "-p", text, "--ids", "--no-escape", "--log-disable"],
                       stdin=subprocess.DEVNULL, capture_output=True)
    if p.returncode != 0:
        raise PeerError(p.stderr.decode("utf-8", "replace")[-4000:])
    line = [ln for ln in p.stdout.decode().splitlines() if ln.startswith("[")][-1]
    return json.loads(line)


# ------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) llama.cpp; prints the bin folder")
    b.add_argument("--cuda", action="store_true", help="CUDA build for sm_90a (+ llama-bench, llama-batched-bench)")
    b.add_argument("--deltaspec-kernels", action="store_true",
                   help="with --cuda: put deltaspec's CUDA kernels (off by default) into ggml-cuda")
    b.add_argument("--build-dir", default=None)
    b.add_argument("--target", action="append", default=[], help="extra target (repeatable)")
    b.add_argument("-j", "--jobs", type=int, default=None)
    g = sub.add_parser("greedy", help="greedy continuation; prints JSON")
    g.add_argument("model")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--ids", help="comma-separated prompt token ids")
    g.add_argument("-n", "--n-predict", type=int, default=64)
    g.add_argument("--bin-dir", default=None)
    g.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        print(build_llama_cpp(cuda=args.cuda, build_dir=args.build_dir, extra_targets=args.target,
                              jobs=args.jobs, deltaspec_kernels=args.deltaspec_kernels))
        return 0
    prompt = args.prompt if args.prompt is not None else [int(x) for x in args.ids.split(",") if x.strip()]
    r = greedy_run(args.model, prompt, args.n_predict, bin_dir=args.bin_dir, threads=args.threads)
    print(json.dumps({"prompt_ids": r.prompt_ids, "ids": r.ids, "text": r.text,
                      "seconds": round(r.seconds, 3), "command": r.command}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
