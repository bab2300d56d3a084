"""Argument parsing that never guesses: the CLI's users come from llama.cpp, whose flags are matched
exactly, so a flag argparse does not know must fail naming that flag, not be read as something else.

argparse guesses twice: it completes an unambiguous prefix of a long flag (`--chat-template` taken
for `--chat-template-kwargs`), and it reads an unknown single-dash word as a short flag with its
value glued on (`-ngl 99` taken as `-n gl`). `StrictParser` turns both off; `REFUSED_LLAMA_FLAGS`
names llama.cpp flags that mean nothing here so the error can say what the flag was."""

from __future__ import annotations

import argparse
import re

# llama.cpp (common/arg.cpp) flags with no counterpart in deltaspec: each spelling -> the flag's
# canonical name, so `-ot` and `--override-tensor` get the same message.
_REFUSED_GROUPS = [
    ("-mg", "--main-gpu"), ("-dev",), ("--mlock",),
    ("--no-mmap", "--mmap"), ("--numa",), ("-ot", "--override-tensor"), ("-cmoe", "--cpu-moe"),
    ("-ncmoe", "--n-cpu-moe"), ("--lora",), ("--lora-scaled",), ("--control-vector",),
    ("-hf", "-hfr", "--hf-repo"), ("-hff", "--hf-file"), ("-hft", "--hf-token"), ("-mu", "--model-url"),
    ("-r", "--reverse-prompt"), ("--in-prefix",), ("--in-suffix",), ("--in-prefix-bos",),
    ("-sp", "--special"), ("-st", "--single-turn"), ("-ins", "--instruct"), ("--multiline-input", "-mli"),
    ("--mirostat",), ("--mirostat-lr",), ("--mirostat-ent",), ("--typical",), ("--dynatemp-range",),
    ("--dynatemp-exp",), ("--xtc-probability",), ("--xtc-threshold",), ("--top-nsigma",),
    ("--dry-multiplier",), ("--dry-base",), ("--dry-allowed-length",), ("--dry-penalty-last-n",),
    ("--dry-sequence-breaker",), ("--samplers",), ("--sampling-seq", "--sampler-seq"), ("-l", "--logit-bias"),
    ("--rope-scaling",), ("--rope-scale",), ("--rope-freq-base",), ("--rope-freq-scale",),
    ("--yarn-orig-ctx",), ("--yarn-ext-factor",), ("--yarn-attn-factor",), ("--yarn-beta-slow",),
    ("--yarn-beta-fast",), ("-gan", "--grp-attn-n"), ("-gaw", "--grp-attn-w"), ("--keep",),
    ("--prompt-cache",), ("--prompt-cache-all",), ("--prompt-cache-ro",), ("-ptc", "--print-token-count"),
    ("-tb", "--threads-batch"), ("-C", "--cpu-mask"), ("-Cr", "--cpu-range"), ("--prio",), ("--poll",),
    ("-np", "--parallel"), ("-cb", "--cont-batching"), ("-nkvo", "--no-kv-offload"), ("--no-warmup",),
    ("-dt", "--defrag-thold"), ("--reasoning-format",), ("-lv", "--verbosity"),
    ("--log-file",), ("--log-colors",), ("--override-kv",), ("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"),
    ("-devd", "--device-draft"), ("-cd", "--ctx-size-draft"), ("-ps", "--spec-p-min"), ("--draft-p-min",),
    ("-mm", "--mmproj"), ("--image",), ("--no-jinja",), ("--perf",), ("--no-perf",),
]
REFUSED_LLAMA_FLAGS = {spelling: group[-1] for group in _REFUSED_GROUPS for spelling in group}

# Why a refused flag means nothing here, where one sentence says more than "not supported".
_REASONS = {
    "--no-jinja": "deltaspec always renders chat templates with Jinja",
    "--reverse-prompt": "use --stop STR",
    "--hf-repo": "download the GGUF first and pass it with -m",
    # deltaspec names devices as torch does (cuda:0, cpu), llama.cpp as its backends do (CUDA0, CPU)
    "-dev": "use --devices (e.g. --devices cuda:0,cpu, with -sm layer -ts 3,1)",
}

# argparse's own test for "looks like a negative number, so it is a value, not a flag"
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def refusal(flag: str) -> str:
    canonical = REFUSED_LLAMA_FLAGS[flag]
    named = flag if flag == canonical else f"{flag} ({canonical})"
    why = _REASONS.get(canonical, "it has no counterpart in deltaspec")
    return f"{named}: llama.cpp's flag is not supported: {why}"


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through parser_class, every subparser) that matches flags exactly."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            self._check_flags(list(args))
        return super().parse_known_args(args, namespace)

    def _check_flags(self, args: list[str]) -> None:
        known = set(self._option_string_actions)
        has_commands = self._subparsers is not None
        for arg in args:
            if arg == "--":
                return
            if not arg.startswith("-") or arg == "-":
                if has_commands:  # the subcommand's own parser checks the rest
                    return
                continue
            name = arg.split("=", 1)[0]
            if name in known or " " in arg or _NEGATIVE_NUMBER.match(arg):
                continue  # argparse reads these as the flag itself or as a value
            if name in REFUSED_LLAMA_FLAGS:
                self.error(refusal(name))
            if arg.startswith("--"):
                # argparse would report it after the subcommand, with the top-level usage
                self.error(f"unrecognized flag {name} (flags are matched whole, never abbreviated)")
            if len(name) > 2:
                # argparse would split it into a short flag plus a glued value (-ngl -> -n gl)
                self.error(f"unrecognized flag {name} (single-dash flags are matched whole; "
                           f"a value goes after a space)")


def process_escapes(text: str) -> str:
    """llama.cpp's -e/--escape: \\n \\r \\t \\' \\" \\\\ and \\xHH (one byte) become the characters they
    name; any other backslash stays as typed. Works on UTF-8 bytes so \\xHH sequences can spell a
    multi-byte character, as they do in llama.cpp."""
    data = text.encode("utf-8", errors="surrogateescape")
    simple = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"', ord("\\"): b"\\"}
    out = bytearray()
    i = 0
    while i < len(data):
        c = data[i]
        if c != ord("\\") or i + 1 >= len(data):
            out.append(c)
            i += 1
            continue
        nxt = data[i + 1]
        if nxt in simple:
            out += simple[nxt]
            i += 2
        elif nxt == ord("x") and re.fullmatch(rb"[0-9a-fA-F]{2}", data[i + 2:i + 4]):
            out.append(int(data[i + 2:i + 4], 16))
            i += 4
        else:
            out += data[i:i + 2]
            i += 2
    return out.decode("utf-8", errors="replace")
