"""JSON schemas a random-weight model can finish under a grammar: numbers in ranges, bounded strings
and arrays, enums, nesting, a union (the structured-output tests and bench/grammar_draft_bench.py)."""

BOUNDED_SCHEMAS = {
    "record": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"], "additionalProperties": False},
    "lists": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}},
        "required": ["name", "scores"], "additionalProperties": False},
    "nested": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {
            "k": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -5, "maximum": 5}]}},
        "required": ["k", "v"], "additionalProperties": False}},
    "text": {"type": "object", "properties": {"text": {"type": "string", "maxLength": 40}},
             "required": ["text"], "additionalProperties": False},
}
