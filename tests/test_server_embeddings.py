"""/v1/embeddings, driven with the official `openai` client against a server started here on loopback
(as tests/test_server.py does), on the tiny-vocabulary model.

The claims: each input's embedding is Model.embed(normalize=True)'s with the server's --pooling
("last" by default, "mean"), for a string, token ids and an array of them, in order, with the usage
counting their tokens; "base64" gives the same numbers as little-endian float32; the hidden states
are read in a slot beside running requests (a streamed completion runs meanwhile, and its text is
still generate()'s) and with a drafter (-md); bad inputs are 400s naming the field.

Seen red with the server's planted bug embedding_first_row (the first token's state pooled).
"""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest

openai = pytest.importorskip("openai")  # CI installs it with the test extra: never skipped there

from deltaspec import Model
from test_server import ServerProcess, files, post  # noqa: F401 (fixture)

N_CTX = 256
TEXTS = ["hello world", "abc abc abc abc abc", "x"]


@pytest.fixture(scope="module")
def reference(files):
    with Model(files[0], n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module", params=["last", "mean", "last+draft"])
def server(request, files):
    pooling = request.param.split("+")[0]
    extra = ("-md", str(files[0]), "-np", "1") if request.param.endswith("draft") else ("-np", "2")
    s = ServerProcess(files[0], *extra, "-c", str(N_CTX), "--pooling", pooling)
    s.pooling = pooling
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_embeddings_equal_model_embed(server, reference):
    client = server.client()
    want = reference.embed(TEXTS, normalize=True, pooling=server.pooling)
    got = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, w in zip(got.data, want):
        assert np.abs(np.array(d.embedding) - np.array(w)).max() <= 1e-6
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-6
    assert got.usage.prompt_tokens == sum(len(reference.tokenize(t, special=True)) for t in TEXTS)
    assert np.abs(np.array(want[0]) - np.array(want[1])).max() > 1e-3, "the inputs must differ"
    one = client.embeddings.create(model="tiny", input=reference.tokenize(TEXTS[1], special=True))
    assert np.abs(np.array(one.data[0].embedding) - np.array(want[1])).max() <= 1e-6
    status, b64 = post(f"{server.url}/v1/embeddings",
                       json.dumps({"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}).encode())
    assert status == 200
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - np.array(want[0], dtype=np.float32)).max() == 0


def test_embeddings_beside_a_running_completion(server, reference):
    """A streamed completion runs while embeddings are read: both answers are what they are alone."""
    client = server.client()
    reference.reset()
    want_text = reference.generate("abc abc", temperature=0, max_tokens=60).text
    want = reference.embed(TEXTS[:2], normalize=True, pooling=server.pooling)
    texts, errors = [], []

    def complete():
        try:
            stream = client.completions.create(model="tiny", prompt="abc abc", max_tokens=60, temperature=0, stream=True)
            texts.append("".join(c.choices[0].text for c in stream))
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=complete)
    t.start()
    for _ in range(3):
        got = client.embeddings.create(model="tiny", input=TEXTS[:2])
        for d, w in zip(got.data, want):
            assert np.abs(np.array(d.embedding) - np.array(w)).max() <= 1e-6
    t.join(60)
    assert not errors and texts == [want_text]


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": ""}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, 10**9]}, "input"),
    ({"input": ["a", []]}, "input"),
    ({"input": "a " * 300}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 8}, "dimensions"),
])
def test_bad_inputs_are_400s(server, body, param):
    status, answer = post(f"{server.url}/v1/embeddings", json.dumps({"model": "tiny", **body}).encode())
    assert status == 400 and answer["error"]["param"] == param, answer
