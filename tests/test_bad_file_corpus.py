"""A corpus of corrupted GGUF files (deltaspec.testing.bad_gguf) and of bad arguments: each must be
refused with a DeltaspecError / ValueError / TypeError naming what is wrong, never a crash, a hang,
a silent load or a leak.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from deltaspec.testing.bad_gguf import corpus
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

CORPUS_TIMEOUT_S = 240
RSS_GROWTH_LIMIT_KIB = 16 * 1024  # a leaked mapping or copy of the 0.9 MB file per case would be ~600 MB
STAGES = ("read", "info", "model")


def _run_child(base, workdir, plant: str = "") -> tuple[list[dict], dict | None, str]:
    """The corpus run in one child process: (per-case results, leak report, how the child ended)."""
    code = plant + "from deltaspec.testing.bad_gguf import run_corpus; import sys; run_corpus(sys.argv[1], sys.argv[2])"
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(base), str(workdir)], capture_output=True, text=True,
                              timeout=CORPUS_TIMEOUT_S)
        stdout, ended = proc.stdout, f"exit code {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired as e:
        stdout, ended = (e.stdout or b"").decode(), f"hung: killed after {CORPUS_TIMEOUT_S} s"
    results, leak = [], None
    for line in stdout.splitlines():
        record = json.loads(line)
        if "leak" in record:
            leak = record["leak"]
        else:
            results.append(record)
    return results, leak, ended


def _judge(case, result, path) -> str | None:
    """Why the case's result is wrong, or None."""
    must_fail = STAGES[STAGES.index(case.stage):]
    for stage in STAGES:
        got = result[stage]
        if stage not in must_fail:
            if got is not None:
                return f"{stage} should accept the file (the damage is for a later check) but raised {got[0]}: {got[3]}"
            continue
        if got is None:
            return f"{stage} accepted the file"
        name, is_deltaspec, _, message = got
        if not is_deltaspec:
            return f"{stage} raised {name}, not a DeltaspecError: {message}"
        missing = [w for w in (path, *case.expect) if w not in message]
        if missing:
            return f"{stage} raised {name} without {missing}: {message}"
    return None


def judge_corpus(results, cases, path) -> list[str]:
    by_id = {r["id"]: r for r in results}
    failures = []
    for case in cases:
        if case.id not in by_id:
            failures.append(f"{case.id}: no result")
            continue
        why = _judge(case, by_id[case.id], path)
        if why:
            failures.append(f"{case.id}: {why}")
    return failures


@pytest.fixture(scope="module")
def base():
    return tiny_vocab_model_path()


def test_bad_file_corpus(base, tmp_path):
    """Every file of the corpus is refused by read_gguf / `deltaspec info` / Model where its damage
    says, with a DeltaspecError naming the file and the damaged key, tensor or field; the whole
    corpus runs in one child process (a crash or hang names the case), and a second pass over it
    grows neither resident memory nor open descriptors nor mappings of the case file."""
    cases = corpus(base.read_bytes())
    results, leak, ended = _run_child(base, tmp_path)
    path = str(tmp_path / "case.gguf")
    if len(results) < len(cases):
        pytest.fail(f"the corpus child stopped after {len(results)} of {len(cases)} cases, in case "
                    f"'{cases[len(results)].id}' ({ended})")
    families = Counter(c.family for c in cases)
    print(f"\nbad-file corpus: {len(cases)} files; " + ", ".join(f"{f} {n}" for f, n in sorted(families.items())))
    failures = judge_corpus(results, cases, path)
    assert not failures, f"{len(failures)} of {len(cases)} cases wrong:\n" + "\n".join(failures)
    assert len(cases) >= 200
    assert leak is not None, ended
    print(f"leak check over {leak['cases']} cases: {leak}")
    assert leak["rss_kib_after"] - leak["rss_kib_before"] < RSS_GROWTH_LIMIT_KIB, leak
    assert leak["fds_after"] <= leak["fds_before"], leak
    assert leak["case_file_mappings"] == 0, leak
