"""The OpenAI wire format: request bodies checked into jobs, and response bodies.

Every check raises `APIError`, which the front turns into OpenAI's error body, so a bad
field is a 4xx naming the field, never a crash. Fields OpenAI defines that the engine
cannot honour (suffix, streamed prompt logprobs ...) are refused rather than ignored: a benchmark
that asked for them would otherwise measure something else. Each route's honoured fields
are listed below (`COMPLETION_FIELDS`, `CHAT_FIELDS`); structured output's are read by
serve/structured.py, function calling's and the messages by serve/tools.py. Responses carry `token_ids` in each choice (an
extension; standard clients ignore it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from cbjax import SamplingParams
from cbjax.serve import tools as tool_calls
from cbjax.serve.errors import APIError, bad, check_keys, utf8 as _utf8  # noqa: F401 (APIError re-exported)
from cbjax.serve.structured import STRUCTURED_FIELDS, structured_output
from cbjax.serve.tools import Tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


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
    echo: bool = False  # completions: the prompt's text before each choice's
    priority: int = 0  # vLLM's extra field: lower values first under --ordering=priority/score
    tools: Tools | None = None  # chat's function calling (serve/tools.py)
    structured_field: str | None = None  # the request field that constrains the output, for its errors
    prompt_logprobs: int | None = None  # vLLM's field: each choice carries its prompt's top-k per position
    logprobs_field: str = "logprobs"  # the field that asked for logprobs' k (chat's top_logprobs), for its errors
    lora: str | None = None  # the LoRA adapter `model` names (None: the base model)

    def field_name(self, field: str) -> str:
        """A sampling field as this request spelled it."""
        return self.logprobs_field if field == "logprobs" else field

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.sampling.n

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
def get_field(body: dict, name: str, kinds, default=None, allow_none: bool = True, within: str | None = None):
    """`body[name]` checked to be one of `kinds`; `within`: the JSON path of `body` in the request."""
    value = body.get(name, default)
    path = f"{within}.{name}" if within else name
    if value is None:
        if not allow_none:
            raise bad(f"'{path}' is required", path)
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise bad(f"'{path}' must be {names}, got {type(value).__name__}", path)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"'{path}' must be finite", path)
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


def _sampling(body: dict, max_tokens: int, stop_token_ids: tuple[int, ...], logprobs: int | None,
              structured=None, prompt_logprobs: int | None = None, logprobs_field: str = "logprobs") -> SamplingParams:
    numbers = (int, float)
    n = get_field(body, "n", (int,), 1)
    best_of = get_field(body, "best_of", (int,))
    if best_of is not None and best_of > n and body.get("stream"):
        raise bad("'best_of' greater than 'n' cannot stream", "best_of")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(get_field(body, "temperature", numbers, 1.0)),
            top_p=float(get_field(body, "top_p", numbers, 1.0)),
            min_p=float(get_field(body, "min_p", numbers, 0.0)),
            top_k=_top_k(get_field(body, "top_k", (int,), 0)),
            seed=get_field(body, "seed", (int,)),
            stop_token_ids=stop_token_ids,
            ignore_eos=get_field(body, "ignore_eos", (bool,), False),
            min_tokens=min(get_field(body, "min_tokens", (int,), 0), max_tokens),
            presence_penalty=float(get_field(body, "presence_penalty", numbers, 0.0)),
            frequency_penalty=float(get_field(body, "frequency_penalty", numbers, 0.0)),
            repetition_penalty=float(get_field(body, "repetition_penalty", numbers, 1.0)),
            logit_bias=_logit_bias(body),
            logprobs=logprobs, n=n, best_of=best_of, structured=structured, prompt_logprobs=prompt_logprobs)
    except ValueError as e:  # SamplingParams' checks name the field (checks.FieldError)
        field = getattr(e, "field", None)
        raise bad(str(e), logprobs_field if field == "logprobs" else field) from None


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids as JSON object keys (strings), biases as numbers."""
    bias = get_field(body, "logit_bias", (dict,), {})
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 10) or \
                isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("'logit_bias' must map token ids to numbers", "logit_bias")
        out[int(key)] = float(value)
    return out


def _priority(body: dict) -> int:
    value = get_field(body, "priority", (int,), 0)
    if not -2 ** 31 <= value < 2 ** 31:
        raise bad(f"'priority' must be an integer in [-2^31, 2^31), got {value}", "priority")
    return value


def _top_k(value: int) -> int:
    return 0 if value == -1 else value  # vLLM spells "off" as -1


# Every field a route reads. Any other field is refused by name: one silently dropped
# (vLLM's guided_json, say) would let a benchmark that sends it measure something else.
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_k", "min_p", "ignore_eos",
    "stop_token_ids", "min_tokens", "repetition_penalty", "priority", "prompt_logprobs"}) | STRUCTURED_FIELDS
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                  "parallel_tool_calls"}
# Accepted and ignored, with the reason.
IGNORED_FIELDS = {"user": "an end-user id for a provider's abuse monitoring; nothing here reads it"}


