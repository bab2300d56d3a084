"""M-RoPE sections (qwen35.rope.dimension_sections) that leave a rotary pair without a section.

Interleaved M-RoPE gives pair i to section i % 3 while i < 3 * that section's size. A pair outside
every section is rotated by the text position in transformers and by the 4th position (0 for text)
in llama.cpp / ggml, so such a file has no single meaning: the loader and the converter refuse it,
naming the key. Real checkpoints use [11, 11, 10, 0] (32 pairs), which covers every pair.

Planted bugs, each seen to fail: the orphan check of `qwen35.rope_sections_problem` removed (only the
sum rule left) failed every test but the last; the tiny HF models' old split ([4, 2, 2] for 8 pairs)
put back in tiny_models._rope failed the last.
"""

import itertools
import json
import struct

import pytest

from deltaspec import Model
from deltaspec import convert as C
from deltaspec.errors import ConversionError, HyperParameterError
from deltaspec.gguf_file import read_gguf
from deltaspec.qwen35 import mrope_sections, read_hparams, rope_sections_problem
from deltaspec.testing.tiny_models import TINY_CONFIGS
from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

KEY = "qwen35.rope.dimension_sections"


def ggml_imrope_section(pair: int, sections: list[int]) -> str:
    """Which position ggml's IMROPE rotates `pair` by (ggml-cpu ops.cpp, rope_multi's cache, is_imrope,
    with sections summing to the pair count): t, h, w, or e, the 4th position llama.cpp sets to 0."""
    if pair % 3 == 1 and pair < 3 * sections[1]:
        return "h"
    if pair % 3 == 2 and pair < 3 * sections[2]:
        return "w"
    if pair % 3 == 0 and pair < 3 * sections[0]:
        return "t"
    return "e"


def test_rule_matches_ggml_for_every_split():
    """Every 4-way split of 1..13 pairs: accepted exactly when ggml gives no pair the 4th position, and
    the one accepted split is mrope_sections(n)."""
    n_checked = 0
    for n_pairs in range(1, 14):
        accepted = []
        for split in itertools.product(range(n_pairs + 1), repeat=4):
            if sum(split) != n_pairs:
                assert rope_sections_problem(list(split), 2 * n_pairs) is not None
                continue
            covered = all(ggml_imrope_section(i, list(split)) != "e" for i in range(n_pairs))
            assert (rope_sections_problem(list(split), 2 * n_pairs) is None) == covered, split
            accepted += [list(split)] if covered else []
            n_checked += 1
        assert accepted == [mrope_sections(n_pairs)]
    assert n_checked > 2000 and mrope_sections(32) == [11, 11, 10, 0]


def _set_sections(path, sections):
    """Overwrite the 4 values of the GGUF's dimension_sections array in place (same byte length)."""
    data = bytearray(path.read_bytes())
    at = data.index(KEY.encode()) + len(KEY)
    kind, elem, count = struct.unpack_from("<IIQ", data, at)
    assert (kind, count) == (9, 4)  # an array of 4
    fmt = {4: "<4I", 5: "<4i"}[elem]  # uint32 or int32 entries
    struct.pack_into(fmt, data, at + 16, *sections)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_vocab_model(tmp_path_factory.mktemp("sections") / "tiny.gguf")  # head_dim 64: 8 pairs


@pytest.mark.parametrize("sections, orphans", [
    ([4, 2, 2, 0], "[7]"),        # the sum is right, but pair 7 (7 % 3 == 1) is past section 1's 3 * 2
    ([3, 3, 1, 1], "[5]"),        # a 4th section: llama.cpp rotates pair 5 by position 0
    ([2, 2, 2, 2], "[6, 7]"),
])
def test_loader_refuses_pairs_without_section(tiny_path, tmp_path, sections, orphans):
    assert read_hparams(read_gguf(tiny_path)).rope_sections == [3, 3, 2, 0]  # the file as written loads
    path = tmp_path / "bad.gguf"
    path.write_bytes(tiny_path.read_bytes())
    _set_sections(path, sections)
    assert read_gguf(path).array(KEY) == sections
    with pytest.raises(HyperParameterError) as info:
        Model(path, n_ctx=64)
    message = str(info.value)
    assert str(path) in message and f"'{KEY}'" in message and f"pair(s) {orphans} of 8" in message, message
    assert "[3, 3, 2, 0]" in message  # what was expected


def _config(folder, mrope_section):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4, "head_dim": 64,
        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": mrope_section}}))
    return folder


def test_converter_refuses_pairs_without_section(tmp_path):
    folder = _config(tmp_path / "bad", [4, 2, 2])
    with pytest.raises(ConversionError) as info:
        C.convert_hf_to_gguf(folder, tmp_path / "o.gguf")
    message = str(info.value)
    assert str(folder / "config.json") in message and "rope_parameters.mrope_section" in message, message
    assert "pair(s) [7] of 8" in message and not list(tmp_path.glob("*.gguf*"))
    assert C._load_hparams(_config(tmp_path / "good", [3, 3, 2]))["rope_parameters"]["mrope_section"] == [3, 3, 2]


def test_tiny_model_makers_cover_every_pair():
    assert len(TINY_CONFIGS) >= 3
    for name, cfg in TINY_CONFIGS.items():
        rope = cfg["rope_parameters"]
        n_rot = int(cfg["head_dim"] * rope["partial_rotary_factor"])
        assert rope_sections_problem(rope["mrope_section"] + [0], n_rot) is None, name
