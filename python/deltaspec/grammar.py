"""Grammars for structured output: what `generate(grammar=...)`, `create_completion(grammar=...)` and
`create_chat_completion(response_format=...)` accept, compiled to llguidance's grammar format.

llguidance (PyPI `llguidance`, the Rust engine llama.cpp also builds in as LLAMA_LLGUIDANCE) does
the parsing and the token masks; this module only turns the user's spelling into its input:

- a string is a grammar in llama.cpp's GBNF (`root ::= ...`), or in llguidance's Lark dialect
  when it defines `start:` or begins with `%llguidance` (llama.cpp's marker for Lark grammars);
- `Grammar.from_json_schema(schema)`, `Grammar.from_regex(pattern)`, `Grammar.json_object()`;
- `Grammar.from_string` / `Grammar.from_file` / `Grammar.from_json_schema` also carry
  llama-cpp-python's `LlamaGrammar` names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import GrammarError

# JSON whitespace between tokens: free, as JSON allows, but bounded, so that a model that keeps
# choosing whitespace still ends (llama.cpp's JSON grammars bound it the same way). A schema whose
# "x-guidance" options set whitespace_flexible or whitespace_pattern gets those instead
# ({"whitespace_flexible": false}: compact JSON, as json.dumps(..., separators=(",", ":"))).
JSON_DEFAULTS = {"whitespace_pattern": r"[ \t\n]{0,20}"}


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise ImportError("structured output needs the 'llguidance' package (pip install llguidance)") from e
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text. `spec` is llguidance's grammar (a JSON string), `source`
    says what it was made from (for messages). `free_reasoning`: the grammar leaves an open <think>
    block's text free (a tool-call grammar's, deltaspec.tool_call_grammar), so a reasoning budget
    can close it early. `after_token`: the grammar applies from the first time the model writes
    this token, its own first (llama.cpp's lazy grammar and its trigger; deltaspec.lazy_grammar);
    before it every token is allowed."""

    spec: str
    source: str
    free_reasoning: bool = False
    after_token: str | None = None

    def __post_init__(self) -> None:
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self.spec)
        if is_error:
            raise GrammarError(f"invalid {self.source}: {messages[0] if messages else 'rejected by llguidance'}")

    @classmethod
    def from_string(cls, text: str) -> "Grammar":
        """GBNF (llama.cpp's grammar format) or llguidance's Lark (a `start:` rule or `%llguidance`)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"a grammar must be a non-empty string (GBNF or Lark), got {text!r:.80}")
        llg = _llguidance()
        try:
            spec = llg.grammar_from("grammar", text)
        except ValueError as e:  # the GBNF -> Lark conversion names the rule or position
            raise GrammarError(f"invalid grammar: {e}") from None
        return cls(spec, "grammar")

    from_gbnf = from_string

    @classmethod
    def from_lark(cls, text: str) -> "Grammar":
        """llguidance's Lark dialect (docs/syntax.md of llguidance): `start: ...`."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"a Lark grammar must be a non-empty string, got {text!r:.80}")
        return cls(_llguidance().LLMatcher.grammar_from_lark(text), "Lark grammar")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "Grammar":
        """A GBNF or Lark grammar file (llama.cpp's --grammar-file)."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise GrammarError(f"cannot read grammar file {os.fspath(path)}: {e.strerror}") from None
        try:
            return cls.from_string(text)
        except GrammarError as e:
            raise GrammarError(f"{os.fspath(path)}: {e}") from None

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, Any] | str | bool) -> "Grammar":
        """JSON text that validates against `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"a JSON schema must be an object (dict), got {type(schema).__name__} {schema!r:.80}")
        own = schema.get("x-guidance", {}) if isinstance(schema, Mapping) else {}
        # a schema that says how it wants whitespace (whitespace_flexible, whitespace_pattern) gets it
        defaults = None if isinstance(own, Mapping) and any(k.startswith("whitespace") for k in own) else JSON_DEFAULTS
        try:
            spec = _llguidance().LLMatcher.grammar_from_json_schema(dict(schema) if isinstance(schema, Mapping)
                                                                  else schema, defaults=defaults)
        except (TypeError, ValueError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return cls(spec, "JSON schema")

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (response_format {"type": "json_object"})."""
        return cls.from_json_schema({"type": "object"})

    @classmethod
    def from_regex(cls, pattern: str) -> "Grammar":
        """Text matching the regular expression (Rust `regex` syntax), as a whole."""
        if not isinstance(pattern, str):
            raise GrammarError(f"a regex must be a string, got {type(pattern).__name__} {pattern!r:.80}")
        return cls(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")


def grammar_of(grammar: Grammar | str | None) -> Grammar | None:
    """generate()'s `grammar` argument as a Grammar (a string is GBNF or Lark)."""
    if grammar is None or isinstance(grammar, Grammar):
        return grammar
    if isinstance(grammar, str):
        return Grammar.from_string(grammar)
    raise TypeError(f"grammar must be a deltaspec.Grammar, a GBNF / Lark string or None, got "
                    f"{type(grammar).__name__} {grammar!r:.80}")


def response_format_grammar(response_format: Mapping[str, Any] | None) -> Grammar | None:
    """The grammar of an OpenAI `response_format`: {"type": "text"} (none), {"type": "json_object"}
    (with llama-cpp-python's optional "schema"), or {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}}."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError(f"response_format must be a dict such as {{'type': 'json_object'}}, got "
                           f"{type(response_format).__name__} {response_format!r:.80}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return Grammar.json_object() if schema is None else Grammar.from_json_schema(schema)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise GrammarError("response_format of type 'json_schema' needs 'json_schema': {'name': ..., "
                               f"'schema': {{...}}}}, got {spec!r:.80}")
        return Grammar.from_json_schema(spec["schema"])
    raise GrammarError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
