"""Structured-output request fields into one `StructuredOutput`: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and `structured_outputs`. At most one may constrain a request; a malformed
one is a 400 naming the field (the grammar itself is checked by llguidance when the request
is parsed, cbjax/grammar.py)."""

from __future__ import annotations

import json

from cbjax.request import StructuredOutput
from cbjax.serve.errors import bad

STRUCTURED_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                               "structured_outputs"})


def _response_format(value) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("'response_format.json_schema' must be an object whose 'schema' is a JSON schema object",
                      "response_format")
        # OpenAI's "strict" asks for what a grammar does anyway: every answer matches the schema.
        return StructuredOutput(json=spec.get("schema", {}))
    raise bad(f"'response_format' type {kind!r} is not supported (text, json_object, json_schema)",
              "response_format")


def _grammar(text: str, param: str) -> str:
    """vLLM's guided_grammar: Lark (llguidance's dialect), or GBNF (llama.cpp's, as vLLM's xgrammar
    backend takes it) converted to Lark."""
    if not isinstance(text, str) or not text.strip():
        raise bad(f"'{param}' must be a non-empty grammar string", param)
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
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise bad("'guided_json' must be a JSON schema (an object or its text)", name)
            return StructuredOutput(json=value)
        if name == "guided_regex":
            if not isinstance(value, str):
                raise bad("'guided_regex' must be a string", name)
            return StructuredOutput(regex=value)
        if name == "guided_choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise bad("'guided_choice' must be a non-empty list of strings", name)
            return StructuredOutput(choice=tuple(value))
        if name == "guided_grammar":
            return StructuredOutput(grammar=_grammar(value, name))
        if not isinstance(value, dict):  # structured_outputs: vLLM's newer spelling, one of its keys
            raise bad("'structured_outputs' must be an object", name)
        known = {"json", "regex", "choice", "grammar", "json_object"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise bad(f"'structured_outputs' key {unknown[0]!r} is not supported ({', '.join(sorted(known))})", name)
        if isinstance(value.get("json"), str):
            value = dict(value, json=json.loads(value["json"]))
        if "grammar" in value:
            value = dict(value, grammar=_grammar(value["grammar"], name))
        return StructuredOutput(**value)
    except json.JSONDecodeError as e:
        raise bad(f"'{name}' is not valid JSON: {e}", name) from None
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
