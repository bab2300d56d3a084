"""Structured output on CUDA: the constraint masks rows the CUDA engine computed (one-token steps,
verify batches, the scheduler's batched decode), and every output validates.

Run on the GPU machine with: python -m pytest -q -s -m gpu tests/test_gpu_structured.py

The CPU file (test_structured.py) holds the claims and their planted bugs; this one checks that they
hold where logits come from ggml-cuda. Greedy speculative output is compared with plain greedy and
the differences are printed, not asserted: a verify batch runs other CUDA kernels than a one-token
step (test_gpu_speculative.py), so a near-tie may part them; validity may never fail.
"""

import json

import jsonschema
import pytest

from deltaspec import Grammar, Model
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path, write_tiny_vocab_model
from test_gpu import _cuda_available
from test_structured import MAX_TOKENS, PROMPTS, SAMPLED, SCHEMAS, SEEDS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA device in this build "
                                                  "of deltaspec (CPU-only build or no GPU)")]


def test_outputs_validate_on_cuda(tmp_path):
    write_tiny_vocab_model(tmp_path / "random.gguf", seed=1)
    kw = dict(n_ctx=512, device="cuda", progress=False)
    with Model(tiny_vocab_model_path(), n_seq_max=4, **kw) as target, Model(tiny_vocab_model_path(), **kw) as self_draft, \
            Model(tmp_path / "random.gguf", **kw) as random_draft:
        drafters = {"none": {}, "ngram": dict(spec_type="ngram-simple", draft_n_max=8),
                    "self": dict(draft_model=self_draft, draft_n_max=8),
                    "random": dict(draft_model=random_draft, draft_n_max=8)}
        runs = differ = cut = 0
        for name, schema in SCHEMAS.items():
            grammar = Grammar.from_json_schema(schema)
            for prompt in PROMPTS:
                plain = None
                for drafter, spec in drafters.items():
                    for sampling in [dict(temperature=0.0)] + [dict(SAMPLED, seed=s) for s in SEEDS]:
                        r = target.generate(prompt, max_tokens=MAX_TOKENS, grammar=grammar, **sampling, **spec)
                        assert r.finish_reason == "stop", (name, drafter, r.text)
                        jsonschema.validate(json.loads(r.text), schema)
                        runs += 1
                        cut += r.stats.grammar_cut_tokens
                        if sampling["temperature"] == 0.0:
                            plain = plain or r.tokens
                            differ += r.tokens != plain
            batch = target.generate_batch(PROMPTS, max_tokens=MAX_TOKENS, grammar=grammar, temperature=0.0)
            for r in batch:
                jsonschema.validate(json.loads(r.text), schema)
        print(f"CUDA: {runs} constrained runs valid; draft tokens cut {cut}; greedy speculative runs that part "
              f"from plain greedy (near-ties): {differ}")
        assert cut > 0


@pytest.mark.parametrize("tree_budget", [0, 6], ids=["chains", "trees"])
def test_mtp_and_dflash_draft_within_the_grammar_on_cuda(tmp_path, tree_budget):
    """The MTP head and a DFlash drafter draft within the grammar where their rows come from
    ggml-cuda (the head's whole logit row instead of its device argmax; DFlash's top K per slot):
    every output validates, drafter rows were masked and nothing was cut (tests/test_structured_mtp.py
    and test_structured_dflash.py hold the claims and their planted bugs), alone and in a batch."""
    pytest.importorskip("torch")
    pytest.importorskip("dflash")
    from deltaspec import Drafter
    from deltaspec.testing.tiny_dflash import write_sharp_tiny_dflash

    kw = dict(n_ctx=768, device="cuda", n_seq_max=3, progress=False)
    schema = SCHEMAS["lists"]
    grammar = Grammar.from_json_schema(schema)
    spec = dict(draft_n_max=4, draft_n_min=1, tree_budget=tree_budget)
    with Model(tiny_vocab_model_path(mtp=True, mtp_hidden_scale=0.5), **kw) as mtp_target, \
            Model(tiny_vocab_model_path(), **kw) as target:
        drafter = Drafter(write_sharp_tiny_dflash(target, tmp_path / "d.gguf"), target=target)
        for name, model, extra in (("mtp", mtp_target, dict(spec_type="mtp")),
                                   ("dflash", target, dict(spec_type="dflash", draft_model=drafter))):
            for sampling in (dict(temperature=0.0), dict(SAMPLED, seed=1)):
                runs = [model.generate(p, max_tokens=MAX_TOKENS, grammar=grammar, **spec, **extra, **sampling)
                        for p in PROMPTS]
                runs += model.generate_batch(PROMPTS, max_tokens=MAX_TOKENS, grammar=grammar, **spec, **extra,
                                             **sampling)
                for r in runs:
                    assert r.finish_reason == "stop", (name, r.text)
                    jsonschema.validate(json.loads(r.text), schema)
                rows, cut, drafted, forced = (sum(getattr(r.stats, k) for r in runs) for k in
                                              ("grammar_draft_rows", "grammar_cut_tokens", "n_drafted",
                                               "grammar_forced_tokens"))
                print(f"CUDA {name} {sampling['temperature']}: drafted {drafted}, forced {forced}, "
                      f"drafter rows masked {rows}, cut {cut}")
                assert rows > 0 and cut == 0 and drafted > forced
