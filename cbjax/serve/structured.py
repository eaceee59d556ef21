"""Structured-output request fields into one `StructuredOutput`: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and `structured_outputs`. At most one may constrain a request; a malformed
one is a 400 naming the field (the grammar itself is checked by llguidance when the request
is parsed, cbjax/grammar.py)."""

from __future__ import annotations

import json

from cbjax import StructuredOutput
from cbjax.serve.errors import bad, check_keys

STRUCTURED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                               "structured_outputs"})
MAX_SCHEMA_DEPTH = 64  # levels of objects and lists in a JSON schema (llguidance recurses over them)
MAX_CONSTRAINT_CHARS = 100_000  # a schema's, regex's or grammar's text
INT64 = 2 ** 63  # an integer answer is read as a 64-bit integer: bounds past it cannot be honoured
_INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _is_integer_type(kind) -> bool:
    return kind == "integer" or isinstance(kind, list) and "integer" in kind


def check_schema(schema, path: str) -> None:
    """Refuse (400 naming the JSON path of the offending part) a JSON schema nested deeper than
    `MAX_SCHEMA_DEPTH` or with integer bounds outside 64 bits (llguidance clamps them, and the
    answer would then break its own schema). Walked without recursion."""
    stack = [(schema, path, 0)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad(f"'{path}' is nested more than {MAX_SCHEMA_DEPTH} levels deep (at '{where}')", where)
        if isinstance(node, dict):
            if _is_integer_type(node.get("type")):
                for key in _INTEGER_BOUNDS:
                    bound = node.get(key)
                    if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not -INT64 <= bound < INT64:
                        raise bad(f"'{where}.{key}' = {bound!r} is outside the 64-bit integers an answer can hold",
                                  f"{where}.{key}")
            stack += [(v, f"{where}.{k}", depth + 1) for k, v in node.items() if isinstance(v, (dict, list))]
        elif isinstance(node, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node) if isinstance(v, (dict, list))]


def json_schema(value, path: str) -> dict:
    """A JSON schema given as an object or as its text, checked (`check_schema`)."""
    if isinstance(value, str):
        _bounded_text(value, path)
        try:
            value = json.loads(value)
        except RecursionError:
            raise bad(f"'{path}' is nested too deeply", path) from None
        except json.JSONDecodeError as e:
            raise bad(f"'{path}' is not valid JSON: {e}", path) from None
    if not isinstance(value, dict):
        raise bad(f"'{path}' must be a JSON schema (an object or its text)", path)
    check_schema(value, path)
    return value


def _bounded_text(text, path: str) -> str:
    if not isinstance(text, str):
        raise bad(f"'{path}' must be a string", path)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise bad(f"'{path}' has {len(text)} characters, more than {MAX_CONSTRAINT_CHARS}", path)
    return text


def _response_format(value) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'", "response_format")
    check_keys(value, ("type", "json_schema"), "response_format")
    kind = value["type"]
    if kind in ("text", "json_object") and value.get("json_schema") is not None:
        raise bad(f"'response_format.json_schema' goes with type 'json_schema', not {kind!r}",
                  "response_format.json_schema")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("'response_format.json_schema' must be an object whose 'schema' is a JSON schema object",
                      "response_format.json_schema")
        check_keys(spec, ("name", "description", "schema", "strict"), "response_format.json_schema")
        # OpenAI's "strict" asks for what a grammar does anyway: every answer matches the schema.
        return StructuredOutput(json=json_schema(spec.get("schema", {}), "response_format.json_schema.schema"))
    raise bad(f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)",
              "response_format.type")


def _grammar(text: str, param: str) -> str:
    """vLLM's guided_grammar: Lark (llguidance's dialect), or GBNF (llama.cpp's, as vLLM's xgrammar
    backend takes it) converted to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise bad(f"'{param}' must be a non-empty grammar string", param)
    _bounded_text(text, param)
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except Exception as e:  # the converter's own parse errors
        raise bad(f"'{param}': not a valid GBNF grammar: {e}", param) from None


def _one(name: str, value) -> StructuredOutput | None:
    if name == "response_format":
        return _response_format(value)
    try:
        if name == "guided_json":
            return StructuredOutput(json=json_schema(value, name))
        if name == "guided_regex":
            return StructuredOutput(regex=_bounded_text(value, name))
        if name == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise bad("'guided_choice' must be a non-empty list of strings", name)
            _bounded_text("".join(value), name)
            return StructuredOutput(choice=tuple(value))
        if name == "guided_grammar":
            return StructuredOutput(grammar=_grammar(value, name))
        if not isinstance(value, dict):  # structured_outputs: vLLM's newer spelling, one of its keys
            raise bad("'structured_outputs' must be an object", name)
        check_keys(value, ("json", "regex", "choice", "grammar", "json_object"), name)
        if value.get("json") is not None:
            value = dict(value, json=json_schema(value["json"], f"{name}.json"))
        if value.get("regex") is not None:
            _bounded_text(value["regex"], f"{name}.regex")
        if value.get("grammar") is not None:
            value = dict(value, grammar=_grammar(value["grammar"], f"{name}.grammar"))
        return StructuredOutput(**value)
    except (ValueError, TypeError) as e:
        raise bad(f"'{name}': {e}", name) from None


def structured_output(body: dict) -> tuple[StructuredOutput | None, str | None]:
    """The request's constraint and the field that set it, or (None, None); a 400 when two
    fields both constrain it."""
    found = [(out, name) for name in sorted(STRUCTURED_FIELDS)
             if body.get(name) is not None and (out := _one(name, body[name])) is not None]
    if len(found) > 1:
        raise bad(f"at most one structured-output field per request, got {', '.join(n for _, n in found)}",
                  found[1][1])
    return found[0] if found else (None, None)
