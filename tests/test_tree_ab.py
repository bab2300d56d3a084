"""bench/tree_ab.py: each configuration's environment reaches its own tree_verify_cost.py process,
the configurations run interleaved, and bad --configs are refused.

Seen red: with run_child's env left as the parent's (config not merged in), the variant's child
reports no DELTASPEC_ROWS_SPLIT and the first assertion on envs fails; with the loops swapped
(every repetition of a configuration before the next), the order assertion fails."""

import json
import subprocess
import sys
from pathlib import Path

from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

BENCH = Path(__file__).resolve().parent.parent / "bench" / "tree_ab.py"


def test_configs_run_interleaved_in_their_own_environment(tmp_path):
    model = write_tiny_vocab_model(tmp_path / "tiny.gguf", seed=0)
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(BENCH), str(model), "--configs", "|DELTASPEC_ROWS_SPLIT=1",
                           "--widths", "4", "--reps", "2", "--steps", "2", "--depth", "8", "-t", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    envs = [c["env"].get("DELTASPEC_ROWS_SPLIT") for c in result["children"]]
    assert envs == [None, "1", None, "1"]  # each child saw its own configuration, A B A B
    assert [c["config"] for c in result["children"]] == [0, 1, 0, 1]
    for row in result["table"]:
        assert len(row["ms"]["tree verify 1+4"]) == 2 and all(v > 0 for v in row["ms"]["tree verify 1+4"])
    assert "| DELTASPEC_ROWS_SPLIT=1 |" in done.stdout and "| default |" in done.stdout


def test_bad_configs_are_refused(tmp_path):
    for configs, message in (("DELTASPEC_ROWS_SPLIT=1", "two configurations"), ("|NOEQUALS", "VAR=VALUE")):
        done = subprocess.run([sys.executable, str(BENCH), "unused.gguf", "--configs", configs],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and message in done.stderr, done.stderr
