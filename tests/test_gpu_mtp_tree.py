"""MTP draft trees on CUDA (runs only where a CUDA build and a GPU exist): the MTP head's trees
(tests/test_mtp_tree.py on the CPU) verified by the rows ops' kernels, the head catching up from
the accepted path's taps on the device.

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_mtp_tree.py

On CUDA a tree's rows and a plain step's row are computed by different kernels (TF32 products), so
greedy tree speculation may part from plain greedy only at near-ties (test_gpu.py). A copy of this
file run with device="cpu" (no GPU where it was written) passed, and failed (0 branched verifies)
with greedy trees ranked by the one-hot greedy distribution, which leaves nothing to branch to.
"""

import numpy as np
import pytest

from deltaspec import Model
from test_gpu import _cuda_available, assert_parts_only_at_near_tie

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                   "of deltaspec (CPU-only build or no GPU)")]


def test_cuda_mtp_tree_speculation_greedy(tmp_path):
    """Greedy MTP trees (6 nodes, 3 deep) give plain greedy's tokens on CUDA except at near-ties;
    trees branched and more drafts were accepted than the chains of the same depth accept."""
    from deltaspec.testing.tiny_vocab import write_tiny_vocab_model

    path = write_tiny_vocab_model(tmp_path / "mtp.gguf", seed=0, mtp=True, mtp_hidden_scale=1.0)
    with Model(path, device="cuda", n_ctx=512) as m:
        before = m._live().rows_stats["branched_calls"]
        rng = np.random.default_rng(11)
        tree_acc = chain_acc = 0
        for k in range(6):
            prompt = rng.integers(0, 256, size=int(rng.integers(2, 20))).tolist()
            plain = m.generate(prompt, max_tokens=32, temperature=0).tokens
            tree = m.generate(prompt, max_tokens=32, temperature=0, spec_type="mtp", draft_n_max=3, draft_n_min=1,
                              tree_budget=6)
            chain = m.generate(prompt, max_tokens=32, temperature=0, spec_type="mtp", draft_n_max=3, draft_n_min=1)
            assert_parts_only_at_near_tie(m, prompt, plain, tree.tokens, f"prompt {k}: plain and MTP trees")
            tree_acc += tree.stats.n_accepted
            chain_acc += chain.stats.n_accepted
        print("tree accepted", tree_acc, "chain accepted", chain_acc)
        assert m._live().rows_stats["branched_calls"] - before > 20
        assert tree_acc > chain_acc
