"""The README as a user reads it: its Python example runs as written, every `deltaspec` command line
it shows parses, every llama.cpp flag and server route its tables call "same" is one of ours (and
the ones it calls refused or not served are not), every name it tells users to call exists where it
says, and every file it or bench/README.md cites is in the repository. A renamed flag, route,
method, error class, test or result file that the README still shows fails here.

Seen red (planted one at a time in the README, then restored): `-ctk q8_0` spelled `--ctk q8_0` in
the command-line block (test_every_command_line_parses named line 346 and the unrecognized flag);
`--reasoning-budget N` in the llama-cli table's "same" row spelled `--reasoning-budgets N`, and
`--lora` moved from the refused row to a row of its own saying "same" (each named as not a flag of
`run`); `r.stats.tokens_per_second` as `r.stats.tok_per_second` in the Python example (its
AttributeError, raised from the README's line); `model.kv_cache_info()` as `model.kv_info()`, and
`TruncatedFileError` as `TruncatedError` (each named); `/apply-template` as `/apply_template` in a
"same" row, and `POST /props` in the "not served" row as `POST /tokenize` (each named); a cited
`tests/test_server_peer.py` as `tests/test_server_peers.py`, bench/README.md's
`latest/tree_split_walks.md` without its s, and its `::test_stacked_rows_equal_the_part_alone` as
`::test_stacked_rows_equal_the_parts` (each named)."""

from __future__ import annotations

import contextlib
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest

from deltaspec import Grammar, Llama, Model, cli, errors

README = Path(__file__).resolve().parent.parent / "README.md"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(first line number, body) of each fenced block of that language."""
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```" + language + r"\n(.*?)^```", text, re.S | re.M)]


def command_lines(text: str) -> list[tuple[int, list[str]]]:
    """Every `deltaspec ...` command of the README's bash blocks as argv lists (without the program
    name), its placeholders made concrete: `[OPTIONAL ...]` kept (dropped when it only says
    `...`), `a|b|c` once per alternative, CTX / KEY given values of their kind."""
    values = {"CTX": "8192", "KEY": "secret"}
    out = []
    for first, body in code_blocks(text, "bash"):
        for i, line in enumerate(body.splitlines()):
            line = re.sub(r"\[([^\]]*)\]", lambda m: "" if "..." in m.group(1) else m.group(1), line)
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&")
            lexer.whitespace_split, lexer.commenters = True, "#"
            words = list(lexer)
            commands = [list(g) for sep, g in itertools.groupby(words, lambda w: w in (";", "&&")) if not sep]
            for words in commands:
                if not words or words[0] != "deltaspec":
                    continue
                words = [values.get(w, w) for w in words[1:]]
                choices = [w.split("|") if "|" in w and not w.startswith("{") else [w] for w in words]
                out.extend((first + i, list(argv)) for argv in itertools.product(*choices))
    return out


def subparser(name: str):
    action = next(a for a in cli.build_parser()._actions if a.choices and name in a.choices)
    return action.choices[name]


def flags_of(name: str) -> set[str]:
    return set(subparser(name)._option_string_actions)


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def flags_in(cell: str) -> set[str]:
    """The flags a table cell shows in backticks (`-j/--json-schema` is two, `-ngl N` one)."""
    flags = set()
    for span in re.findall(r"`([^`]+)`", cell):
        for word in span.split():
            flags.update(f for f in word.split("/") if re.fullmatch(r"--?[a-zA-Z][\w-]*", f))
    return flags


def test_the_readme_has_what_these_tests_read():
    """Guards the extraction itself: with no blocks or rows found, every test below would pass."""
    text = readme()
    assert len(code_blocks(text, "python")) >= 1
    commands = command_lines(text)
    assert len({line for line, _ in commands}) >= 19, commands
    assert {argv[0] if argv else "" for _, argv in commands} >= {"run", "serve", "convert", "info", "synth", "--version"}
    assert len(table_rows(text, "| llama.cpp (`llama-cli`)")) >= 8
    assert len(table_rows(text, "| llama-server")) >= 8


def test_every_command_line_parses(capsys, tmp_path, monkeypatch):
    """Each command line the README shows, with each alternative it lists, parses as written; a
    `run` line also turns into the sampling, speculation and grammar options it would run with (its
    checks of which flags go together included; the files it names exist, empty, in a scratch folder)."""
    monkeypatch.chdir(tmp_path)
    for line, argv in command_lines(readme()):
        for word in argv:
            if word.endswith(".gguf"):
                Path(word).touch()
        if argv in ([], ["--version"]):  # bare: full help, exit 0; --version: exit 0 too
            with pytest.raises(SystemExit) as e:
                code = cli.main(argv)
                raise SystemExit(code)
            assert e.value.code in (0, None), f"README line {line}: deltaspec {shlex.join(argv)}"
            assert capsys.readouterr().out.strip()
            continue
        try:
            args = cli.build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"README line {line}: `deltaspec {shlex.join(argv)}` does not parse: "
                        f"{capsys.readouterr().err.strip()}")
        if argv[0] == "run":
            cli._sampling_kwargs(args), cli._spec_kwargs(args), cli._grammar_kwargs(args)


def test_llama_cpp_flags_the_tables_call_same():
    """"Coming from llama.cpp": every flag of a row whose deltaspec side says "same" is a flag of
    `run` / `serve`, every flag the deltaspec side names is one too, and the row of flags "refused
    by name" is refused, naming the flag."""
    text = readme()
    checked = 0
    for header, command in (("| llama.cpp (`llama-cli`)", "run"), ("| llama-server", "serve")):
        ours = flags_of(command)
        for theirs_cell, ours_cell in table_rows(text, header):
            claimed = flags_in(ours_cell) | (flags_in(theirs_cell) if ours_cell.startswith("same") else set())
            if ours_cell.startswith("refused"):
                for flag in flags_in(theirs_cell):
                    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
                        cli.build_parser().parse_args([command, "-m", "m.gguf", flag])
                    assert flag in err.getvalue(), (flag, err.getvalue())
                    checked += 1
                continue
            missing = claimed - ours
            assert not missing, f"README's {header} table row {theirs_cell!r}: not flags of `{command}`: {missing}"
            checked += len(claimed)
    assert checked >= 40, checked


