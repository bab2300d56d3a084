"""Test setup: use the installed package (it carries the native `_core`); fall back to the
in-tree sources only when deltaspec is not installed, so pure-Python tests still run."""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("deltaspec") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
