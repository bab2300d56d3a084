"""Memory per sequence slot: the formula `deltaspec info` and bench/slot_memory.py report is what the
engine allocates, and the presets' shapes give what the engine reads from their files."""

import pytest

from deltaspec import Model
from deltaspec.qwen35 import read_hparams
from deltaspec.gguf_file import read_gguf
from deltaspec.slot_memory import slot_bytes, slot_table
from deltaspec.synth import get_preset, write_synthetic_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("slots") / "tiny.gguf"
    write_synthetic_gguf(path, "_tiny", "q8_0", seed=1)
    return path


def test_slot_bytes_equal_the_allocated_slots(tiny_path):
    """Every allocated slot of a Model(n_seq_max=3) holds what slot_bytes says, for each cache type.
    Seen to fail: with slot_bytes' recurrent part left out (planted by hand), every slot differs."""
    hp = read_hparams(read_gguf(str(tiny_path)))
    for type_kv in ("f16", "q8_0"):
        with Model(tiny_path, n_ctx=512, n_seq_max=3, type_k=type_kv, type_v=type_kv, progress=False) as m:
            info = m.kv_cache_info()
        want = slot_bytes(hp, info["n_ctx"], type_kv, type_kv)
        assert info["n_seq_max"] == 3 and len(info["slots"]) == 3
        for s in info["slots"]:
            assert (s["kv_bytes"], s["recurrent_bytes"]) == (want["kv"], want["recurrent"]), type_kv


@pytest.mark.parametrize("preset", ["_tiny", "27b"])
def test_preset_shapes_give_the_engines_numbers(preset, tmp_path):
    """The preset's own formula (used for the 27B table without a 16 GB file) equals the engine's
    HParams read from a header-only file of that preset. Seen to fail: with SynthPreset's conv term
    dropped (planted by hand), both presets differ."""
    path = tmp_path / f"{preset}.gguf"
    write_synthetic_gguf(path, preset, "f16", hollow=True)
    hp = read_hparams(read_gguf(str(path)))
    p = get_preset(preset)
    assert p.recurrent_state_bytes == hp.recurrent_state_bytes > 0
    assert slot_table(p) == slot_table(hp)
    path.unlink()
