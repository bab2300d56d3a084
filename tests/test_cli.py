"""`deltaspec run` (llama-cli's flags) and `deltaspec info` as subprocesses on a tiny model, and
Model's load progress."""

import os
import re
import selectors
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from deltaspec import Model  # noqa: E402
from deltaspec.chat import prompt_opens_reasoning, split_reasoning  # noqa: E402
from deltaspec.convert import convert_hf_to_gguf  # noqa: E402
from deltaspec.testing.tiny_models import tiny_model_dir  # noqa: E402

CONFIG = "attn2_d32_untied"
PROMPT = "Once upon a time, in a land far away,"
N = 16
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}
THREADS = 1  # a thread each: ggml's spinning workers crawl on a small, busy machine


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny.gguf"
    convert_hf_to_gguf(tiny_model_dir(CONFIG), path, outtype="f16")
    return path


@pytest.fixture(scope="module")
def model(gguf):
    with Model(gguf, n_ctx=512, n_threads=THREADS, progress=False) as m:
        yield m


def run_cli(*args, stdin=None, timeout=60, command="run"):
    return subprocess.run([sys.executable, "-m", "deltaspec", command, *map(str, args)], input=stdin,
                          capture_output=True, text=True, encoding="utf-8", env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def chat_model(chat_gguf):
    with Model(chat_gguf, n_ctx=1024, n_threads=THREADS, progress=False) as m:
        yield m


def check_timing_line(line, finish="length"):
    assert line.startswith("deltaspec: prompt ") and " tok/s) | generated " in line, line
    assert line.endswith(f"| finish: {finish}"), line


def test_prompt_greedy_equals_generate(gguf, model):
    r = run_cli("-m", gguf, "-p", PROMPT, "-n", N, "--temp", 0, "-c", 512, "-t", THREADS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == PROMPT + model.generate(PROMPT, max_tokens=N, temperature=0).text + "\n"
    check_timing_line(r.stderr.strip().splitlines()[-1])
    assert "Traceback" not in r.stderr


def test_file_prompt(gguf, model, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n", encoding="utf-8")  # one trailing newline is dropped, as llama.cpp does
    r = run_cli("--model", gguf, "--file", prompt_file, "--n-predict", N, "--temp", 0, "--ctx-size", 512,
                "--threads", THREADS, "--no-display-prompt")
    assert r.returncode == 0, r.stderr
    assert r.stdout == model.generate(PROMPT, max_tokens=N, temperature=0).text + "\n"
    check_timing_line(r.stderr.strip().splitlines()[-1])


def expected_chat(m, turns, n):
    """What the REPL should print: each greedy reply on its own line, the conversation kept as messages."""
    out, messages = "", []
    for line in turns:
        messages.append({"role": "user", "content": line})
        prompt = m.apply_chat_template(messages)
        text = m.generate(prompt, max_tokens=n, temperature=0).text
        out += text + "\n"
        reasoning, content = split_reasoning(text, thinking_open=prompt_opens_reasoning(prompt))
        messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})
    return out


@pytest.mark.parametrize("ending", ["eof", "/exit"])
def test_interactive_two_turns(chat_gguf, chat_model, ending):
    turns = ["Hello, who are you?", "Tell me a story."]
    stdin = "".join(t + "\n" for t in turns) + ("" if ending == "eof" else "/exit\nnever answered\n")
    r = run_cli("-m", chat_gguf, "-i", "-n", 8, "--temp", 0, "-c", 1024, "-t", THREADS, stdin=stdin)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected_chat(chat_model, turns, 8)
    timing = [line for line in r.stderr.splitlines() if line.startswith("deltaspec: prompt ")]
    assert len(timing) == len(turns), r.stderr  # one per reply, as in the one-shot mode
    for line in timing:
        check_timing_line(line)
    assert "Traceback" not in r.stderr


def test_interactive_ctrl_c_cancels_the_reply(chat_gguf):
    proc = subprocess.Popen([sys.executable, "-m", "deltaspec", "run", "-m", str(chat_gguf), "-i", "--temp", "0",
                             "-c", "4096", "-t", str(THREADS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV)
    try:
        proc.stdin.write(b"Hello\n")
        proc.stdin.flush()
        # -n -1: the reply runs until the context is full, so it is still streaming when the signal comes
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=40), "no reply started"
        first = os.read(proc.stdout.fileno(), 64)
        assert first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(b"/exit\n", timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err.decode()
    assert proc.returncode == 0, err
    assert "reply cancelled" in err and "Traceback" not in err


@pytest.mark.parametrize("args, flag", [
    (["-n", "-5"], "-n/--n-predict"),
    (["-n", "abc"], "-n/--n-predict"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "2"], "--top-p"),
    (["-ctk", "q9"], "-ctk/--cache-type-k"),
    (["-ctv", "f8"], "-ctv/--cache-type-v"),
    (["-c", "-3"], "-c/--ctx-size"),
    (["-t", "0"], "-t/--threads"),
    (["--seed", "-7"], "-s/--seed"),
    (["--device", "tpu"], "--device"),
])
def test_bad_flag_values(gguf, args, flag):
    r = run_cli("-m", gguf, "-p", "hi", *args)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], r.stderr


def test_missing_model_and_prompt(gguf, tmp_path):
    r = run_cli("-m", tmp_path / "nope.gguf", "-p", "hi")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nope.gguf" in r.stderr
    r = run_cli("-m", gguf)
    assert r.returncode == 2 and "-p/--prompt" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("-m", gguf, "-f", tmp_path / "missing.txt")
    assert r.returncode == 2 and "-f/--file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("-m", gguf, "-i", "-t", THREADS, stdin="hello\n")  # no chat template in this GGUF
    assert r.returncode == 2 and "-i/--interactive" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_load_progress_callback(gguf):
    fractions = []
    with Model(gguf, n_ctx=256, n_threads=THREADS, progress=fractions.append):
        pass
    assert fractions[0] == 0.0 and fractions[-1] == 1.0
    assert all(a < b for a, b in zip(fractions, fractions[1:])), fractions
    assert len(fractions) <= 102

    calls = []
    with pytest.raises(TypeError, match="progress"):
        Model(gguf, n_ctx=256, progress="yes")

    class Stop(Exception):
        pass

    def abort(fraction):
        calls.append(fraction)
        if fraction > 0:
            raise Stop

    with pytest.raises(Stop):  # an exception in the callback aborts the load and reaches the caller
        Model(gguf, n_ctx=256, n_threads=THREADS, progress=abort)
    assert calls[-1] > 0


# Elements and bytes per block of each KV cache type (ggml's block structs in ggml-common.h).
KV_BLOCKS = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
             "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24)}


def test_info(gguf, model):
    r = run_cli(gguf, "-c", 1000, command="info")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    hp = model.hparams
    assert re.search(r"^architecture +qwen35\b", out, re.M), out
    n_attn = hp.recurrent.count(False)
    assert f"layers          {hp.n_layer} = {hp.n_layer - n_attn} Gated DeltaNet + {n_attn} gated attention" in out
    assert "at n_ctx=1024" in out and "n_ctx=1000" not in out  # rounded up to whole 256-token KV blocks
    rows = dict((name, (per_token, mib)) for name, per_token, mib in
                re.findall(r"^  (\w+) +([\d,]+) bytes/token +([\d.,]+) MiB$", out, re.M))
    assert set(rows) == set(KV_BLOCKS) | {"tq3", "tq4"}, out
    for bits in (3, 4):  # per head vector an fp16 scale and head_dim indices of `bits` bits
        per_token = 2 * n_attn * hp.n_head_kv * (2 + hp.head_dim * bits // 8)
        assert rows[f"tq{bits}"] == (f"{per_token:,}", f"{per_token * 1024 / 2**20:,.1f}")
    for name, (elements, size) in KV_BLOCKS.items():
        # K and V: one row of n_head_kv * head_dim elements per attention layer each
        per_token = 2 * n_attn * hp.n_head_kv * hp.head_dim // elements * size
        assert rows[name] == (f"{per_token:,}", f"{per_token * 1024 / 2**20:,.1f}"), name


@pytest.mark.parametrize("ctx", ["0", "-5", "abc"])
def test_info_rejects_bad_ctx(gguf, ctx):
    r = run_cli(gguf, "-c", ctx, command="info")
    assert r.returncode == 2 and r.stdout == ""
    assert "-c/--ctx-size" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_convert_command_matches_the_python_api(gguf, model, tmp_path):
    out = tmp_path / "cli.gguf"
    r = run_cli(tiny_model_dir(CONFIG), out, "--outtype", "f16", command="convert")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == gguf.read_bytes()  # the fixture's file: convert_hf_to_gguf(..., outtype="f16")
    with Model(out, n_ctx=512, n_threads=THREADS, progress=False) as m:
        ids = m.tokenize(PROMPT)
        assert (m.logits(ids) == model.logits(ids)).all()


def test_convert_command_reports_errors(tmp_path):
    r = run_cli(tmp_path / "no-such-folder", tmp_path / "out.gguf", command="convert")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("deltaspec: error: ") and "no-such-folder" in r.stderr
    assert not (tmp_path / "out.gguf").exists()
