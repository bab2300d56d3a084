"""Device indices and `serve --replicas` on CUDA: "cuda:N" is the N-th GPU (an index past the last
is refused with the GPU count), and two replicas, one engine loop each, serve on the GPUs of this
machine (on a one-GPU machine both on cuda:0: two engines stepped from two threads on one device).

Run on the GPU machine with: python -m pytest -q -m gpu tests/test_gpu_replicas.py
The CPU tests of the same claims (tests/test_server_replicas.py) were seen to fail with the bugs
their docstrings name; these check that the device side holds them too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from deltaspec import Model, _core
from deltaspec.errors import EngineError
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _core.has_device("cuda"), reason="no CUDA device in this "
                                                   "build of deltaspec (CPU-only build or no GPU)")]
N_GEN = 16


def n_gpus() -> int:
    n = 0
    while _core.has_device(f"cuda:{n}"):
        n += 1
    return n


def test_cuda_index_is_that_gpu_and_past_the_last_is_refused():
    path = tiny_vocab_model_path()
    n = n_gpus()
    prompt = list(range(40, 60))
    tokens = {}
    for device in ["cuda", *(f"cuda:{i}" for i in range(n))]:
        with Model(path, n_ctx=256, device=device, progress=False) as m:
            assert m._engine.backend == ("CUDA0" if device == "cuda" else f"CUDA{device[5:]}"), device
            tokens[device] = m.generate(prompt, max_tokens=N_GEN, temperature=0).tokens
    assert all(t == tokens["cuda"] for t in tokens.values()), tokens  # same kernels, same GPU model
    with pytest.raises(EngineError, match=rf"device 'cuda:{n}': GPU index {n} is out of range: this machine and "
                                          rf"build have {n} GPU device\(s\)"):
        Model(path, n_ctx=256, device=f"cuda:{n}", progress=False)


class Server:
    """`python -m deltaspec.server` on a free port (raw HTTP here: the GPU machine may lack `openai`)."""

    def __init__(self, *flags: str):
        pytest.importorskip("uvicorn")
        self.proc = subprocess.Popen([sys.executable, "-m", "deltaspec.server", "--port", "0", "--log-level",
                                      "warning", *flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        self.url = None
        while self.url is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited ({self.proc.wait()}):\n{''.join(self.log)}")
            self.log.append(line)
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].strip()
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()

    def complete(self, prompt: list[int]) -> dict:
        body = json.dumps({"model": "x", "prompt": prompt, "max_tokens": N_GEN, "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def test_two_replicas_serve_on_the_gpus():
    """--replicas over two GPUs (or twice cuda:0 on one): requests one at a time alternate between
    the replicas and each answer is generate()'s on that device (one running request: the
    one-sequence kernels); a conversation's next turn resumes on the replica that kept it; 8 at
    once all complete, and both replicas served."""
    path = tiny_vocab_model_path()
    devices = ["cuda:0", "cuda:1"] if n_gpus() >= 2 else ["cuda:0", "cuda:0"]
    s = Server("-m", str(path), "--replicas", ",".join(devices), "-np", "2", "-c", "512", "-a", "x")
    try:
        with Model(path, n_ctx=512, device="cuda:0", progress=False) as ref:
            prompts = [ref.tokenize(f"request {k} about the sea") for k in range(4)]
            for p in prompts:
                ref.reset()
                want = ref.generate(p, max_tokens=N_GEN, temperature=0).text
                assert s.complete(p)["choices"][0]["text"] == want
            first = ref.tokenize("a conversation on two devices")
            ref.reset()
            turn1 = ref.generate(first, max_tokens=N_GEN, temperature=0)
            assert s.complete(first)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            if turn1.finish_reason == "length":  # an end token would not be in the kept history's reply
                second = first + turn1.tokens + ref.tokenize(" and again")
                got = s.complete(second)
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) + N_GEN - 1
        answers: list[dict] = []
        threads = [threading.Thread(target=lambda k=k: answers.append(s.complete(prompts[k % 4] + [k])))
                   for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answers) == 8 and all(a["usage"]["completion_tokens"] >= 1 for a in answers)
        m = s.metrics()
        served = [sum(m[f'deltaspec_replica_requests_finished_total{{replica="{i}",device="{d}",reason="{r}"}}']
                      for r in ("stop", "length")) for i, d in enumerate(devices)]
        assert sum(served) == 4 + 1 + (turn1.finish_reason == "length") + 8 and min(served) > 0, served
    finally:
        assert s.stop() == 0, "".join(s.log)