@pytest.fixture(scope="module")
def chat_model(chat_gguf):
    with Model(chat_gguf, n_ctx=512, n_threads=1) as model:
        yield model


def test_the_python_example_runs(chat_gguf, capsys):
    """The README's first Python block, run as written on the tiny chat model on the CPU (its model
    path and device are the only words changed): every call and attribute it shows exists and
    returns what it prints."""
    (line, body), = code_blocks(readme(), "python")[:1]
    assert 'Model("Qwen3.5-9B-Q4_K_M.gguf"' in body and 'device="cuda"' in body, f"README line {line}"
    code = body.replace('"Qwen3.5-9B-Q4_K_M.gguf"', repr(str(chat_gguf))).replace('device="cuda"', 'device="cpu"')
    scope: dict = {}
    exec(compile(code, f"README.md:{line}", "exec"), scope)
    printed = capsys.readouterr().out
    assert scope["r"].finish_reason in ("stop", "length") and str(scope["r"].stats.tokens_per_second) in printed
    assert scope["logits"].ndim == 2 and scope["logits"].shape[1] == scope["model"].n_vocab


def test_the_names_it_tells_users_to_call_exist(chat_model):
    """`model.NAME`, the methods it lists as `name(...)`, `deltaspec.a.b` paths and the error classes
    it promises are all there: on a Model (or Llama), on Grammar, or on the engine for the calls it
    names as engine-level."""
    from deltaspec import _core

    text = readme()
    names = set(re.findall(r"\bmodel\.([a-z_]+)\b", text)) - {"gguf"}  # `model.gguf`: a file name
    assert len(names) >= 8, names
    for name in names:
        assert hasattr(chat_model, name), f"README names model.{name}"
    engine_level = {"verify_tree", "keep_path", "set_taps"}
    calls = set(re.findall(r"`([a-z_]+)\(", text))
    assert {"generate", "add_request", "step", "save_state", "json_object"} <= calls
    for name in calls:
        if name == "llm":  # llama-cpp-python's `llm(prompt, ...)`: a Llama is called
            assert "__call__" in dir(Llama), "README names llm(...)"
            continue
        where = _core.Engine if name in engine_level else Grammar if hasattr(Grammar, name) else chat_model
        assert hasattr(where, name) or (where is chat_model and hasattr(Llama, name)), f"README names {name}()"
    for dotted in set(re.findall(r"`(deltaspec(?:\.\w+)+)", text)):
        module, _, attr = dotted.rpartition(".")
        try:
            __import__(dotted)
        except ImportError:
            assert hasattr(__import__(module, fromlist=[attr]), attr), f"README names {dotted}"
    promised = set(re.findall(r"`(\w+Error)`", text)) - {"ValueError", "RuntimeError"}
    assert len(promised) >= 12, promised
    for name in promised:
        cls = getattr(errors, name, None)
        assert isinstance(cls, type) and issubclass(cls, (errors.DeltaspecError, ValueError)), f"README names {name}"


def test_the_server_routes_it_lists():
    """The llama-server table: each route of a row that says "same" is served, with the method it
    names (`/props` (GET)), and each route of the "not served" row is not (`POST /props`: not that
    method). The route table is read from the app itself, built without a model (no route runs)."""
    from types import SimpleNamespace

    from deltaspec.server.app import create_app

    served = {r.path: r.methods for r in create_app(SimpleNamespace(engine=None, served=None, api_key=None)).routes}
    checked = 0
    for theirs_cell, ours_cell in table_rows(readme(), "| llama-server"):
        spans = [s for s in re.findall(r"`([^`]+)`", theirs_cell) if re.match(r"(\w+ )?/", s)]
        for span in spans:
            method, _, path = span.rpartition(" ")
            named = re.search(re.escape(f"`{span}`") + r" \((GET|POST)\)", theirs_cell)
            method = method or (named.group(1) if named else "")
            if ours_cell.startswith("not served"):
                assert path not in served or (method and method not in served[path]), f"README: {span} not served"
            else:
                assert ours_cell.startswith("same"), (theirs_cell, ours_cell)
                assert path in served and (not method or method in served[path]), f"README: {span} served"
            checked += 1
    assert checked >= 15, checked


def test_the_files_it_cites_exist():
    """Every repository path README.md and bench/README.md cite (tests, benchmarks, sources, result
    files; `tests/test_x.py::test_y` down to the test function) is there."""
    root = README.parent
    cited = set()
    for doc in (README, root / "bench" / "README.md"):
        text = doc.read_text(encoding="utf-8")
        cited |= set(re.findall(r"(?<![\w/.])((?:tests|bench|csrc|ggml|python|deps)/[\w./*-]*[\w*/])(?:::(\w+))?", text))
        # bench/README.md names its result files relative to bench/results/
        cited |= {(f"bench/results/{p}", "") for p in re.findall(r"`((?:latest|archive)/[\w./-]+\.\w+)`", text)}
    assert len(cited) >= 60, len(cited)
    missing = [p for p, _ in cited if not list(root.glob(p.rstrip("/")))]
    assert not missing, f"cited but not in the repository: {sorted(missing)}"
    for path, function in cited:
        if function:
            assert re.search(rf"^def {function}\(", (root / path).read_text(encoding="utf-8"), re.M), f"{path}::{function}"
