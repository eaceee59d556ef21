"""The OpenAI wire format: request bodies checked into jobs, and response bodies.

Every check raises `APIError`, which the front turns into OpenAI's error body, so a bad
field is a 4xx naming the field, never a crash. Fields OpenAI defines that the engine
cannot honour (n > 1, logprobs, penalties, tools ...) are refused rather than ignored:
a benchmark that asked for them would otherwise measure something else.
vLLM's extensions `top_k`, `ignore_eos`, `stop_token_ids` and `min_tokens=0` are accepted.
Responses carry `token_ids` in each choice (an extension; standard clients ignore it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import uuid

from cbjax.request import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
                500: "internal_server_error"}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclasses.dataclass
class Job:
    """One API call: one or more prompts (token ids) sampled alike."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self.kind == "completion" else "chatcmpl"


# -------------------------------------------------------------------- body
def dumps(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False)


MAX_INT_DIGITS = 40  # a 128-bit integer has 39 digits; no field needs more


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise bad(f"an integer of {len(text)} digits is out of range (at most {MAX_INT_DIGITS})")
    return int(text)


def parse_body(raw: bytes) -> dict:
    """The request body as JSON. Whatever the parser cannot take is a 400: invalid JSON or
    UTF-8, nesting past the interpreter's recursion limit, integers past `MAX_INT_DIGITS`
    (Python refuses to convert more than 4300 digits, and no field needs them)."""
    try:
        return json.loads(raw, parse_int=_bounded_int)
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise bad(f"the request body is not valid JSON: {e}") from None


def _utf8(text: str, param: str) -> str:
    """Text the tokenizer can take: JSON may carry a lone surrogate (\\ud800), which no UTF-8
    encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{param}' is not valid Unicode: {e.reason} at character {e.start}", param) from None
    return text


@functools.cache
def _longest_token_chars(tokenizer) -> int:
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def check_text_length(chars: int, tokenizer, max_len: int, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit: each token covers at most the longest
    vocabulary entry's characters, so more than `max_len` times that is more than `max_len`
    tokens. Tokenizing a 7 MB prompt only to refuse it held 1-2 GB of memory for seconds."""
    most = max_len * _longest_token_chars(tokenizer)
    if chars > most:
        raise bad(f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                  f"{chars} characters, more than {max_len} tokens can hold ({most}).", param)


# ------------------------------------------------------------------ fields
def get_field(body: dict, name: str, kinds, default=None, allow_none: bool = True):
    value = body.get(name, default)
    if value is None:
        if not allow_none:
            raise bad(f"'{name}' is required", name)
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise bad(f"'{name}' must be {names}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{name}' must be finite", name)
    return value


def _refuse_unless(body: dict, name: str, ok) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise bad(f"'{name}'={body[name]!r} is not supported by this server", name)


def _stop_fields(body: dict, tokenizer) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise bad("'stop' must be a string or a list of at most 16 strings", "stop")
    stop = [_utf8(s, "stop") for s in stop]
    if any(stop) and tokenizer is None:
        raise bad("this model has no tokenizer: stop strings cannot be matched (use stop_token_ids)", "stop")
    ids = get_field(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    return tuple(s for s in stop if s), tuple(ids)


def _sampling(body: dict, max_tokens: int, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    numbers = (int, float)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(get_field(body, "temperature", numbers, 1.0)),
            top_p=float(get_field(body, "top_p", numbers, 1.0)),
            top_k=_top_k(get_field(body, "top_k", (int,), 0)),
            seed=get_field(body, "seed", (int,)),
            stop_token_ids=stop_token_ids,
            ignore_eos=get_field(body, "ignore_eos", (bool,), False))
    except ValueError as e:
        raise bad(str(e)) from None


def _top_k(value: int) -> int:
    return 0 if value == -1 else value  # vLLM spells "off" as -1


def _common_refusals(body: dict) -> None:
    _refuse_unless(body, "n", lambda v: v == 1)
    _refuse_unless(body, "best_of", lambda v: v == 1)
    _refuse_unless(body, "logprobs", lambda v: v is False)
    _refuse_unless(body, "top_logprobs", lambda v: v == 0)
    _refuse_unless(body, "frequency_penalty", lambda v: v == 0)
    _refuse_unless(body, "presence_penalty", lambda v: v == 0)
    _refuse_unless(body, "repetition_penalty", lambda v: v == 1)
    _refuse_unless(body, "logit_bias", lambda v: v == {})
    _refuse_unless(body, "min_tokens", lambda v: v == 0)


def _stream_options(body: dict, stream: bool) -> bool:
    options = get_field(body, "stream_options", (dict,))
    if options is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return bool(get_field(options, "include_usage", (bool,), False))


def _max_tokens(body: dict, prompt_len: int, max_len: int, default: int | None) -> int:
    value = get_field(body, "max_completion_tokens", (int,))
    if value is None:
        value = get_field(body, "max_tokens", (int,))
    room = max_len - prompt_len
    if room < 1:
        raise bad(f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                  f"{prompt_len} tokens, which leaves no room for a completion.", "prompt")
    if value is None:
        value = min(default, room) if default is not None else room
    if value < 1:
        raise bad(f"max_tokens must be at least 1, got {value}", "max_tokens")
    if prompt_len + value > max_len:
        raise bad(f"This model's maximum context length is {max_len} tokens. However, you requested "
                  f"{prompt_len + value} tokens ({prompt_len} in the prompt, {value} for the completion). "
                  f"Please reduce the length of the prompt or the completion.", "max_tokens")
    return value


def require_object(body) -> dict:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def check_model(body: dict, served: str) -> str:
    model = get_field(body, "model", (str,), allow_none=False)
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served}'", "model",
                       code="model_not_found")
    return model


