"""What a user sees while a model loads: a tqdm bar on a terminal, from the moment the load starts
(reading and checking the GGUF can take seconds for a large file, before any weight moves), or
plain lines when stderr is not a terminal (a log file, a CI job), where a redrawn bar would
smear control characters over many lines."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

# Plain-line mode prints at these fractions of the weights (and the last line when done).
PLAIN_STEPS = (0.25, 0.5, 0.75)


def stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def start_load_progress(path: str, show: bool | None):
    """(on_bytes(done, total) for the engine or None, close() to call after the load or None).
    show None: a bar on a terminal, nothing otherwise; True: a bar on a terminal, plain lines
    otherwise; False: nothing. The first thing shows now, before the file is read."""
    tty = stderr_is_tty()
    if show is False or (show is None and not tty):
        return None, None
    label = os.path.basename(path)
    try:
        size = os.path.getsize(path)
    except OSError:  # the loader reports a missing file with a better message
        size = 0
    if tty:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional at run time: plain lines instead
            tty = False
        else:
            return _bar(tqdm, label, size)
    return _plain_lines(label, size)


def _bar(tqdm, label: str, size: int):
    # the file's size until the engine reports the weights' bytes (the bar then rescales)
    bar = tqdm(total=size or None, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
               desc=f"loading {label}", file=sys.stderr, dynamic_ncols=True)

    def on_bytes(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
            bar.refresh()
        bar.update(done - bar.n)

    return on_bytes, bar.close


def _plain_lines(label: str, size: int) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    t0 = time.perf_counter()
    print(f"deltaspec: loading {label} ({size / 2**20:.1f} MiB)", file=sys.stderr, flush=True)
    steps = list(PLAIN_STEPS)

    def on_bytes(done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        while steps and fraction >= steps[0]:
            print(f"deltaspec: loading {label}: {int(steps.pop(0) * 100)}%", file=sys.stderr, flush=True)
        if total and done == total:
            print(f"deltaspec: loaded {label} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    return on_bytes, None
