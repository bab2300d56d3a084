"""tests/ci_skips.py: under CI=true a skipped test fails the run; elsewhere skips stay skips.

Each case runs a small pytest session (pytester) whose conftest is tests/ci_skips.py. Planted bugs,
each seen to fail these tests: the `ci_enabled()` check made to return False (the CI runs passed),
and the gpu exemption removed (the gpu test failed instead of skipping).
"""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HOOKS = (Path(__file__).parent / "ci_skips.py").read_text(encoding="utf-8")

TESTS = '''
import pytest

def test_runs():
    pass

def test_skips_at_run_time():
    pytest.skip("reference package missing")

@pytest.mark.skipif(True, reason="needs a reference")
def test_skipif_mark():
    pass

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("no CUDA device")

@pytest.mark.xfail(reason="known difference")
def test_expected_failure():
    assert False
'''

IMPORT_SKIP = '''
import pytest
pytest.importorskip("deltaspec_no_such_reference_package")

def test_never_collected():
    pass
'''


def _run(pytester, *args):
    # plugins the inner runs do not use take seconds to load in each of them
    return pytester.runpytest(*args, "-p", "no:hypothesispytest", "-p", "no:benchmark")


@pytest.fixture
def suite(pytester):
    pytester.makeconftest(HOOKS)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    pytester.makepyfile(test_proofs=TESTS)
    return pytester


def test_skips_fail_the_run_under_ci(suite, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = _run(suite, "-rA")
    # a skip at setup (skipif mark) becomes an error, one at call time a failure
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    for line in ("FAILED *test_skips_at_run_time - *skipped under CI=true*reference package missing",
                 "ERROR *test_skipif_mark - *skipped under CI=true*needs a reference",
                 "SKIPPED *no CUDA device"):  # the gpu-marked test is exempt
        result.stdout.fnmatch_lines([line])


def test_skips_stay_skips_without_ci(suite, monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    result = _run(suite)
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    assert result.ret == pytest.ExitCode.OK
    monkeypatch.setenv("CI", "false")
    _run(suite).assert_outcomes(passed=1, skipped=3, xfailed=1)


def test_module_level_skip_fails_under_ci(suite, monkeypatch):
    suite.makepyfile(test_import=IMPORT_SKIP)
    monkeypatch.setenv("CI", "true")
    result = _run(suite, "test_import.py")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error stops the run
    result.stdout.fnmatch_lines(["*test_import.py was skipped under CI=true*deltaspec_no_such_reference_package*"])
    monkeypatch.delenv("CI")
    result = _run(suite, "test_import.py")
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
