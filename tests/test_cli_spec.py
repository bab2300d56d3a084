"""`deltaspec run` with speculative decoding (-md, --spec-type, --spec-draft-n-max/-min) on the
tiny-vocabulary model: greedy output is the same text as without speculation; bad combinations
exit 2 with one line naming the flag."""

import os
import subprocess
import sys

import pytest

from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat"
BASE = ["-p", PROMPT, "-n", "48", "--temp", "0", "-t", "1", "-c", "256"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-spec")
    return write_tiny_vocab_model(root / "target.gguf", seed=0), write_tiny_vocab_model(root / "random.gguf", seed=1)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "deltaspec", "run", *map(str, args)], capture_output=True,
                          text=True, encoding="utf-8", errors="replace", env=ENV, timeout=60)


@pytest.mark.parametrize("spec", [["-md", "TARGET"], ["-md", "RANDOM", "--spec-draft-n-max", "4"],
                                  ["--spec-type", "ngram-simple"],
                                  ["--spec-type", "ngram-simple", "--spec-draft-n-min", "2"]],
                         ids=["self-draft", "random-draft", "ngram", "ngram-nmin"])
def test_greedy_text_unchanged(models, spec):
    target, random = models
    spec = [{"TARGET": target, "RANDOM": random}.get(a, a) for a in spec]
    plain = run_cli("-m", target, *BASE)
    fast = run_cli("-m", target, *BASE, *spec)
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert len(plain.stdout) > len(PROMPT)
    assert fast.stdout == plain.stdout
    timing = fast.stderr.strip().splitlines()[-1]
    assert "drafted" in timing and "accepted" in timing and "mean acceptance length" in timing, timing
    assert "drafted" not in plain.stderr
    if spec[:2] == ["-md", str(target)]:
        assert "(100.0%)" in timing  # the target drafting for itself: every draft is accepted


@pytest.mark.parametrize("extra,flag", [
    (["--spec-type", "ngram-simple", "-md", "TARGET"], "--spec-type"),
    (["--spec-type", "mtp", "-md", "TARGET"], "--spec-type"),
    (["-md", "TARGET", "--spec-draft-n-min", "5", "--spec-draft-n-max", "3"], "--spec-draft-n-min"),
    (["--spec-type", "draft-simple"], "--spec-type"),
    (["--spec-type", "ngram-simple", "--spec-draft-n-max", "0"], "--spec-draft-n-max"),
    (["--spec-draft-n-max", "4"], "--spec-draft-n-max"),
    (["-md", "/nonexistent/draft.gguf"], "-md/--model-draft"),
    (["--spec-type", "bogus"], "--spec-type"),
])
def test_bad_combination_exits_2(models, extra, flag):
    target, _ = models
    extra = [str(target) if a == "TARGET" else a for a in extra]
    r = run_cli("-m", target, *BASE, *extra)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("name", ["mtp", "draft-mtp"])
def test_mtp_spec_type(tmp_path, name):
    """--spec-type mtp (llama.cpp's name: draft-mtp) drafts with the file's own MTP layer: here an
    oracle head (tiny_vocab's mtp with branch_scale 0), so the text is unchanged and every draft is
    accepted."""
    path = write_tiny_vocab_model(tmp_path / "mtp.gguf", seed=0, branch_scale=0.0, mtp=True)
    plain = run_cli("-m", path, *BASE)
    fast = run_cli("-m", path, *BASE, "--spec-type", name, "--spec-draft-n-min", "1")
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and len(plain.stdout) > len(PROMPT)
    timing = fast.stderr.strip().splitlines()[-1]
    assert "drafted" in timing and "(100.0%)" in timing, timing
