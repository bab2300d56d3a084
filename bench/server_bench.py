"""Serving throughput and time to first token: `deltaspec serve` vs `llama-server`, same file, same run.

    python bench/server_bench.py MODEL.gguf --llama-server BIN/llama-server [--device cuda]
                                 [--streams 1,4,16,32] [--prompt 128] [--gen 128] [--reps 3]
                                 [--out bench/results/latest/server_bench.json]

Both servers are started once, side by side (the H200 holds two copies of a 27B Q4_K_M), each with
as many slots as the largest stream count: deltaspec `-np MAX -c PROMPT+GEN+64` (context per slot),
llama-server `-np MAX -c MAX*(PROMPT+GEN+64) -ngl 99 -fa on --no-cache-prompt` (its -c is divided
among its slots). A run sends N streamed greedy /v1/completions at once (threads released by one
barrier), each with a fresh random prompt of PROMPT token ids (no prompt cache can help; every
server of a run gets the same N prompts) and max_tokens GEN, and records per stream: time to the
first text chunk (TTFT), tokens (usage, or chunks with text), and the end. Reported per run: aggregate tok/s = all streams' tokens / (last end
- first send), TTFT median and p90, and per-stream decode tok/s = (tokens - 1) / (end - first text).
Every N is warmed once per server first; then repetitions interleave (rep, N, then both servers in
an order that alternates), and the summary gives median, min and max over repetitions.

Weights of a synthetic GGUF are random: the speed is that of the shapes and quant mix (say so with
every number). llama-server gets `ignore_eos`; deltaspec has no such option, so a stream of ours
that samples an end token stops early and its token count says so (on a 248k vocabulary, rare).
--variant NAME=ARGS (repeatable) adds another deltaspec server with these extra flags (split at
spaces), named deltaspec-NAME, timed in the same interleaved repetitions (an A/B in one run, e.g.
`--variant nobudget=--prefill-budget=0`). --spec ARGS adds a server, deltaspec with a drafter
(`--spec '-md DRAFT.gguf'` or `--spec '--spec-type ngram-simple'`), at 1 stream only: speculation is served one request at a time
(--parallel 1) until the engine batches it, and with random weights a drafter accepts next to
nothing (that row is the cost of speculating, not its gain).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest" / "server_bench.json"
CTX_MARGIN = 64
START_TIMEOUT = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 whose log goes to a file; `ready` waits for /health."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path):
        self.name, self.cmd, self.port = name, cmd, port
        self.log_path = log_dir / f"server_bench_{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {' '.join(self.cmd)}\n"
                                   + self.log_path.read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def one_stream(port: int, model: str, prompt: list[int], n_gen: int, barrier: threading.Barrier, out: dict) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n_gen, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_prompt": False})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    barrier.wait()
    t_send = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"port {port}: HTTP {resp.status}: {resp.read()[:500]!r}")
    t_first, chunks, usage, pending, done = None, 0, None, b"", False
    while not done:
        # read1: what has arrived (one HTTP chunk at most), never waiting to fill a buffer, which
        # iterating the response's lines would do (text arriving in bursts, TTFT late)
        data = resp.read1(65536)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:  # server-sent events, one `data: ...` line each
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                chunks += 1
                if t_first is None:
                    t_first = time.perf_counter()
    t_end = time.perf_counter()
    conn.close()
    out.update(t_send=t_send, t_first=t_first if t_first is not None else t_end, t_end=t_end,
               tokens=usage if usage is not None else chunks)


def prompt_id_range(model_path: str) -> tuple[int, int]:
    """Token ids to draw prompts from: ordinary text tokens of a real Qwen vocabulary (no control
    tokens), or the byte tokens of a tiny test vocabulary."""
    from deltaspec.gguf_file import read_gguf

    n_vocab = len(read_gguf(model_path).metadata["tokenizer.ggml.tokens"])
    return (1000, 150000) if n_vocab > 150000 else (0, min(256, n_vocab))


def random_prompts(n: int, n_prompt: int, rng, ids: tuple[int, int]) -> list[list[int]]:
    return [[int(t) for t in rng.integers(*ids, size=n_prompt)] for _ in range(n)]


def run_streams(server: Server, model: str, prompts: list[list[int]], n_gen: int) -> dict:
    n = len(prompts)
    barrier = threading.Barrier(n)
    outs: list[dict] = [{} for _ in range(n)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            one_stream(server.port, model, prompts[i], n_gen, barrier, outs[i])
        except BaseException as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{server.name}, {n} streams: {errors[0]!r}")
    t0 = min(o["t_send"] for o in outs)
    t1 = max(o["t_end"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    ttft = sorted(o["t_first"] - o["t_send"] for o in outs)
    decode = [(o["tokens"] - 1) / (o["t_end"] - o["t_first"]) for o in outs if o["tokens"] > 1 and o["t_end"] > o["t_first"]]
    return {"server": server.name, "n_streams": n, "tokens": tokens, "min_tokens": min(o["tokens"] for o in outs),
            "seconds": t1 - t0, "agg_tok_s": tokens / (t1 - t0), "ttft_ms_median": 1e3 * statistics.median(ttft),
            "ttft_ms_p90": 1e3 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "per_stream_decode_tok_s_median": statistics.median(decode) if decode else 0.0}


def summarize(runs: list[dict], servers: list[str], streams: list[int]) -> dict:
    out: dict = {}
    for name in servers:
        for n in streams:
            rs = [r for r in runs if r["server"] == name and r["n_streams"] == n]
            if not rs:
                continue
            row = {}
            for key in ("agg_tok_s", "ttft_ms_median", "ttft_ms_p90", "per_stream_decode_tok_s_median"):
                vals = [r[key] for r in rs]
                row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            out.setdefault(name, {})[str(n)] = row
    if "deltaspec" in out and "llama-server" in out:
        out["ratio_agg_tok_s"] = {str(n): out["deltaspec"][str(n)]["agg_tok_s"]["median"] /
                                  out["llama-server"][str(n)]["agg_tok_s"]["median"]
                                  for n in streams if str(n) in out["deltaspec"] and str(n) in out["llama-server"]}
    return out


def print_table(summary: dict, servers: list[str], streams: list[int]) -> None:
    print("| server | streams | aggregate tok/s (min-max) | TTFT median ms | TTFT p90 ms | per-stream decode tok/s |")
    print("|---|---|---|---|---|---|")
    for name in servers:
        for n in streams:
            row = summary.get(name, {}).get(str(n))
            if row is None:
                continue
            a = row["agg_tok_s"]
            print(f"| {name} | {n} | {a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) | "
                  f"{row['ttft_ms_median']['median']:.0f} | {row['ttft_ms_p90']['median']:.0f} | "
                  f"{row['per_stream_decode_tok_s_median']['median']:.1f} |")
    for n, ratio in summary.get("ratio_agg_tok_s", {}).items():
        print(f"deltaspec / llama-server aggregate tok/s at {n} streams: {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (left out: deltaspec alone)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of both servers (--device cpu)")
    ap.add_argument("--spec", default=None, metavar="ARGS",
                    help="also a speculative deltaspec server (-np 1, so 1 stream only) with these flags, e.g. "
                         "'-md DRAFT.gguf' or '--spec-type ngram-simple'")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also a deltaspec server with these extra flags, reported as deltaspec-NAME (repeatable)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    n_max = max(streams)
    ctx = args.prompt + args.gen + CTX_MARGIN
    log_dir = Path(args.out).resolve().parent
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = ["-t", str(args.threads)] if args.threads else []
    ours_cmd = [sys.executable, "-m", "deltaspec.server", "-m", args.model, "--device", args.device, "-np", str(n_max),
                "-c", str(ctx), "--port", str(free_port()), "--queue-size", str(4 * n_max), "--log-level", "warning",
                "-a", "bench", *threads]
    servers = [Server("deltaspec", ours_cmd, int(ours_cmd[ours_cmd.index("--port") + 1]), log_dir)]
    for variant in args.variant:
        name, sep, extra = variant.partition("=")
        if not sep or not name:
            ap.error(f"--variant wants NAME=ARGS, got {variant!r}")
        port = free_port()
        cmd = [*ours_cmd[:ours_cmd.index("--port")], "--port", str(port), *ours_cmd[ours_cmd.index("--port") + 2:],
               *extra.split()]
        servers.append(Server(f"deltaspec-{name}", cmd, port, log_dir))
    if args.llama_server:
        port = free_port()
        peer_cmd = [args.llama_server, "-m", args.model, "-np", str(n_max), "-c", str(n_max * ctx),
                    "-ngl", "99" if args.device == "cuda" else "0", "-fa", "on", "-b", "2048", "-ub", "512",
                    "--no-cache-prompt", "-cram", "0", "--no-webui", "--host", "127.0.0.1", "--port", str(port),
                    *threads]
        servers.append(Server("llama-server", peer_cmd, port, log_dir))
    if args.spec:
        port = free_port()
        spec_cmd = [*ours_cmd[:ours_cmd.index("-np")], "-np", "1", "-c", str(ctx), "--port", str(port),
                    "--log-level", "warning", "-a", "bench", *threads, *args.spec.split()]
        servers.append(Server("deltaspec-spec", spec_cmd, port, log_dir))
    names = [s.name for s in servers]
    runs: list[dict] = []
    rng = np.random.default_rng(0)
    ids = prompt_id_range(args.model)
    try:
        for s in servers:
            s.ready()
        for s in servers:  # graphs of every batch size built before anything is timed
            for n in (streams if s.name != "deltaspec-spec" else [1]):
                run_streams(s, "bench", random_prompts(n, args.prompt, rng, ids), 8)
        for rep in range(args.reps):
            for n in streams:
                here = [s for s in servers if s.name != "deltaspec-spec" or n == 1]  # it has one slot
                order = here if (rep + n) % 2 == 0 else here[::-1]
                # every server gets the same prompts, new ones each run (each server sees a prompt once)
                prompts = random_prompts(n, args.prompt, rng, ids)
                for s in order:
                    r = run_streams(s, "bench", prompts, args.gen)
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep} {s.name:12s} N={n:3d}: {r['agg_tok_s']:8.1f} tok/s aggregate, TTFT median "
                          f"{r['ttft_ms_median']:7.1f} ms, {r['tokens']} tokens (fewest per stream {r['min_tokens']})",
                          flush=True)
    finally:
        for s in servers:
            s.stop()
    summary = summarize(runs, names, streams)
    print_table(summary, names, streams)
    result = {"bench": "server_bench", "model": os.path.abspath(args.model), "weights": "as in the file (a "
              "synthetic GGUF's are random: speed of its shapes and quant mix)", "device": args.device,
              "streams": streams, "n_prompt": args.prompt, "n_gen": args.gen, "reps": args.reps,
              "commands": {s.name: s.cmd for s in servers}, "host": platform.node(),
              "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "runs": runs, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
