"""Serving throughput and time to first token, with and without speculation: `deltaspec serve` vs
`llama-server`, same file, same run.

    python bench/server_bench.py MODEL.gguf --llama-server BIN/llama-server [--device cuda]
                                 [--streams 1,4,16,32] [--prompt 128] [--gen 128] [--reps 3]
                                 [--spec ngram] [--spec draft=DRAFT.gguf] [--draft-n-max 8]
                                 [--prompts random|echo] [--deadline S]
                                 [--out bench/results/latest/server_bench.json]

Every server is started once, side by side, with as many slots as the largest stream count, the
speculative ones too: deltaspec `-np MAX -c CTX` (context per slot), llama-server `-np MAX
-c MAX*CTX -ngl 99 -fa on --no-cache-prompt` (its -c is divided among its slots), CTX = prompt
tokens + GEN + 64. A run sends N streamed greedy /v1/completions at once (threads released by one
barrier; every server of a run gets the same N prompts, new ones each run) with max_tokens GEN and
records per stream: time to the first text chunk (TTFT), tokens (usage, or chunks with text), and
the end. Reported per run: aggregate tok/s = all streams' tokens / (last end - first send), TTFT
median and p90, per-stream decode tok/s = (tokens - 1) / (end - first text), and the draft tokens
proposed and accepted in the run. Every N is warmed once per server first; then repetitions
interleave (rep, N, then every server in an order that alternates), and the summary gives median,
min and max over repetitions.

Rows (servers):
  deltaspec           `deltaspec serve`, no drafter: one token per running request and step.
  deltaspec-ngram     --spec ngram: prompt lookup (--spec-type ngram-simple): the longest suffix of up
                      to 3 tokens that occurred before proposes what followed it, up to --draft-n-max
                      tokens; every step verifies the drafts of all running requests in one target pass.
  deltaspec-draft     --spec draft=FILE: a draft model (-md FILE) drafts a chain of --draft-n-max tokens
                      for every running request (one batched draft pass per drafted token), verified as above.
  llama-server        llama-server, no drafter.
  llama-server-ngram  its ngram-simple with the same key and draft length (--spec-ngram-simple-size-n 3
                      --spec-ngram-simple-size-m N): exact 3-token matches only, where ours also falls
                      back to 2 and 1 tokens.
  llama-server-draft  -md FILE --spec-type draft-simple --spec-draft-n-max N (the draft on the GPU too,
                      -ngld 99; p-min 0, its default: full chains, as ours).
  deltaspec-NAME      --variant NAME=ARGS: deltaspec with these extra flags (an A/B in one run, e.g.
                      `--variant nobudget=--prefill-budget=0`; on two GPUs
                      `--variant replicas=--replicas=cuda:0,cuda:1`: a model per GPU, one queue).
Drafted and accepted tokens per run: ours from the server's /metrics (deltaspec_draft_tokens_total
and deltaspec_draft_tokens_accepted_total, read before and after the run; deltaspec_engine_steps_total
gives the target passes), llama-server's from the `timings` (draft_n, draft_n_accepted) of every
stream's last event. A plain row drafts nothing (0/0).

Prompts (--prompts):
  random  PROMPT random token ids per stream: no prompt cache can help. With random weights the
          target's greedy text seldom repeats itself, so lookup finds little to draft, and a random
          draft model's tokens are next to never the target's: these speculative rows are the cost
          of speculating, not its gain.
  echo    8 random ids, then P + C + P: P is PROMPT random ids, C the text a plain server of the same
          family (deltaspec / llama-server, whose numerics part at near-ties) continued P with, greedy,
          GEN tokens, asked once per family before the timed runs (MAX prompts, each run takes the
          first N with a fresh 8-id lead, so no prompt cache reuses the preparation) and tokenized
          again from its text (a token sequence that does not survive detokenizing differs there).
          After the second P, lookup finds the first one and drafts C: accepted as far as the target,
          with P + C before it now, continues P as it did alone. A trained model does; a random-weight
          one (the synthetic GGUFs) mostly does not: its first token after the second P already
          leaves C, and lookup then finds nothing to extend (on the synthetic 27B 2 of 16-56 drafted
          tokens accepted, bench/README.md). Prompts are 8 + 2 PROMPT + GEN long.

Weights of a synthetic GGUF are random: the speed is that of the shapes and quant mix, and the
acceptance is the one stated (say so with every number). llama-server gets `ignore_eos`; deltaspec
has no such option, so a stream of ours that samples an end token stops early and its token count
says so (on a 248k vocabulary, rare). --deadline S starts no repetition after S seconds of timed
runs (one always runs; the output says how many did), to fit a fixed slot on a shared machine.
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
    """A server process on 127.0.0.1 whose log goes to a file; `ready` waits for /health. `family`:
    "deltaspec" or "llama-server" (where its draft counts come from, which plain server prepares
    its echo prompts)."""

    def __init__(self, name: str, cmd: list[str], port: int, log_stem: Path, family: str):
        self.name, self.cmd, self.port, self.family = name, cmd, port, family
        self.log_path = log_stem.with_name(f"{log_stem.name}_{name}.log")
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


def metrics_counters(port: int) -> dict[str, float]:
    """deltaspec's /metrics (Prometheus text): every sample without labels, by name; finished requests
    summed over their reasons as deltaspec_requests_finished."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {"deltaspec_requests_finished": 0.0}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("deltaspec_requests_finished_total{"):
            out["deltaspec_requests_finished"] += float(value)
        elif "{" not in name:
            out[name] = float(value)
    return out


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
    t_first, chunks, usage, pending, done, timings, text = None, 0, None, b"", False, {}, []
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
            if event.get("timings"):  # llama-server's, on a stream's last events: its draft counts
                timings = event["timings"]
            if event.get("choices") and event["choices"][0].get("text"):
                chunks += 1
                text.append(event["choices"][0]["text"])
                if t_first is None:
                    t_first = time.perf_counter()
    t_end = time.perf_counter()
    conn.close()
    out.update(t_send=t_send, t_first=t_first if t_first is not None else t_end, t_end=t_end,
               tokens=usage if usage is not None else chunks, text="".join(text),
               draft_n=timings.get("draft_n", 0), draft_n_accepted=timings.get("draft_n_accepted", 0))


def prompt_id_range(model_path: str) -> tuple[int, int]:
    """Token ids to draw prompts from: ordinary text tokens of a real Qwen vocabulary (no control
    tokens), or the byte tokens of a tiny test vocabulary."""
    from deltaspec.gguf_file import read_gguf

    n_vocab = len(read_gguf(model_path).metadata["tokenizer.ggml.tokens"])
    return (1000, 150000) if n_vocab > 150000 else (0, min(256, n_vocab))


def random_prompts(n: int, n_prompt: int, rng, ids: tuple[int, int]) -> list[list[int]]:
    return [[int(t) for t in rng.integers(*ids, size=n_prompt)] for _ in range(n)]


ECHO_LEAD = 8  # fresh random ids before every echo prompt: no prompt cache matches a prefix


def echo_bodies(server: Server, model: str, tokenize, bases: list[list[int]], n_gen: int) -> list[list[int]]:
    """P + C + P for every base P, C the text `server` (a plain one) continues P with, greedy, n_gen
    tokens, tokenized again."""
    r = run_streams(server, model, bases, n_gen, keep_text=True)
    # the context leaves room for C half again as long as n_gen tokens
    return [base + tokenize(text)[:n_gen + n_gen // 2] + base for base, text in zip(bases, r.pop("texts"))]


def run_streams(server: Server, model: str, prompts: list[list[int]], n_gen: int, keep_text: bool = False) -> dict:
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

    # ours counts drafts in /metrics, per finished request (counted before its last event is sent)
    before = metrics_counters(server.port) if server.family == "deltaspec" else None
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
    if before is not None:
        after = metrics_counters(server.port)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        if delta["deltaspec_requests_finished"] != n:
            raise RuntimeError(f"{server.name}: /metrics counted {delta['deltaspec_requests_finished']:g} finished "
                               f"requests in a run of {n}: the draft counts would not be this run's")
        drafted, accepted = int(delta["deltaspec_draft_tokens_total"]), int(delta["deltaspec_draft_tokens_accepted_total"])
        target_passes = int(delta["deltaspec_engine_steps_total"])
    else:
        drafted, accepted = sum(o["draft_n"] for o in outs), sum(o["draft_n_accepted"] for o in outs)
        target_passes = None  # llama-server does not say
    out = {"server": server.name, "n_streams": n, "tokens": tokens, "min_tokens": min(o["tokens"] for o in outs),
           "seconds": t1 - t0, "agg_tok_s": tokens / (t1 - t0), "ttft_ms_median": 1e3 * statistics.median(ttft),
           "ttft_ms_p90": 1e3 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
           "per_stream_decode_tok_s_median": statistics.median(decode) if decode else 0.0,
           "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
           "engine_steps": target_passes}
    if keep_text:
        out["texts"] = [o["text"] for o in outs]
    return out


SUMMARY_KEYS = ("agg_tok_s", "ttft_ms_median", "ttft_ms_p90", "per_stream_decode_tok_s_median", "acceptance")


def summarize(runs: list[dict], servers: list[str], streams: list[int]) -> dict:
    out: dict = {}
    for name in servers:
        for n in streams:
            rs = [r for r in runs if r["server"] == name and r["n_streams"] == n]
            if not rs:
                continue
            row: dict = {}
            for key in SUMMARY_KEYS:
                vals = [r[key] for r in rs]
                row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
            row["drafted"] = sum(r["drafted"] for r in rs)    # over the repetitions
            row["accepted"] = sum(r["accepted"] for r in rs)
            out.setdefault(name, {})[str(n)] = row

    def ratio(a: str, b: str) -> dict:
        return {str(n): out[a][str(n)]["agg_tok_s"]["median"] / out[b][str(n)]["agg_tok_s"]["median"]
                for n in streams if str(n) in out.get(a, {}) and str(n) in out.get(b, {})}

    # ours over llama-server's with the same drafter (none, ngram, draft), and each speculative
    # server over its own family's plain one
    ratios = {}
    for suffix in ("", *sorted({name.removeprefix("deltaspec") for name in servers if name.startswith("deltaspec-")})):
        if f"deltaspec{suffix}" in out and f"llama-server{suffix}" in out:
            ratios[f"deltaspec{suffix} / llama-server{suffix}"] = ratio(f"deltaspec{suffix}", f"llama-server{suffix}")
    for name in servers:
        for family in ("deltaspec", "llama-server"):
            if name.startswith(family + "-") and family in out and name in out:
                ratios[f"{name} / {family}"] = ratio(name, family)
    if "deltaspec / llama-server" in ratios:
        out["ratio_agg_tok_s"] = ratios["deltaspec / llama-server"]  # the key earlier results carry
    out["ratios_agg_tok_s"] = ratios
    return out


def print_table(summary: dict, servers: list[str], streams: list[int]) -> None:
    print("| server | streams | aggregate tok/s (min-max) | TTFT median ms | TTFT p90 ms | per-stream decode tok/s "
          "| accepted / drafted (all reps) |")
    print("|---|---|---|---|---|---|---|")
    for name in servers:
        for n in streams:
            row = summary.get(name, {}).get(str(n))
            if row is None:
                continue
            a = row["agg_tok_s"]
            acc = f"{row['accepted']} / {row['drafted']}" + (f" ({row['accepted'] / row['drafted']:.2f})"
                                                             if row["drafted"] else "")
            print(f"| {name} | {n} | {a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) | "
                  f"{row['ttft_ms_median']['median']:.0f} | {row['ttft_ms_p90']['median']:.0f} | "
                  f"{row['per_stream_decode_tok_s_median']['median']:.1f} | {acc} |")
    for what, by_n in summary.get("ratios_agg_tok_s", {}).items():
        print(f"{what}, aggregate tok/s: " + ", ".join(f"{r:.2f}x at {n}" for n, r in by_n.items()))


def parse_spec(value: str) -> tuple[str, str | None]:
    """--spec: ("ngram", None) or ("draft", FILE)."""
    kind, _, path = value.partition("=")
    if kind == "ngram" and not path:
        return "ngram", None
    if kind == "draft" and path:
        return "draft", path
    raise argparse.ArgumentTypeError(f"expected 'ngram' or 'draft=FILE.gguf', got {value!r}")


def spec_flags(family: str, kind: str, draft: str | None, n_max: int, device: str) -> list[str]:
    """The flags that make a server of `family` speculate with drafter `kind` (drafts of n_max)."""
    if family == "deltaspec":
        if kind == "ngram":
            return ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(n_max)]
        return ["-md", draft, "--spec-draft-n-max", str(n_max)]
    if kind == "ngram":  # ours looks up suffixes of up to 3 tokens: its key length, and our draft length
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                "--spec-ngram-simple-size-m", str(n_max)]
    return ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", "0",
            "-ngld", "99" if device == "cuda" else "0"]


