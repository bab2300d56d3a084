"""llama.cpp users' muscle memory on `deltaspec`: each llama.cpp spelling we accept parses to the
option it means, the ones argparse used to misread (-ngl as `-n gl`, -fa as `-f a`, abbreviations)
now parse or fail naming the flag, and llama.cpp flags with no counterpart are refused by name.
Parsing tests load no model; two end-to-end runs use the tiny-vocabulary model."""

import os
import subprocess
import sys

import pytest

from deltaspec import Model, __version__
from deltaspec import cli
from deltaspec.cli_args import REFUSED_LLAMA_FLAGS, StrictParser, process_escapes
from deltaspec.testing.tiny_vocab import tiny_vocab_model_path

ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


def parse_run(*args):
    return cli.build_parser().parse_args(["run", "-m", "m.gguf", *args])


def run_error(capsys, *argv):
    """The one-line error (exit 2) parsing argv gives, without loading anything."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# spelling(s) -> the parsed attribute and value: each row seen red when its add_argument was removed
# (planted: the "-ngl" spelling dropped from the -ngl argument: its row failed with "unrecognized flag -ngl")
ACCEPTED = [
    (["-ngl", "99"], "n_gpu_layers", "99"), (["--gpu-layers", "all"], "n_gpu_layers", "all"),
    (["--n-gpu-layers", "0"], "n_gpu_layers", "0"),
    (["-fa", "on"], "flash_attn", "on"), (["--flash-attn", "auto"], "flash_attn", "auto"),
    (["-sys", "be brief"], "system_prompt", "be brief"), (["--system-prompt", "x"], "system_prompt", "x"),
    (["-cnv"], "interactive", True), (["--conversation"], "interactive", True),
    (["-i", "-no-cnv"], "interactive", False), (["-i", "--no-conversation"], "interactive", False),
    (["--chat-template", "{{ x }}"], "chat_template", "{{ x }}"),
    (["--chat-template-file", "t.jinja"], "chat_template_file", "t.jinja"),
    (["--jinja"], "jinja", True),
    (["-b", "64"], "batch_size", 64), (["--batch-size", "64"], "batch_size", 64),
    (["-ub", "32"], "ubatch_size", 32), (["--ubatch-size", "32"], "ubatch_size", 32),
    (["-e"], "escape", True), (["--escape"], "escape", True), (["--no-escape"], "escape", False),
    ([], "escape", True),  # llama.cpp processes escapes by default
    (["-v"], "verbose", True), (["--verbose"], "verbose", True), (["--log-verbose"], "verbose", True),
    (["--log-disable"], "log_disable", True),
    (["-n", "5"], "n_predict", 5), (["-s", "3"], "seed", 3), (["-md", "d.gguf"], "model_draft", "d.gguf"),
    (["--chat-template-kwargs", "{}"], "chat_template_kwargs", "{}"),
]


@pytest.mark.parametrize("args, attr, value", ACCEPTED, ids=[" ".join(a) or "default" for a, _, _ in ACCEPTED])
def test_llama_cpp_spelling_parses(args, attr, value):
    ns = parse_run("-p", "hi", *args)
    assert getattr(ns, attr) == value
    assert ns.prompt == "hi" and ns.n_predict == (5 if args == ["-n", "5"] else -1)  # nothing else was eaten


# Former misparses and abbreviations: each must fail naming the flag the user typed. Seen red (all 11
# rows) with StrictParser._check_flags emptied: argparse's own messages came back ("-n/--n-predict:
# invalid int value" style for -n5/-ngl2, "unrecognized arguments" under the top-level usage for
# --n-pred). allow_abbrev=False is checked on its own by test_every_parser_refuses_abbreviations.
@pytest.mark.parametrize("argv, expect", [
    (["run", "-m", "m", "-p", "hi", "--n-pred", "5"], "unrecognized flag --n-pred (flags are matched whole"),
    (["run", "-m", "m", "-p", "hi", "--chat-template-kw", "{}"], "unrecognized flag --chat-template-kw"),
    (["run", "-m", "m", "-p", "hi", "-ngl2"], "unrecognized flag -ngl2 (single-dash flags are matched whole"),
    (["run", "-m", "m", "-p", "hi", "-n5"], "unrecognized flag -n5"),
    (["run", "-m", "m", "-p", "hi", "-mg", "1"], "-mg (--main-gpu): llama.cpp's flag is not supported"),
    (["run", "-m", "m", "-p", "hi", "--mlock"], "--mlock: llama.cpp's flag is not supported"),
    (["run", "-m", "m", "-p", "hi", "-dev", "CUDA0"], "-dev: llama.cpp's flag is not supported: use --devices"),
    (["run", "-m", "m", "-p", "hi", "--typical", "0.5"], "--typical: llama.cpp's flag is not supported"),
    (["run", "-m", "m", "-p", "hi", "-r", "User:"], "-r (--reverse-prompt): llama.cpp's flag is not supported: "
                                                    "use --stop STR"),
    (["run", "-m", "m", "-p", "hi", "--no-jinja"], "--no-jinja: llama.cpp's flag is not supported"),
    (["info", "m.gguf", "-ngl", "3"], "unrecognized flag -ngl"),
    (["--vers"], "unrecognized flag --vers"),
])
def test_unknown_flag_is_named(capsys, argv, expect):
    line = run_error(capsys, *argv)
    assert expect in line, line


def test_every_parser_refuses_abbreviations():
    """allow_abbrev=False everywhere, subcommands included (StrictParser is the subparsers' class).
    Seen red with StrictParser.__init__ setting allow_abbrev=True."""
    parser = cli.build_parser()
    subs = parser._subparsers._group_actions[0].choices
    assert set(subs) == {"run", "serve", "info", "convert", "synth"}
    for p in [parser, *subs.values()]:
        assert isinstance(p, StrictParser) and p.allow_abbrev is False, p.prog


def test_refused_flags_are_not_also_accepted():
    """A flag cannot be both refused and one of `run`'s own (the refusal would never show). Seen red
    with -ngl added to the refused flags."""
    run = cli.build_parser()._subparsers._group_actions[0].choices["run"]
    assert not set(REFUSED_LLAMA_FLAGS) & set(run._option_string_actions)


@pytest.mark.parametrize("args, device", [
    ([], "cpu"), (["-ngl", "0"], "cpu"), (["-ngl", "99"], "cuda"), (["-ngl", "all"], "cuda"),
    (["-ngl", "auto"], "cpu"), (["-ngl", "-1"], "cpu"), (["-ngl", "auto", "--device", "cuda"], "cuda"),
    (["-ngl", "1", "--device", "cuda"], "cuda"),
])
def test_ngl_means_which_device(args, device):
    """-ngl on a one-device engine: 0 = CPU, any layer count or 'all' = the GPU, auto = --device.
    Seen red with _device returning args.device or 'cpu' whatever -ngl said."""
    assert cli._model_kwargs(parse_run("-p", "hi", *args))["device"] == device


@pytest.mark.parametrize("args, flag", [
    (["-ngl", "0", "--device", "cuda"], "-ngl/--n-gpu-layers: 0 means --device cpu"),
    (["-ngl", "99", "--device", "cpu"], "-ngl/--n-gpu-layers: 99 means --device cuda"),
    (["-ngl", "lots"], "-ngl/--n-gpu-layers: expected a number"),
    (["-b", "0"], "-b/--batch-size: must be >= 1"),
])
def test_model_flag_errors(args, flag):
    with pytest.raises(cli.RunError, match="^" + flag.replace("(", r"\(")):
        cli._model_kwargs(parse_run("-p", "hi", *args))


@pytest.mark.parametrize("b, ub, n_ubatch", [(2048, 512, 512), (64, 512, 64), (64, 32, 32)])
def test_batch_caps_ubatch(b, ub, n_ubatch):
    """llama.cpp caps the physical batch at the logical one. Seen red with n_ubatch=args.ubatch_size."""
    args = parse_run("-p", "hi", "-b", str(b), "-ub", str(ub))
    assert cli._model_kwargs(args)["n_ubatch"] == n_ubatch


@pytest.mark.parametrize("args, message", [
    (["-fa", "off"], "-fa/--flash-attn: off is not available"),
    (["-sys", "s"], "-sys/--system-prompt: only used with -i/-cnv"),
    (["-cnv", "-sys", "s"], "-sys/--system-prompt: give the system message once"),
    (["-cnv", "--chat-template", "llama3"], "--chat-template: 'llama3' is neither a built-in template name"),
    (["--chat-template", "{{ x }}"], "--chat-template: only used with -i/-cnv"),
    (["-cnv", "--chat-template", "{% if %}"], "--chat-template: chat template does not compile"),
    (["-cnv", "--chat-template-file", "/nonexistent.jinja"], "--chat-template-file: cannot read"),
])
def test_run_errors_before_loading(args, message):
    """Checked before the model loads (-m names no file here). Each seen red by deleting its check
    (e.g. the -fa off refusal: the run went on to "m.gguf: no such file")."""
    with pytest.raises(cli.RunError, match="^" + message.replace("(", r"\(")):
        cli._run(parse_run("-p", "hi", *args))


@pytest.mark.parametrize("typed, meant", [
    (r"a\nb\tc\\d\'e\"f", "a\nb\tc\\d'e\"f"), (r"\x41\xe2\x80\x94", "A\u2014"),
    (r"keep \q and \x4 and trailing \\", "keep \\q and \\x4 and trailing \\"), ("\u00e9\\n", "\u00e9\n"),
])
def test_escapes_as_llama_cpp(typed, meant):
    """llama.cpp's string_process_escapes, incl. \\xHH bytes forming UTF-8. Seen red with the \\x branch
    appending chr(value) to a str instead of a byte (the em dash came out as mojibake)."""
    assert process_escapes(typed) == meant


def test_escape_default_and_no_escape(tmp_path):
    """-p, -f, -sys and --stop are escaped unless --no-escape. Seen red with `escape` defaulting to False."""
    f = tmp_path / "p.txt"
    f.write_text(r"x\ty" + "\n", encoding="utf-8")
    assert cli._read_prompt(parse_run("-p", r"a\nb")) == "a\nb"
    assert cli._read_prompt(parse_run("-f", str(f))) == "x\ty"
    assert cli._read_prompt(parse_run("-p", r"a\nb", "--no-escape")) == r"a\nb"
    assert cli._system_prompt(parse_run("-cnv", "-sys", r"s\n"), None) == "s\n"
    assert cli._sampling_kwargs(parse_run("-p", "x", "--stop", r"\n\n"))["stop"] == ["\n\n"]
    assert cli._sampling_kwargs(parse_run("-p", "x", "--stop", r"\n", "--no-escape"))["stop"] == [r"\n"]


def deltaspec(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "deltaspec", *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", env=ENV, timeout=60, input=stdin)


def test_version_and_bare_command():
    """--version prints the package version; `deltaspec` alone prints the full help and exits 0 (it
    asks what the tool is; not an error). Seen red with main's bare-argv branch removed (argparse:
    exit 2, "a command is required")."""
    r = deltaspec("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"deltaspec {__version__}"
    r = deltaspec()
    assert r.returncode == 0 and r.stdout.startswith("usage: deltaspec") and "run" in r.stdout and r.stderr == ""


@pytest.fixture(scope="module")
def tiny():
    return tiny_vocab_model_path()


def test_llama_cpp_command_line_end_to_end(tiny):
    """The formerly misread line runs: -ngl 0 -fa on -b 8 with an escaped prompt, greedy output equal
    to generate()'s; the random seed is printed and -s with it repeats the run. Seen red with
    process_escapes returning its input (stdout began with a literal backslash-n)."""
    prompt = "the cat\\nsat"
    base = ["run", "-m", tiny, "-ngl", "0", "-fa", "on", "-b", "8", "-t", "1", "-c", "256", "-n", "12"]
    r = deltaspec(*base, "-p", prompt, "--temp", "0", "--jinja")
    assert r.returncode == 0, r.stderr
    with Model(tiny, n_ctx=256, n_threads=1, n_ubatch=8, progress=False) as m:
        assert r.stdout == "the cat\nsat" + m.generate("the cat\nsat", max_tokens=12, temperature=0).text + "\n"
    assert "seed" not in r.stderr  # greedy: no seed to report
    r = deltaspec(*base, "-p", prompt, "--temp", "1.5", "--log-disable")
    assert r.returncode == 0 and r.stderr == "", r.stderr  # --log-disable: not even the timing line
    sampled = deltaspec(*base, "-p", prompt, "--temp", "1.5")
    seed_line = [line for line in sampled.stderr.splitlines() if line.startswith("deltaspec: seed ")]
    assert len(seed_line) == 1, sampled.stderr
    seed = seed_line[0].split()[2]
    again = deltaspec(*base, "-p", prompt, "--temp", "1.5", "-s", seed)
    assert again.returncode == 0 and again.stdout == sampled.stdout
    assert "deltaspec: seed" not in again.stderr


def test_conversation_with_system_prompt_and_template_file(tiny, tmp_path):
    """-cnv -sys --chat-template-file: the REPL renders each turn with the given template (the tiny
    model has none of its own). Seen red with _run not passing the template on (the run failed:
    "has no chat template")."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>",
                        encoding="utf-8")
    r = deltaspec("run", "-m", tiny, "-cnv", "-sys", r"be\tbrief", "--chat-template-file", template, "-n", "6",
                  "--temp", "0", "-t", "1", "-c", "256", stdin="hello\n")
    assert r.returncode == 0, r.stderr
    with Model(tiny, n_ctx=256, n_threads=1, progress=False) as m:
        text = m.generate("<system>be\tbrief\n<user>hello\n<assistant>", max_tokens=6, temperature=0).text
    assert r.stdout == text + "\n"