# ----------------------------------------------------------------- parsers
def parse_completion(body: dict, served: str, tokenizer, max_len: int) -> Job:
    """`/v1/completions`: `prompt` is a string, a list of strings, a list of token ids or a
    list of lists of token ids; each prompt is a choice."""
    model = check_model(require_object(body), served)
    _common_refusals(body)
    _refuse_unless(body, "echo", lambda v: v is False)
    _refuse_unless(body, "suffix", lambda v: v == "")
    prompts = prompt_list(body.get("prompt"))
    if len(prompts) > 64:
        raise bad("at most 64 prompts per request", "prompt")
    prompts = [prompt_ids(p, tokenizer, max_len) for p in prompts]
    stream = get_field(body, "stream", (bool,), False)
    stop, stop_ids = _stop_fields(body, tokenizer)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(body, longest, max_len, COMPLETIONS_DEFAULT_MAX_TOKENS)
    return Job("completion", model, prompts, _sampling(body, max_tokens, stop_ids), stream,
               _stream_options(body, stream), stop)


def prompt_list(prompt) -> list:
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, (str, list)) for p in prompt):
            return prompt
    raise bad("'prompt' must be a non-empty string, list of strings, list of token ids or list of lists "
              "of token ids", "prompt")


def prompt_ids(prompt, tokenizer, max_len: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad("empty prompt", "prompt")
        if tokenizer is None:
            raise bad("this model has no tokenizer: send prompts as token ids", "prompt")
        check_text_length(len(_utf8(prompt, "prompt")), tokenizer, max_len, "prompt")
        return [int(t) for t in tokenizer(prompt)["input_ids"]]
    if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise bad("a token-id prompt must be a non-empty list of integers", "prompt")
    return list(prompt)


def parse_chat(body: dict, served: str, tokenizer, max_len: int) -> Job:
    """`/v1/chat/completions`: the messages through the tokenizer's chat template."""
    model = check_model(require_object(body), served)
    _common_refusals(body)
    _refuse_unless(body, "tools", lambda v: v == [])
    _refuse_unless(body, "tool_choice", lambda v: v == "none")
    _refuse_unless(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text")
    messages = _messages(body.get("messages"))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad("this model has no chat template: use /v1/completions", "messages")
    check_text_length(sum(len(m["content"]) for m in messages), tokenizer, max_len, "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as e:  # a template may reject roles or orderings
        raise bad(f"the chat template rejected these messages: {e}", "messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = [int(t) for t in ids]
    stream = get_field(body, "stream", (bool,), False)
    stop, stop_ids = _stop_fields(body, tokenizer)
    max_tokens = _max_tokens(body, len(ids), max_len, None)
    return Job("chat", model, [ids], _sampling(body, max_tokens, stop_ids), stream,
               _stream_options(body, stream), stop)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise bad(f"messages[{i}]: role {m['role']!r} is not supported", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"],
                    "content": _content(m.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return _utf8(content, "messages")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _utf8("".join(p["text"] for p in content), "messages")
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


# --------------------------------------------------------------- responses
def new_id(job: Job) -> str:
    return f"{job.id_prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(job: Job, response_id: str, choices: list[dict], usage_body: dict) -> dict:
    """A whole (non-streamed) response; `choices` as from `choice(...)`."""
    kind = "text_completion" if job.kind == "completion" else "chat.completion"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": choices, "usage": usage_body}


def choice(job: Job, index: int, text: str, reason: str | None, token_ids: list[int]) -> dict:
    if job.kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason, "token_ids": token_ids}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason, "token_ids": token_ids}


def chunk(job: Job, response_id: str, index: int, text: str | None, reason: str | None,
          token_ids: list[int], first: bool = False) -> dict:
    """One streamed event for one choice."""
    if job.kind == "completion":
        body = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason,
                "token_ids": token_ids}
        kind = "text_completion"
    else:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        body = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason,
                "token_ids": token_ids}
        kind = "chat.completion.chunk"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": [body]}


def usage_chunk(job: Job, response_id: str, usage_body: dict) -> dict:
    kind = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": job.model,
            "choices": [], "usage": usage_body}