def server_commands(args, ctx: int) -> list[tuple[str, str, list[str]]]:
    """(name, family, command) of every server of the run, ports to be filled in ("PORT")."""
    n_max = max(int(x) for x in args.streams.split(","))
    threads = ["-t", str(args.threads)] if args.threads else []
    ours = [sys.executable, "-m", "deltaspec.server", "-m", args.model, "--device", args.device, "-np", str(n_max),
            "-c", str(ctx), "--port", "PORT", "--queue-size", str(4 * n_max), "--log-level", "warning",
            "-a", "bench", *threads]
    out = [("deltaspec", "deltaspec", ours)]
    for variant in args.variant:
        name, sep, extra = variant.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"--variant wants NAME=ARGS, got {variant!r}")
        out.append((f"deltaspec-{name}", "deltaspec", [*ours, *extra.split()]))
    for kind, draft in args.spec:
        out.append((f"deltaspec-{kind}", "deltaspec", [*ours, *spec_flags("deltaspec", kind, draft, args.draft_n_max,
                                                                            args.device)]))
    if args.llama_server:
        peer = [args.llama_server, "-m", args.model, "-np", str(n_max), "-c", str(n_max * ctx),
                "-ngl", "99" if args.device == "cuda" else "0", "-fa", "on", "-b", "2048", "-ub", "512",
                "--no-cache-prompt", "-cram", "0", "--no-webui", "--host", "127.0.0.1", "--port", "PORT", *threads]
        out.append(("llama-server", "llama-server", peer))
        for kind, draft in args.spec:
            out.append((f"llama-server-{kind}", "llama-server",
                        [*peer, *spec_flags("llama-server", kind, draft, args.draft_n_max, args.device)]))
    names = [name for name, _, _ in out]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"two servers of one name: {names}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (left out: deltaspec alone)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream (echo: the length of P)")
    ap.add_argument("--gen", type=int, default=128, help="tokens generated per stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of every server (--device cpu)")
    ap.add_argument("--spec", action="append", default=[], type=parse_spec, metavar="ngram|draft=FILE",
                    help="also deltaspec and llama-server (when given) with this drafter, named deltaspec-ngram / "
                         "llama-server-ngram or deltaspec-draft / llama-server-draft (repeatable)")
    ap.add_argument("--draft-n-max", type=int, default=8, help="longest draft of the speculative servers")
    ap.add_argument("--prompts", default="random", choices=["random", "echo"], help="see the module's docstring")
    ap.add_argument("--deadline", type=float, default=None, metavar="S",
                    help="start no repetition after S seconds of timed runs (one always runs)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also a deltaspec server with these extra flags, reported as deltaspec-NAME (repeatable)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    ap = build_parser()
    args = ap.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    n_max = max(streams)
    n_prompt = args.prompt if args.prompts == "random" else ECHO_LEAD + 2 * args.prompt + args.gen
    # echo: C is tokenized again from its text, which can come out a few tokens longer
    ctx = n_prompt + args.gen + CTX_MARGIN + (args.gen // 2 if args.prompts == "echo" else 0)
    try:
        commands = server_commands(args, ctx)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    log_stem = Path(args.out).resolve().with_suffix("")  # server logs beside the JSON, named after it
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    servers = []
    for name, family, cmd in commands:
        port = free_port()
        cmd = [str(port) if a == "PORT" else a for a in cmd]
        servers.append(Server(name, cmd, port, log_stem, family))
    names = [s.name for s in servers]
    runs: list[dict] = []
    rng = np.random.default_rng(0)
    ids = prompt_id_range(args.model)
    reps_done = 0
    try:
        for s in servers:
            s.ready()
        for s in servers:  # graphs of every batch size built before anything is timed
            for n in streams:
                run_streams(s, "bench", random_prompts(n, n_prompt, rng, ids), 8)
        bodies: dict[str, list[list[int]]] = {}  # echo: per family, the P + C + P of every stream
        if args.prompts == "echo":
            from deltaspec.gguf_file import read_gguf
            from deltaspec.tokenizer import Tokenizer

            tok = Tokenizer.from_metadata(read_gguf(args.model).metadata)
            bases = random_prompts(n_max, args.prompt, rng, ids)
            for s in servers:
                if s.name == s.family:  # the plain server of its family
                    bodies[s.family] = echo_bodies(s, "bench", lambda t: tok.encode(t, special=True), bases, args.gen)
                    print(f"echo prompts from {s.name}: {sum(map(len, bodies[s.family])) / n_max:.0f} tokens each")
        t_timed = time.monotonic()
        for rep in range(args.reps):
            if rep and args.deadline is not None and time.monotonic() - t_timed > args.deadline:
                print(f"--deadline {args.deadline:g} s: stopping after {rep} of {args.reps} repetitions", flush=True)
                break
            for n in streams:
                order = servers if (rep + n) % 2 == 0 else servers[::-1]
                # new prompts every run, the same for every server of the run (each server sees a prompt once)
                if args.prompts == "random":
                    same = random_prompts(n, args.prompt, rng, ids)
                    prompts = {"deltaspec": same, "llama-server": same}
                else:
                    leads = random_prompts(n, ECHO_LEAD, rng, ids)
                    prompts = {f: [lead + body for lead, body in zip(leads, b[:n])] for f, b in bodies.items()}
                for s in order:
                    r = run_streams(s, "bench", prompts[s.family], args.gen)
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep} {s.name:18s} N={n:3d}: {r['agg_tok_s']:8.1f} tok/s aggregate, TTFT median "
                          f"{r['ttft_ms_median']:7.1f} ms, {r['tokens']} tokens (fewest per stream {r['min_tokens']}), "
                          f"accepted {r['accepted']}/{r['drafted']}", flush=True)
            reps_done = rep + 1
    finally:
        for s in servers:
            s.stop()
    summary = summarize(runs, names, streams)
    print_table(summary, names, streams)
    result = {"bench": "server_bench", "model": os.path.abspath(args.model), "weights": "as in the file (a "
              "synthetic GGUF's are random: speed of its shapes and quant mix, acceptance as stated)",
              "device": args.device, "streams": streams, "n_prompt": n_prompt, "prompts": args.prompts,
              "n_gen": args.gen, "reps": reps_done, "reps_asked": args.reps, "draft_n_max": args.draft_n_max,
              "commands": {s.name: s.cmd for s in servers}, "host": platform.node(),
              "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "runs": runs, "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
