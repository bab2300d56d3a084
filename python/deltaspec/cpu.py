"""How many CPU threads this process may use (its affinity mask, not the machine's core count)."""

from __future__ import annotations

import os


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
