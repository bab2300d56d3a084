"""End to end against llama.cpp built from the same source distribution (CPU).

Same GGUF (written by our converter), same prompt ids, greedy decoding: the 64 generated tokens
must be identical. Building llama.cpp costs about 4-11 minutes on a 2-core machine (once; the
build is reused), so these tests carry the `peer` marker; CI runs them on every submission.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from deltaspec import Model
from deltaspec.convert import convert_hf_to_gguf
from deltaspec.testing.tiny_models import tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.peers.llama_cpp import build_llama_cpp, greedy_run  # noqa: E402

pytestmark = pytest.mark.peer
N_PREDICT = 64
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "你好，世界！今天"]


@pytest.fixture(scope="module")
def llama_bin():
    return build_llama_cpp(quiet=True)


def deltaspec_greedy(model: Model, prompt_ids: list[int], n_predict: int) -> list[int]:
    model.reset()
    logits = model.eval(prompt_ids)
    out: list[int] = []
    while len(out) < n_predict:
        token = int(np.argmax(logits[0]))  # ties go to the lowest id, as in llama.cpp's greedy
        out.append(token)
        if model.tokenizer.is_eog(token):
            break
        logits = model.eval([token])
    return out


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("config", ["attn2_d32_untied", "gdn_hk2_hv4_tied"])
def test_greedy_continuation_matches_llama_cpp(llama_bin, tmp_path, config, outtype):
    gguf_path = tmp_path / f"{config}-{outtype}.gguf"
    convert_hf_to_gguf(tiny_model_dir(config), gguf_path, outtype=outtype)
    with Model(gguf_path, n_ctx=512) as model:
        for prompt in PROMPTS:
            ids = model.tokenize(prompt)
            peer = greedy_run(gguf_path, ids, N_PREDICT, bin_dir=llama_bin)
            assert peer.prompt_ids == ids
            ours = deltaspec_greedy(model, ids, N_PREDICT)
            assert len(ours) == N_PREDICT or model.tokenizer.is_eog(ours[-1])
            assert ours == peer.ids, f"{prompt!r}: first difference at {_first_diff(ours, peer.ids)}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
