"""Function calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the messages
that carry calls and their results, and the model's answer parsed back into `tool_calls`.

The wire format between the server and the model is Hermes' (Qwen2.5's and many others'):
tools listed as JSON inside `<tools></tools>`, each call as `{"name": ..., "arguments": {...}}`
inside `<tool_call></tool_call>`, each result inside `<tool_response></tool_response>`. A chat
template that handles tools itself (it names `tools`) gets them as transformers passes them;
for any other template the server writes that format into the messages.

`tool_choice`: "none" (no tools shown, plain text), "auto" (the model answers or calls; its
text is parsed for calls, as vLLM's hermes parser does), "required" (the output is constrained
to a JSON array of one or more calls), or a named function (the output is constrained to that
function's arguments).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from cbjax import StructuredOutput
from cbjax.serve.errors import bad, check_keys, utf8
from cbjax.serve.structured import check_schema

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # OpenAI's function objects: name, description, parameters
    choice: str  # "none", "auto", "required", or a function's name
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def parameters(self, name: str) -> dict:
        return next(f for f in self.functions if f["name"] == name).get("parameters") or {"type": "object"}

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")


def parse_tools(body: dict) -> Tools | None:
    """The request's tools (None without any, or with tool_choice "none" and none given)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", f"tools[{i}]")
        check_keys(tool, ("type", "function"), f"tools[{i}]")
        check_keys(function, ("name", "description", "parameters", "strict"), f"tools[{i}].function")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise bad(f"tools[{i}].function.parameters must be a JSON schema object",
                          f"tools[{i}].function.parameters")
            check_schema(parameters, f"tools[{i}].function.parameters")
        functions.append({k: function[k] for k in ("name", "description", "parameters") if k in function})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad("tool function names must be unique", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        choice = _named_choice(choice, names)
    elif choice not in ("none", "auto", "required"):
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                  "{'name': ...}}", "tool_choice")
    return Tools(tuple(functions), choice, parallel)


def _named_choice(choice: dict, names: list[str]) -> str:
    """The function a `tool_choice` object names (one of the tools)."""
    check_keys(choice, ("type", "function"), "tool_choice")
    if choice.get("type") != "function":
        raise bad(f"'tool_choice.type' must be 'function', got {choice.get('type')!r}", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad("'tool_choice.function' must be an object with a string 'name'", "tool_choice.function")
    check_keys(function, ("name",), "tool_choice.function")
    if function["name"] not in names:
        raise bad(f"'tool_choice' names no function among the tools: {function['name']!r}",
                  "tool_choice.function.name")
    return function["name"]


def constraint(tools: Tools | None) -> StructuredOutput | None:
    """What the output must match: a named function's arguments, or (required) a JSON array of calls."""
    if tools is None or not tools.constrained:
        return None
    if tools.choice != "required":
        return StructuredOutput(json=tools.parameters(tools.choice))
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": tools.parameters(n)},
              "required": ["name", "arguments"], "additionalProperties": False} for n in tools.names]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not tools.parallel:
        array["maxItems"] = 1
    return StructuredOutput(json=array)


def system_prompt(tools: Tools) -> str:
    listed = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools.functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each "
            "function call, return a json object with function name and arguments within <tool_call></tool_call> "
            'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _arguments(call: dict) -> dict | str:
    args = call["function"].get("arguments", "{}")
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return args


def render(messages: list[dict], tools: Tools | None, template: str) -> tuple[list[dict], list | None]:
    """Messages (and the `tools` argument) for the chat template. A template that names tools
    takes calls and results as they are (arguments as objects, as transformers' templates
    expect); for another, they become Hermes-format text in ordinary messages."""
    shown = tools if tools is not None and tools.choice != "none" else None
    if "tool" in template:
        out = [dict(m, tool_calls=[{"type": "function", "id": c.get("id"), "function": {
            "name": c["function"]["name"], "arguments": _arguments(c)}} for c in m["tool_calls"]])
               if m.get("tool_calls") else m for m in messages]
        return out, ([{"type": "function", "function": f} for f in shown.functions] if shown else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if shown:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system_prompt(shown)}
        else:
            out.insert(0, {"role": "system", "content": system_prompt(shown)})
    return out, None


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def parse_output(tools: Tools, text: str) -> tuple[str | None, list[dict]]:
    """A choice's `(content, tool_calls)`: under a named choice the text is the arguments;
    under "required" a JSON array of calls; under "auto" the `<tool_call>` blocks naming a
    known function (anything else stays content)."""
    if tools.choice == "none":
        return text, []
    if tools.choice not in ("auto", "required"):
        return None, [_call(tools.choice, text)]
    if tools.choice == "required":
        try:
            calls = json.loads(text)
            return None, [_call(c["name"], c["arguments"]) for c in calls]
        except (json.JSONDecodeError, TypeError, KeyError):
            return text, []  # cut off by max_tokens: the text as it is, finish_reason "length"
    calls, kept = [], text
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in tools.names and isinstance(call.get("arguments", {}), dict):
            calls.append(_call(call["name"], call.get("arguments", {})))
            kept = kept.replace(match.group(0), "", 1)
    return (kept.strip() or None) if calls else text, calls


MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


def messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a string 'role'", where)
        check_keys(m, MESSAGE_FIELDS, where)
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}: role {m['role']!r} is not supported", f"{where}.role")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"{where}.name must be a string", f"{where}.name")
        calls = m.get("tool_calls") if m["role"] == "assistant" else None
        if m.get("tool_calls") is not None and m["role"] != "assistant":
            raise bad(f"{where}.tool_calls: only an assistant message carries calls", f"{where}.tool_calls")
        message = {"role": "system" if m["role"] == "developer" else m["role"],
                   "content": _content(m.get("content"), where) if m.get("content") is not None or not calls else None}
        if calls:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if m.get("tool_call_id") is not None:
            if m["role"] != "tool" or not isinstance(m["tool_call_id"], str):
                raise bad(f"{where}.tool_call_id must be a string, on a tool message", f"{where}.tool_call_id")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list of function calls", where)
    for j, c in enumerate(calls):
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict) \
                or not isinstance(c["function"].get("name"), str):
            raise bad(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}",
                      f"{where}[{j}]")
        check_keys(c, ("id", "type", "function"), f"{where}[{j}]")
        check_keys(c["function"], ("name", "arguments"), f"{where}[{j}].function")
        if not isinstance(c["function"].get("arguments", "{}"), (str, dict)):
            raise bad(f"{where}[{j}].function.arguments must be a JSON text or an object",
                      f"{where}[{j}].function.arguments")
    return calls


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return utf8(content, f"{where}.content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}",
                          f"{where}.content[{j}]")
            check_keys(part, ("type", "text"), f"{where}.content[{j}]")
        return utf8("".join(p["text"] for p in content), f"{where}.content")
    raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
