"""A corpus of corrupted GGUF files (deltaspec.testing.bad_gguf) and of bad arguments: each must be
refused with a DeltaspecError (files) or ValueError / TypeError / DeltaspecError (arguments) naming
the file and what is wrong, never a crash, a hang, a silent load or a leak. The counts are printed
(pytest -s): files per family of damage, argument sets.
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


def _run_child(base, workdir, plant: str = "", args: str = "",
               timeout: float = CORPUS_TIMEOUT_S) -> tuple[list[dict], dict | None, str]:
    """The corpus run in one child process: (per-case results, leak report, how the child ended).
    `plant` is Python run in the child first (a planted bug); `args` extra run_corpus arguments."""
    code = (plant + "\nimport sys\nfrom deltaspec.testing.bad_gguf import run_corpus\n"
            f"run_corpus(sys.argv[1], sys.argv[2]{args})\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(base), str(workdir)], capture_output=True, text=True,
                              timeout=timeout)
        stdout, ended = proc.stdout, f"exit code {proc.returncode}: {proc.stderr[-2000:]}"
    except subprocess.TimeoutExpired as e:
        stdout, ended = (e.stdout or b"").decode(), f"hung: killed after {timeout} s"
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
    message holds the file's path and every expected word; `deltaspec info` prints that message
    and exits 2 when describe refuses the file, and shows it otherwise."""
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
    code, stderr = result["cli"]
    if case.stage == "model":
        return None if code == 0 else f"`deltaspec info` should show the file, but: {code} {stderr}"
    if code != 2 or not stderr.startswith("deltaspec: error: ") or result["info"][3] not in stderr:
        return f"`deltaspec info` should exit 2 with the error, but: {code} {stderr}"
    return None


