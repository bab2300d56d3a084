"""Broken model files and bad arguments raise the right deltaspec exception, never crash.

Each case edits a copy of a valid GGUF (written by our converter) in place at offsets the parser
reports, so exactly one thing is wrong per case.
"""

import shutil
import struct

import numpy as np
import pytest

from deltaspec import Model, _core
from deltaspec import errors as E
from deltaspec.convert import convert_hf_to_gguf
from deltaspec.gguf_file import read_gguf
from deltaspec.testing.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "base.gguf"
    convert_hf_to_gguf(tiny_model_dir("gdn_hk2_hv4_tied"), path, outtype="q8_0")
    return path


def _patch(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(at):
    def edit(path):
        cut = at(path.stat().st_size, read_gguf(path).data_offset)
        with open(path, "r+b") as f:
            f.truncate(cut)
    return edit


def _set_value(key, fmt, value):
    def edit(path):
        _patch(path, read_gguf(path).value_offsets[key], struct.pack(fmt, value))
    return edit


def _set_string(key, value: bytes):
    def edit(path):
        g = read_gguf(path)
        assert len(g.metadata[key]) == len(value), "in-place edits keep the length"
        _patch(path, g.value_offsets[key] + 8, value)  # after the u64 length
    return edit


def _rename_key(key, new):
    def edit(path):
        # the key string (u64 length + bytes) sits just before its u32 value type
        _patch(path, read_gguf(path).value_offsets[key] - 4 - len(key), new.encode())
    return edit


def _tensor_field(name, field, value):
    """Overwrite one field of a tensor-table entry: name, dims, type or offset."""
    def edit(path):
        info = read_gguf(path).tensors[name]
        at = info.info_offset + 8  # past the name's u64 length
        if field == "name":
            _patch(path, at, value.encode())
            return
        at += len(name) + 4  # past the name and n_dims
        if field == "dims":
            _patch(path, at, struct.pack(f"<{len(value)}Q", *value))
            return
        at += 8 * len(info.shape)
        if field == "type":
            _patch(path, at, struct.pack("<I", value))
        else:  # offset, relative to the data section
            _patch(path, at + 4, struct.pack("<Q", value))
    return edit


def _write(data: bytes):
    def edit(path):
        path.write_bytes(data)
    return edit


# (case id, edit, exception class, text the message must contain)
CASES = [
    ("empty file", _write(b""), E.TruncatedFileError, "too short"),
    ("text file", _write(b"hello, this is not a model\n" * 4), E.NotAGGUFError, "not a GGUF"),
    ("ggml magic", _write(b"lmgg" + bytes(64)), E.NotAGGUFError, "magic"),
    ("gguf v1", _write(b"GGUF" + (1).to_bytes(4, "little") + bytes(64)), E.NotAGGUFError, "version 1"),
    ("cut in header", _truncate(lambda size, data: 12), E.TruncatedFileError, "too short"),
    ("cut in metadata", _truncate(lambda size, data: 1000), E.TruncatedFileError, "ends inside its metadata"),
    ("cut in vocab", _truncate(lambda size, data: data // 3), E.TruncatedFileError, "tokenizer.ggml"),
    ("cut in tensor table", _truncate(lambda size, data: data - 200), E.TruncatedFileError, "tensor table"),
    ("cut in first tensor", _truncate(lambda size, data: data + 100), E.TruncatedFileError, "needs bytes"),
    ("cut in last tensor", _truncate(lambda size, data: size - 1), E.TruncatedFileError, "needs bytes"),
    ("wrong arch", _set_string("general.architecture", b"gemma3"), E.UnsupportedArchitectureError, "'gemma3'"),
    ("missing key", _rename_key("qwen35.ssm.state_size", "qwen35.ssm.state_sizX"), E.MissingMetadataError,
     "qwen35.ssm.state_size"),
    ("zero embedding", _set_value("qwen35.embedding_length", "<I", 0), E.HyperParameterError, "embedding_length"),
    ("absurd layers", _set_value("qwen35.block_count", "<I", 10**9), E.HyperParameterError, "block_count"),
    ("absurd heads", _set_value("qwen35.ssm.time_step_rank", "<I", 3), E.HyperParameterError, "time_step_rank"),
    ("kv heads", _set_value("qwen35.attention.head_count_kv", "<I", 3), E.HyperParameterError, "head_count_kv"),
    ("bad eps", _set_value("qwen35.attention.layer_norm_rms_epsilon", "<f", -1.0), E.HyperParameterError, "epsilon"),
    ("embedding vs tensors", _set_value("qwen35.embedding_length", "<I", 96), E.TensorShapeError, "token_embd.weight"),
    ("missing tensor", _tensor_field("blk.1.ssm_a", "name", "blk.1.ssm_b"), E.MissingTensorError, "blk.1.ssm_a"),
    # F16 is half F32's size: the next tensor's offset no longer follows, which ggml's loader refuses
    ("flipped type f32->f16", _tensor_field("blk.2.ssm_norm.weight", "type", 1), E.CorruptFileError,
     "'blk.2.ssm_norm.weight' before it (shape [32], F16)"),
    ("unknown type id", _tensor_field("blk.0.ffn_up.weight", "type", 200), E.CorruptFileError, "blk.0.ffn_up.weight"),
    ("offset past end", _tensor_field("output_norm.weight", "offset", 1 << 40), E.CorruptFileError,
     "'output_norm.weight' has data offset 1099511627776"),
    ("shape flipped", _tensor_field("blk.0.attn_gate.weight", "dims", [128, 64]), E.TensorShapeError,
     "blk.0.attn_gate.weight"),
]


@pytest.mark.parametrize("edit,exc,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corrupt_file_raises(base, tmp_path, edit, exc, text):
    path = tmp_path / "broken.gguf"
    shutil.copyfile(base, path)
    edit(path)
    with pytest.raises(exc) as info:
        Model(path, n_ctx=64)
    message = str(info.value)
    assert str(path) in message
    assert text in message
    assert isinstance(info.value, E.DeltaspecError)


def test_missing_file(tmp_path):
    with pytest.raises(E.ModelFileNotFoundError, match="no such file"):
        Model(tmp_path / "nope.gguf")
    with pytest.raises(E.ModelFileNotFoundError, match="not a regular file"):
        Model(tmp_path)


def test_base_file_loads(base):
    with Model(base, n_ctx=64) as model:
        assert model.eval(model.tokenize("hello")).shape == (1, model.n_vocab)


@pytest.mark.parametrize("kwargs,match", [
    ({"n_ctx": 0}, "n_ctx"), ({"n_ctx": "big"}, "n_ctx"), ({"n_threads": 0}, "n_threads"),
    ({"n_ubatch": -1}, "n_ubatch"), ({"device": "tpu"}, "device"), ({"type_k": "q3_x"}, "q3_x"),
])
def test_bad_model_arguments(base, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Model(base, **kwargs)


def test_bad_eval_arguments(base):
    with Model(base, n_ctx=300) as model:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.eval([1, model.n_vocab])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            model.eval([-1])
        with pytest.raises(ValueError, match="non-empty"):
            model.eval([])
        with pytest.raises(TypeError, match="integers"):
            model.eval([1.5])
        with pytest.raises(ValueError, match="logits"):
            model.eval([1], logits="some")
        with pytest.raises(ValueError, match="exceed n_ctx"):
            model.eval([1] * 513)  # n_ctx is rounded up to 512
        assert model.n_past == 0   # nothing was evaluated by the failed calls
        model.eval([1, 2, 3])
        assert model.n_past == 3
    with pytest.raises(RuntimeError, match="closed"):
        model.eval([1])


def test_fused_attention_qkv_is_named(tmp_path, monkeypatch):
    """A file whose attention layers carry llama.cpp's --fuse-qkv tensor instead of attn_q/k/v."""
    from deltaspec.testing import tiny_vocab

    def fused(*args):
        w = original(*args)
        qkv = [w.pop(f"blk.3.attn_{x}.weight") for x in "qkv"]
        w["blk.3.attn_qkv.weight"] = np.concatenate(qkv)  # rows: [q+gate | k | v]
        return w

    original = tiny_vocab._weights
    monkeypatch.setattr(tiny_vocab, "_weights", fused)
    path = tiny_vocab.write_tiny_vocab_model(tmp_path / "fused.gguf")
    with pytest.raises(E.MissingTensorError) as info:
        Model(path, n_ctx=64)
    message = str(info.value)
    assert str(path) in message and "'blk.3.attn_q.weight' is missing" in message
    assert "'blk.3.attn_qkv.weight'" in message and "--fuse-qkv" in message


def test_engine_failure_is_an_engine_error(base):
    if _core.has_device("cuda"):
        pytest.skip("this build runs on CUDA here")
    with pytest.raises(E.EngineError, match=r"device 'cuda' is not available") as info:
        Model(base, n_ctx=64, device="cuda")
    assert str(base) in str(info.value)
    assert isinstance(info.value, RuntimeError)  # what the engine raised before it had a class of its own


def test_vocabulary_mismatch_names_the_tokenizer(tmp_path, monkeypatch):
    from deltaspec.testing import tiny_vocab

    def one_row_more(sh, n_vocab, rng):
        return original(sh, n_vocab + 1, rng)

    original = tiny_vocab._weights
    monkeypatch.setattr(tiny_vocab, "_weights", one_row_more)
    path = tiny_vocab.write_tiny_vocab_model(tmp_path / "vocab.gguf")
    with pytest.raises(E.TensorShapeError, match=r"'token_embd.weight' has shape \[64, 266\], expected \[64, 265\] "
                                                 r"\(one row per token: tokenizer.ggml.tokens has 265\)"):
        Model(path, n_ctx=64)


def test_bad_ggml_log_level_is_named():
    """DELTASPEC_GGML_LOG (which of ggml's log messages reach stderr) is read when the native module
    loads: a value it does not know stops the import with a message naming the variable and the
    values it takes, and each known value loads."""
    import os
    import subprocess
    import sys

    def import_with(level):
        env = dict(os.environ, DELTASPEC_GGML_LOG=level)
        return subprocess.run([sys.executable, "-c", "import deltaspec._core"], env=env, capture_output=True,
                              text=True, timeout=120)

    bad = import_with("loud")
    assert bad.returncode != 0
    assert "DELTASPEC_GGML_LOG must be debug, info, warn, error or none, not 'loud'" in bad.stderr
    for level in ("debug", "info", "warn", "error", "none"):
        assert import_with(level).returncode == 0, level