@pytest.mark.parametrize("how", ["name", "file"])
def test_chat_template_by_name_or_file(tiny, tmp_path, how):
    """--chat-template chatml (a built-in name, as llama.cpp's) or --chat-template FILE: the REPL
    renders the turn in that format (this tiny model has no template of its own). Seen red with the name
    branch removed from cli._chat_template ('chatml' refused as neither text nor a file) and, for the
    file, with the file's path taken as template text (the reply then followed the literal path)."""
    if how == "name":
        value, rendered = "chatml", "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n" \
                                    "<|im_start|>assistant\n"
    else:
        value = tmp_path / "t.jinja"
        value.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]",
                         encoding="utf-8")
        rendered = "[system] be brief\n[user] hello\n[assistant]"
    r = deltaspec("run", "-m", tiny, "-cnv", "-sys", "be brief", "--chat-template", value, "-n", "6",
                  "--temp", "0", "-t", "1", "-c", "256", stdin="hello\n")
    assert r.returncode == 0, r.stderr
    with Model(tiny, n_ctx=256, n_threads=1, progress=False) as m:
        text = m.generate(rendered, max_tokens=6, temperature=0).text
    assert r.stdout == text + "\n"


def test_verbose_prints_the_settings(tiny):
    """-v / --verbose prints the settings in use (model and sampling) on stderr, and only then. Seen
    red with the settings line printed under --log-disable instead of under -v."""
    base = ["run", "-m", tiny, "-p", "hi", "-n", "2", "--temp", "0", "-t", "1", "-c", "256"]
    quiet, verbose = deltaspec(*base), deltaspec(*base, "-v")
    assert quiet.returncode == 0 and verbose.returncode == 0, verbose.stderr
    settings = [line for line in verbose.stderr.splitlines() if line.startswith("deltaspec: n_ctx=")]
    assert len(settings) == 1 and "temperature=0.0" in settings[0] and "n_threads=1" in settings[0], verbose.stderr
    assert "deltaspec: n_ctx=" not in quiet.stderr
    assert verbose.stdout == quiet.stdout


def test_ngl_on_a_build_without_cuda_names_the_flag(monkeypatch, capsys):
    """`deltaspec run -ngl 99` where no CUDA device exists fails naming -ngl, before any model is
    read (the model path does not exist). Seen red with the _check_ngl_device call removed from
    run: the error then came from opening the missing file."""
    from deltaspec import _core

    monkeypatch.setattr(_core, "has_device", lambda device: False, raising=True)
    assert cli.main(["run", "-m", "/nonexistent/model.gguf", "-p", "hi", "-ngl", "99"]) != 0
    err = capsys.readouterr().err
    assert "-ngl/--n-gpu-layers 99: asks for the GPU" in err, err
