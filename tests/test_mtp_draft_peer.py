"""llama.cpp's end-to-end MTP speculation (`--spec-type draft-mtp`, driven by the pinned tree's
llama-speculative-simple) as bench/mtp_bench.py runs it (bench/peers/llama_speculative.py), held
against deltaspec's spec_type "mtp" on tiny-vocabulary models with an MTP layer: the harness runs
llama.cpp's MTP drafter (not plain decoding, not another drafter) and reads its counts right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from deltaspec import Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.peers.llama_cpp import build_llama_cpp  # noqa: E402
from bench.peers.llama_speculative import build_speculative_simple, run_draft_mtp  # noqa: E402

PROMPTS = ("Hello world", "def f(x):\n    return", "abc abc abc")
N_PREDICT = 48


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    return build_speculative_simple(build_llama_cpp(quiet=True), tmp_path_factory.mktemp("peer") / "spec-simple")


def _pair(tool, path, prompt, n_draft):
    peer = run_draft_mtp(tool, path, prompt, N_PREDICT, n_draft, threads=1, n_ctx=512)
    with Model(path, n_ctx=512, n_threads=1) as m:
        ours = m.generate(m.tokenize(prompt), max_tokens=peer.n_predict, temperature=0, spec_type="mtp",
                          draft_n_max=n_draft, draft_n_min=n_draft)
    return peer, ours


@pytest.mark.peer
def test_draft_mtp_peer_accepts_every_oracle_draft(tool):
    """On a target whose next token depends on the current one only and an MTP head that computes
    exactly that (tiny_vocab branch_scale 0: test_mtp.py's oracle), llama.cpp's draft-mtp drafts
    every round and the target accepts every draft, as deltaspec's does: the harness drives
    llama.cpp's MTP head and parses its counts. Seen to fail: the harness asking for
    `--spec-type ngram-simple` instead drafted 0 tokens here."""
    path = tiny_vocab_model_path(branch_scale=0.0, mtp=True)
    for prompt in PROMPTS[:2]:
        peer, ours = _pair(tool, path, prompt, 3)
        assert peer.n_drafted > 30 and peer.n_accept == peer.n_drafted, peer.text[-2000:]
        assert ours.stats.n_drafted > 30 and ours.stats.n_accepted == ours.stats.n_drafted
        assert peer.decode_s > 0


@pytest.mark.peer
def test_draft_mtp_peer_accepts_what_deltaspec_accepts(tool):
    """A random MTP head on a random target (drafts mostly rejected): llama.cpp's draft-mtp and
    deltaspec's mtp chain draft the same tokens from the same head, so the greedy target accepts
    the same drafts (counts within one: the two loops cut the last round at the token limit
    differently), and both stop after the same number of tokens (one prompt ends at an
    end-of-generation token). Seen to fail: a harness reading n_accept from the "n_drafted" line
    reported 22 accepted where deltaspec accepted 0."""
    path = tiny_vocab_model_path(mtp=True, mtp_hidden_scale=1.0)
    accepted = 0
    for prompt in PROMPTS:
        for n_draft in (1, 3):
            peer, ours = _pair(tool, path, prompt, n_draft)
            print(repr(prompt), n_draft, "llama", peer.n_predict, peer.n_drafted, peer.n_accept,
                  "deltaspec", len(ours.tokens), ours.finish_reason, ours.stats.n_drafted, ours.stats.n_accepted)
            assert peer.n_predict == len(ours.tokens)
            assert peer.n_drafted >= n_draft * (peer.n_predict - peer.n_accept) // 2
            assert abs(peer.n_accept - ours.stats.n_accepted) <= 1
            assert peer.n_accept < peer.n_drafted / 4
            accepted += peer.n_accept
    assert accepted > 0  # some drafts do get accepted, so equal counts say something