def corpus_failures(base, workdir, plant: str = "", family: str | None = None, leak_pass: bool = True,
                    timeout: float = CORPUS_TIMEOUT_S) -> tuple[list[str], dict | None, int]:
    """(what went wrong, case by case, leak report, number of cases) for the corpus run in a child."""
    cases = [c for c in corpus(base.read_bytes()) if family is None or c.family == family]
    args = f", leak_pass={leak_pass}, family={family!r}"
    results, leak, ended = _run_child(base, workdir, plant, args, timeout)
    if len(results) < len(cases):
        return [f"the corpus child stopped after {len(results)} of {len(cases)} cases, in case "
                f"'{cases[len(results)].id}' ({ended})"], leak, len(cases)
    path = str(workdir / "case.gguf")
    failures = []
    if len({r["sha1"] for r in results}) != len(cases):
        failures.append("the corpus holds the same file under two ids")
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
    type, tensor name lengths and nested arrays, 83 files passed read_gguf and 71 of them reached the
    engine, which refused them only as "not a readable GGUF file" (the other 12, tensors whose
    first dimension grew into the next one's data, only by the later shape check); test_planted_placement_bug keeps one such check
    disabled and sees it go red."""
    families = Counter(c.family for c in corpus(base.read_bytes()))
    failures, leak, n_cases = corpus_failures(base, tmp_path)
    print(f"\nbad-file corpus: {n_cases} files; " + ", ".join(f"{f} {n}" for f, n in sorted(families.items())))
    assert not failures, f"{len(failures)} of {n_cases} cases wrong:\n" + "\n".join(failures)
    assert n_cases >= 200 and len(families) >= 10
    assert leak is not None, "the child ended without its leak report"
    print(f"leak check, second pass over {leak['cases']} cases: {leak}")
    assert leak["cases"] == n_cases
    assert not leaks(leak), leaks(leak)


def leaks(leak: dict) -> list[str]:
    """What the leak report of a corpus pass shows leaking."""
    out = []
    if leak["rss_kib_after"] - leak["rss_kib_before"] >= RSS_GROWTH_LIMIT_KIB:
        out.append(f"resident memory grew by {leak['rss_kib_after'] - leak['rss_kib_before']} KiB")
    if leak["fds_after"] > leak["fds_before"]:
        out.append(f"open file descriptors grew from {leak['fds_before']} to {leak['fds_after']}")
    if leak["case_file_mappings"]:
        out.append(f"{leak['case_file_mappings']} mappings of case files are left")
    return out


def test_planted_leak_is_seen(base, tmp_path):
    """Planted bug: read_gguf's mapping of the file is never closed (gguf_file.mmap replaced in the
    child by one that keeps every map). The leak pass over the truncation family reports open
    descriptors growing and mappings of the deleted case files left behind."""
    plant = ("import mmap as real, types\nimport deltaspec.gguf_file as g\nkept = []\n"
             "class Leaky:\n"
             "    def __init__(self, *a, **k): self.m = real.mmap(*a, **k); kept.append(self.m)\n"
             "    def __enter__(self): return self.m\n"
             "    def __exit__(self, *exc): return False\n"
             "g.mmap = types.SimpleNamespace(mmap=Leaky, ACCESS_READ=real.ACCESS_READ)")
    failures, leak, n_cases = corpus_failures(base, tmp_path, plant=plant, family="truncation")
    assert not failures and n_cases >= 100  # the files are still refused as they should be
    found = leaks(leak)
    assert any("open file descriptors grew" in f for f in found), leak
    assert any("mappings of case files are left" in f for f in found), leak


def test_planted_placement_bug(base, tmp_path):
    """Planted bug: gguf_file's tensor placement check disabled (monkeypatched to a no-op in the
    child). The offset family goes red, each case named: read_gguf accepts files whose tensor data
    overlaps, is unaligned or lies past the end."""
    plant = "import deltaspec.gguf_file as g\ng._check_placement = lambda *args: None"
    failures, _, n_cases = corpus_failures(base, tmp_path, plant=plant, family="offset", leak_pass=False)
    assert n_cases >= 50
    assert "tensor0/offset+0x1: read accepted the file" in failures
    assert any(f.startswith("tensor2/offset-swapped-") or "offset-swapped" in f for f in failures)
    assert len(failures) >= n_cases // 2, failures


def test_planted_crash_names_the_case(base, tmp_path):
    """Planted bug: the child aborts (as a segfault in the engine would) in one case. The corpus
    reports the case it stopped in and how the child ended, instead of taking pytest down."""
    plant = ("import os\nimport deltaspec.testing.bad_gguf as b\nrun = b.run_case\n"
             "b.run_case = lambda case, path: os.abort() if case.id == 'tensor0/offset+0x1' else run(case, path)")
    failures, _, _ = corpus_failures(base, tmp_path, plant=plant, family="offset", leak_pass=False)
    assert len(failures) == 1
    assert "in case 'tensor0/offset+0x1' (exit code -6" in failures[0], failures


# --- bad arguments -------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
# (parameter the message must name, call on (model, path of the model's file, a folder))
BAD_MODEL_ARGS = [
    *[("n_ctx", dict(n_ctx=v)) for v in (-1, 1.5, "64", None, True, 2**40, 2**63, NAN)],
    *[("n_threads", dict(n_threads=v)) for v in (-1, 1.5, "1", True, 10**6, 2**40)],
    *[("n_ubatch", dict(n_ubatch=v)) for v in (0, 1.5, None, False, 2**63)],
    *[("device", dict(device=v)) for v in ("", "tpu", 1, "CPU", "gpu", "cuda:x", "cuda:-1", "cuda:")],  # None: the default
    ("type_k", dict(type_k="")), ("type_k", dict(type_k=None)), ("type_v", dict(type_v=5)),
    ("type_v", dict(type_v="Q8_0")), ("type_k", dict(type_k="q4_k")),
    ("progress", dict(progress="yes")), ("progress", dict(progress=1)),
]
BAD_PATHS = [("path", 123), ("path", None), ("path", ["model.gguf"]), ("no such file", "/nonexistent/model.gguf"),
             ("no such file", ""), ("not a regular file", "FOLDER")]
BAD_GENERATE_ARGS = [
    *[("max_tokens", dict(max_tokens=v)) for v in (0, -5, 1.5, "10", True)],
    *[("temperature", dict(temperature=v)) for v in (-0.1, NAN, INF, "0.5", None, 1e5)],
    *[("top_k", dict(top_k=v)) for v in (-1, 1.5, None, True)],
    *[("top_p", dict(top_p=v)) for v in (0, -0.1, 1.5, NAN)],
    *[("min_p", dict(min_p=v)) for v in (-0.1, 1.1, NAN)],
    *[("repeat_penalty", dict(repeat_penalty=v)) for v in (0, -1, NAN)],
    *[("presence_penalty", dict(presence_penalty=v)) for v in (NAN, INF, "x")],
    *[("frequency_penalty", dict(frequency_penalty=v)) for v in (NAN, 1e5)],
    *[("penalty_last_n", dict(penalty_last_n=v)) for v in (-2, 1.5, None)],
    *[("seed", dict(seed=v)) for v in (-2, 2**64, 1.5, "42", True)],  # -1: random
    ("stop", dict(stop=5)), ("stop[0]", dict(stop=[5])), ("stop[0]", dict(stop=[""])), ("stop", dict(stop=b"x")),
    ("stop[1]", dict(stop=["ok", None])),
    ("stream", dict(stream="yes")), ("stream", dict(stream=1)),
    ("spec_type", dict(spec_type="bogus")), ("draft_n_max", dict(spec_type="ngram-simple", draft_n_max=0)),
    ("draft_n_max", dict(spec_type="ngram-simple", draft_n_max=257)),
    ("draft_n_max", dict(spec_type="ngram-simple", draft_n_max=1.5)),
    ("draft_n_min", dict(spec_type="ngram-simple", draft_n_min=-1)),
    ("draft_n_min", dict(spec_type="ngram-simple", draft_n_min=5, draft_n_max=4)),
    ("draft_model", dict(spec_type="draft-simple")), ("draft_model", dict(draft_model=5)),
    ("draft_model", dict(spec_type="ngram-simple", draft_model="x.gguf")),
    ("no such file", dict(draft_model="/nonexistent/draft.gguf")),
]
BAD_PROMPTS = [("prompt is empty", ""), ("prompt", []), ("outside the vocabulary", [-1]),
               ("outside the vocabulary", "N_VOCAB"), ("prompt", [1.5]), ("prompt", None), ("prompt", 5),
               ("prompt", b"hi"), ("prompt", [[1, 2]]), ("prompt", {"a": 1}), ("n_ctx", [1] * 600),
               ("prompt", [1, [2]])]


def _model_calls(path, folder, n_vocab):
    """(case id, parameter the message must name, call on a loaded model)."""
    from deltaspec import Model
    calls = []
    for i, (name, kwargs) in enumerate(BAD_MODEL_ARGS):
        calls.append((f"Model/{name}#{i}", name,
                      lambda m, kw=kwargs: Model(path, **{"n_ctx": 64, "n_threads": 1, **kw})))
    for i, (name, p) in enumerate(BAD_PATHS):
        p = folder if p == "FOLDER" else p
        calls.append((f"Model/path#{i}", name, lambda m, p=p: Model(p, n_ctx=64, n_threads=1)))
    for i, (name, kwargs) in enumerate(BAD_GENERATE_ARGS):
        calls.append((f"generate/{name}#{i}", name, lambda m, kw=kwargs: m.generate("hi", **{"max_tokens": 2, **kw})))
    calls.append(("generate/draft_model=self", "separate Model",
                  lambda m: m.generate("hi", max_tokens=2, draft_model=m)))
    for i, (name, prompt) in enumerate(BAD_PROMPTS):
        prompt = [n_vocab] if prompt == "N_VOCAB" else prompt
        calls.append((f"generate/prompt#{i}", name, lambda m, p=prompt: m.generate(p, max_tokens=2)))
    for i, text in enumerate((5, None, [104])):  # bytes are text, as llama-cpp-python takes it
        calls.append((f"tokenize/text#{i}", "text", lambda m, t=text: m.tokenize(t)))
    calls.append(("tokenize/special", "special", lambda m: m.tokenize("hi", special="yes")))
    for i, (name, ids) in enumerate((("outside the vocabulary", [-1]), ("outside the vocabulary", [n_vocab]),
                                     ("ids", "abc"), ("ids", [1.5]), ("ids", [[1]]), ("ids", None))):
        calls.append((f"detokenize/ids#{i}", name, lambda m, ids=ids: m.detokenize(ids)))
    calls.append(("detokenize/special", "special", lambda m: m.detokenize([1], special="x")))
    for i, logits in enumerate((None, "ALL", 1)):
        calls.append((f"eval/logits#{i}", "logits", lambda m, lg=logits: m.eval([1], logits=lg)))
    calls.append(("eval/ids", "outside the vocabulary", lambda m: m.eval([1, n_vocab + 5])))
    calls.append(("eval/ids-str", "ids", lambda m: m.eval("abc")))
    calls.append(("logits/ids", "ids", lambda m: m.logits(None)))
    calls.append(("create_completion/max_tokens", "max_tokens", lambda m: m.create_completion("hi", max_tokens=-1)))
    calls.append(("create_completion/temperature", "temperature",
                  lambda m: m.create_completion("hi", max_tokens=2, temperature=-1)))
    return calls


def test_bad_arguments(tmp_path):
    """More than 100 bad argument sets to Model, generate, tokenize, detokenize, eval, logits and
    create_completion each raise ValueError / TypeError / a DeltaspecError naming the parameter,
    and the model keeps working after them (no state changed: n_past stays 0).

    Seen red: with model.py as it was before these checks (the planted bug: its old text in place),
    26 of the 125 sets were wrong: n_ctx=True and n_threads="1"/True loaded silently, Model(123),
    tokenize(5), detokenize("abc") and draft_model=5 raised TypeErrors that named no parameter,
    detokenize([-1]) returned '' (a negative index into the vocabulary) and detokenize([n_vocab])
    an IndexError, tokenize/detokenize took special="yes", and bad prompts were named "ids".
    (n_ctx=2**63, n_threads=2**40 and eval(logits=None) passed only by accident there: pybind11's
    "incompatible arguments" message lists every parameter name.)"""
    from deltaspec import Model
    from deltaspec.errors import DeltaspecError
    path = tiny_vocab_model_path()
    folder = tmp_path / "folder"
    folder.mkdir()
    wrong = []
    with Model(path, n_ctx=64, n_threads=1) as model:
        calls = _model_calls(path, str(folder), model.n_vocab)
        for case_id, name, call in calls:
            try:
                result = call(model)
            except Exception as e:  # noqa: BLE001 - which classes are right is what is tested
                if not isinstance(e, (ValueError, TypeError, DeltaspecError)):
                    wrong.append(f"{case_id}: {type(e).__name__}: {e}")
                elif name not in str(e):
                    wrong.append(f"{case_id}: {type(e).__name__} does not name {name!r}: {e}")
            else:
                wrong.append(f"{case_id}: no error (returned {result!r:.80})")
                if isinstance(result, Model):
                    result.close()
        assert model.n_past == 0
        assert model.generate("hi", max_tokens=2, temperature=0).tokens  # still works
    print(f"\nbad argument sets: {len(calls)}")
    assert not wrong, f"{len(wrong)} of {len(calls)} argument sets wrong:\n" + "\n".join(wrong)
    assert len(calls) >= 100


def test_planted_hang_names_the_case(base, tmp_path):
    """Planted bug: one case never returns (run_case sleeps in the child). The child is killed at
    the timeout; the cases before it were reported, and the corpus names the one it hung in."""
    plant = ("import time\nimport deltaspec.testing.bad_gguf as b\nrun = b.run_case\n"
             "b.run_case = lambda case, path: time.sleep(3600) if case.id == 'tensor4/offset+0x1' else run(case, path)")
    failures, _, _ = corpus_failures(base, tmp_path, plant=plant, family="offset", leak_pass=False, timeout=10)
    assert len(failures) == 1
    assert "stopped after 4 of " in failures[0], failures
    assert "cases, in case 'tensor4/offset+0x1' (hung: killed after 10 s)" in failures[0], failures
