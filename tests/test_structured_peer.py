"""Grammar-constrained greedy decoding against llama.cpp's own grammar engine (CPU).

The same GBNF grammar goes to llama.cpp (llama-completion --grammar, built from the pinned tree;
its GBNF sampler, not llguidance) and to deltaspec (llguidance): on the same GGUF with the real
248k vocabulary, the greedy constrained continuations must be the same token ids, end token
included. Two engines that agree on which tokens the grammar allows at every step, UTF-8 classes
split across byte tokens and the end of the grammar included, and a loop that masks and commits
at the right positions, give this; a mask one token late or an end token allowed too early or too
late does not. Seen red with masks that never allow an end-of-generation token (planted below).

One deliberate difference keeps some grammars out: where the grammar forces a multi-byte literal
(`"name"` after `"`), llguidance allows only its canonical tokenization ("name", not "nam" + "e"),
as the model would have written it, while llama.cpp allows any split. The grammars here force no
multi-byte literal.
"""

import sys
from pathlib import Path

import pytest

from deltaspec import Grammar, Model
from deltaspec.constraint import GrammarConstraint
from deltaspec.convert import convert_hf_to_gguf
from deltaspec.testing.tiny_models import tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.peers.llama_cpp import build_llama_cpp, greedy_run  # noqa: E402

pytestmark = pytest.mark.peer
N_PREDICT = 64
CASES = [
    ('root ::= "{" pair ("," pair){0,2} "}"\npair ::= key ":" val\nkey ::= "\\"" [a-z]{1,6} "\\""\n'
     'val ::= [0-9]{1,3} | [tf]', "The quick brown fox"),
    ('root ::= item ("," item){0,5}\nitem ::= [a-z]{1,8} | [0-9]{1,3}', "def add(a, b):"),
    ('root ::= ("yes" | "no" | "maybe") "."', "The quick brown fox"),
    ('root ::= [α-ω]{1,6} " " [а-я]{1,6}', "def add(a, b):"),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    bin_dir = build_llama_cpp(quiet=True)
    path = tmp_path_factory.mktemp("grammar-peer") / "attn2_d32_untied-f32.gguf"
    convert_hf_to_gguf(tiny_model_dir("attn2_d32_untied"), path, outtype="f32")
    with Model(path, n_ctx=512, progress=False) as model:
        peer = {}
        for grammar, prompt in CASES:
            peer[grammar] = greedy_run(path, model.tokenize(prompt), N_PREDICT, bin_dir=bin_dir,
                                       extra_args=["--grammar", grammar])
        yield model, peer


def _compare(setup) -> list[str]:
    model, peer_runs = setup
    failures = []
    for grammar, prompt in CASES:
        ids = model.tokenize(prompt)
        peer = peer_runs[grammar]
        assert peer.prompt_ids == ids
        ours = model.generate(ids, max_tokens=N_PREDICT, temperature=0.0, grammar=grammar)
        if ours.tokens != peer.ids:
            failures.append(f"{grammar!r}: ours {ours.text!r} {ours.tokens[-1:]}, llama.cpp {peer.text!r} "
                            f"{peer.ids[-1:]}")
        elif not model.tokenizer.is_eog(ours.tokens[-1]):
            failures.append(f"{grammar!r}: did not end within {N_PREDICT} tokens: {ours.text!r}")
    return failures


def test_greedy_constrained_matches_llama_cpp(setup):
    assert _compare(setup) == []


def test_planted_end_token_bug_is_seen(setup, monkeypatch):
    """Masks that never allow an end-of-generation token: the comparison above fails."""
    fill = GrammarConstraint.fill_masks
    eog = sorted(setup[0].tokenizer.eog_ids)

    def no_end(self, masks, drafts):
        fill(self, masks, drafts)
        for t in eog:
            masks[:, t // 32] &= ~(1 << (t % 32)) & 0xFFFFFFFF

    monkeypatch.setattr(GrammarConstraint, "fill_masks", no_end)
    try:
        failures = _compare(setup)
    except RuntimeError as e:  # a grammar that must end and may not: no token is allowed
        failures = [str(e)]
    assert failures