def check_fields(body: dict, allowed: frozenset) -> None:
    """Refuse (400, naming it) a field the route does not read and does not ignore on purpose."""
    for name in body:
        if name not in allowed and name not in IGNORED_FIELDS:
            raise bad(f"'{name}' is not a field this server honours (docs/server.md lists them)", name)


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: the top k at each prompt position (0: the prompt token's alone)."""
    value = get_field(body, "prompt_logprobs", (int,))
    if value is not None and value < 0:
        raise bad(f"'prompt_logprobs' must be at least 0, got {value}", "prompt_logprobs")
    if value is not None and stream:
        raise bad("'prompt_logprobs' is not supported when streaming", "prompt_logprobs")
    return value


def _structured(body: dict, tools: Tools | None = None):
    """The output's constraint and the field that set it: a structured-output field, or the tools'."""
    structured, field = structured_output(body)
    forced = tool_calls.constraint(tools)
    if forced is not None and structured is not None:
        raise bad("'tool_choice' that forces a call cannot be combined with a structured-output field",
                  "tool_choice")
    return (forced, "tool_choice") if forced is not None else (structured, field)


def _completion_logprobs(body: dict) -> int | None:
    value = get_field(body, "logprobs", (int,))
    if value is not None and value < 0:
        raise bad(f"'logprobs' must be at least 0, got {value}", "logprobs")
    return value


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` and `top_logprobs: k` (k needs logprobs)."""
    wanted = get_field(body, "logprobs", (bool,), False)
    top = get_field(body, "top_logprobs", (int,))
    if top is not None and not wanted:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top is not None and top < 0:
        raise bad(f"'top_logprobs' must be at least 0, got {top}", "top_logprobs")
    return (top or 0) if wanted else None


def _stream_options(body: dict, stream: bool) -> bool:
    options = get_field(body, "stream_options", (dict,))
    if options is None:
        return False
    check_keys(options, ("include_usage",), "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return bool(get_field(options, "include_usage", (bool,), False, within="stream_options"))


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


def check_model(body: dict, served) -> str:
    """The body's `model`: one of `served` (a name, or the base model's name and then its LoRA
    adapters'), else a 404 in OpenAI's shape."""
    model = get_field(body, "model", (str,), allow_none=False)
    names = (served,) if isinstance(served, str) else tuple(served)
    if model not in names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves "
                       f"{', '.join(repr(n) for n in names)}", "model", code="model_not_found")
    return model


def lora_of(model: str, served) -> str | None:
    """The LoRA adapter a checked `model` names (None: the base model, `served`'s first name)."""
    return None if isinstance(served, str) or model == served[0] else model


# ----------------------------------------------------------------- parsers
def parse_completion(body: dict, served: str, tokenizer, max_len: int) -> Job:
    """`/v1/completions`: `prompt` is a string, a list of strings, a list of token ids or a
    list of lists of token ids; each prompt is a choice."""
    model = check_model(require_object(body), served)
    check_fields(body, COMPLETION_FIELDS)
    _refuse_unless(body, "suffix", lambda v: v == "")
    echo = get_field(body, "echo", (bool,), False)
    logprobs = _completion_logprobs(body)
    stream = get_field(body, "stream", (bool,), False)
    if echo and logprobs is not None and stream:
        raise bad("'echo' with 'logprobs' (the prompt's log-probabilities) is not supported when streaming", "echo")
    asked = _prompt_logprobs(body, stream)
    # echo with logprobs: the prompt's tokens scored as the output's are (OpenAI's legacy format).
    prompt_k = max(asked or 0, logprobs) if echo and logprobs is not None else asked
    prompts = prompt_list(body.get("prompt"))
    if len(prompts) > 64:
        raise bad("at most 64 prompts per request", "prompt")
    prompts = [prompt_ids(p, tokenizer, max_len) for p in prompts]
    stop, stop_ids = _stop_fields(body, tokenizer)
    longest = max(len(p) for p in prompts)
    max_tokens = _max_tokens(body, longest, max_len, COMPLETIONS_DEFAULT_MAX_TOKENS)
    structured, field = _structured(body)
    return Job("completion", model, prompts, _sampling(body, max_tokens, stop_ids, logprobs, structured, prompt_k),
               stream, _stream_options(body, stream), stop, echo, _priority(body), structured_field=field,
               prompt_logprobs=asked, lora=lora_of(model, served))


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
    check_fields(body, CHAT_FIELDS)
    tools = tool_calls.parse_tools(body)
    messages = tool_calls.messages(body.get("messages"))
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad("this model has no chat template: use /v1/completions", "messages")
    messages, template_tools = tool_calls.render(messages, tools, str(tokenizer.chat_template))
    check_text_length(sum(len(str(m.get("content") or "")) for m in messages), tokenizer, max_len, "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=template_tools, add_generation_prompt=True)
    except Exception as e:  # a template may reject roles or orderings
        raise bad(f"the chat template rejected these messages: {e}", "messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = [int(t) for t in ids]
    stream = get_field(body, "stream", (bool,), False)
    stop, stop_ids = _stop_fields(body, tokenizer)
    max_tokens = _max_tokens(body, len(ids), max_len, None)
    structured, field = _structured(body, tools)
    asked = _prompt_logprobs(body, stream)
    logprobs_field = "top_logprobs" if body.get("top_logprobs") is not None else "logprobs"
    return Job("chat", model, [ids], _sampling(body, max_tokens, stop_ids, _chat_logprobs(body), structured, asked,
                                               logprobs_field),
               stream, _stream_options(body, stream), stop, priority=_priority(body), tools=tools,
               structured_field=field, prompt_logprobs=asked, logprobs_field=logprobs_field,
               lora=lora_of(model, served))
