"""A corpus of corrupted GGUF files (deltaspec.testing.bad_gguf): each must be refused with a
DeltaspecError naming the file and what is wrong, never a crash, a hang, a silent load or a leak.
"""

import json
import subprocess
import sys
from collections import Counter

import pytest

from deltaspec.testing.bad_gguf import corpus
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

CORPUS_TIMEOUT_S = 240
RSS_GROWTH_LIMIT_KIB = 16 * 1024  # a leaked mapping or copy of the 0.9 MB file per case would be ~900 MB
STAGES = ("read", "info", "model")


def _run_child(base, workdir, plant: str = "", args: str = "") -> tuple[list[dict], dict | None, str]:
    """The corpus run in one child process: (per-case results, leak report, how the child ended).
    `plant` is Python run in the child first (a planted bug); `args` extra run_corpus arguments."""
    code = (plant + "\nimport sys\nfrom deltaspec.testing.bad_gguf import run_corpus\n"
            f"run_corpus(sys.argv[1], sys.argv[2]{args})\n")
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
    """Why the case's result is wrong, or None. Entry points before the case's stage must accept
    the file (its damage is for a later check), the others refuse it with a DeltaspecError whose
    message holds the file's path and every expected word."""
    for stage in STAGES:
        got = result[stage]
        if STAGES.index(stage) < STAGES.index(case.stage):
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


def corpus_failures(base, workdir, plant: str = "", family: str | None = None) -> tuple[list[str], dict | None, int]:
    """(what went wrong, case by case, leak report, number of cases) for the corpus run in a child."""
    cases = [c for c in corpus(base.read_bytes()) if family is None or c.family == family]
    args = "" if family is None else f", leak_pass=False, family={family!r}"
    results, leak, ended = _run_child(base, workdir, plant, args)
    if len(results) < len(cases):
        return [f"the corpus child stopped after {len(results)} of {len(cases)} cases, in case "
                f"'{cases[len(results)].id}' ({ended})"], leak, len(cases)
    path = str(workdir / "case.gguf")
    failures = []
    for case, result in zip(cases, results):
        assert result["id"] == case.id, "the child runs the same corpus in the same order"
        why = _judge(case, result, path)
        if why:
            failures.append(f"{case.id}: {why}")
    return failures, leak, len(cases)


@pytest.fixture(scope="module")
def base():
    return tiny_vocab_model_path()


def test_bad_file_corpus(base, tmp_path):
    """Every file of the corpus is refused by read_gguf / `deltaspec info` / Model where its damage
    says, with a DeltaspecError naming the file and the damaged key, tensor or field. The corpus runs
    in one child process (a crash or hang names the case), and a second pass over it grows neither
    resident memory nor open descriptors, and leaves no mapping of the case file.

    Seen red: before gguf_file checked tensor placement, duplicate and empty keys, general.alignment's
    type and tensor name lengths, 82 files passed read_gguf and 70 of them reached the engine, which
    refused them only as "not a readable GGUF file"; test_planted_placement_bug keeps one such check
    disabled and sees it go red."""
    families = Counter(c.family for c in corpus(base.read_bytes()))
    failures, leak, n_cases = corpus_failures(base, tmp_path)
    print(f"\nbad-file corpus: {n_cases} files; " + ", ".join(f"{f} {n}" for f, n in sorted(families.items())))
    assert not failures, f"{len(failures)} of {n_cases} cases wrong:\n" + "\n".join(failures)
    assert n_cases >= 200 and len(families) >= 10
    assert leak is not None
    print(f"leak check, second pass over {leak['cases']} cases: {leak}")
    assert leak["cases"] == n_cases
    assert leak["rss_kib_after"] - leak["rss_kib_before"] < RSS_GROWTH_LIMIT_KIB, leak
    assert leak["fds_after"] <= leak["fds_before"], leak
    assert leak["case_file_mappings"] == 0, leak


def test_planted_placement_bug(base, tmp_path):
    """Planted bug: gguf_file's tensor placement check disabled (monkeypatched to a no-op in the
    child). The offset family goes red, each case named: read_gguf accepts files whose tensor data
    overlaps, is unaligned or lies past the end."""
    plant = "import deltaspec.gguf_file as g\ng._check_placement = lambda *args: None"
    failures, _, n_cases = corpus_failures(base, tmp_path, plant=plant, family="offset")
    assert n_cases >= 50
    assert "tensor0/offset+0x1: read accepted the file" in failures
    assert any(f.startswith("tensor2/offset-swapped-") or "offset-swapped" in f for f in failures)
    assert len(failures) >= n_cases // 2, failures


def test_planted_crash_names_the_case(base, tmp_path):
    """Planted bug: the child aborts (as a segfault in the engine would) in one case. The corpus
    reports the case it stopped in and how the child ended, instead of taking pytest down."""
    plant = ("import os\nimport deltaspec.testing.bad_gguf as b\nrun = b.run_case\n"
             "b.run_case = lambda case, path: os.abort() if case.id == 'tensor0/offset+0x1' else run(case, path)")
    failures, _, _ = corpus_failures(base, tmp_path, plant=plant, family="offset")
    assert len(failures) == 1
    assert "in case 'tensor0/offset+0x1' (exit code -6" in failures[0], failures
