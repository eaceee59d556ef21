"""Requests and their results: `SamplingParams`, `Request`, `RequestOutput`.

Names follow vLLM's where one exists, so user scripts read the same.
"""

from __future__ import annotations

import dataclasses
import enum
import json

from cbjax import checks


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of `json` (a JSON
    schema, as a dict or its text), `json_object` (any JSON object), `regex`, `choice` (one of these
    strings) or `grammar` (a Lark grammar, llguidance's dialect). The engine masks, at every step,
    the tokens that cannot continue a valid output (cbjax/grammar.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(isinstance(c, str) for c in self.choice) \
                    or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured output {name} must be a string, got {type(value).__name__}")
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object is True else []
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {given or 'none'}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"


class Sampler(enum.IntFlag):
    """The parts of sampling a request needs, and a step's program holds (its static argument,
    cbjax/runtime/traced/sampling.py): the host, which packs every row's sampling parameters, ORs
    them over a call's rows and picks a program that covers them (runtime/compiled/step_programs.py). Where a
    branch skips work on the device (CPU, TPU) one program holding them all costs nothing for
    rows that need less; on a GPU `skip_unless` computes both sides, so a program for greedy
    rows alone is the only way they skip the vocabulary sort (what it cost: docs/engine.md,
    "Sampler variants")."""

    DRAW = 1  # a row samples at temperature > 0
    SORT = 2  # ... with top-k or top-p (a sort over the vocabulary)
    PROCESS = 4  # a row has a logits processor (logit bias, min_tokens, penalties)
    LOGPROBS = 8  # a row asks for logprobs

    @classmethod
    def of(cls, sampling) -> int:
        """What one request's `SamplingParams` need, as plain int bits (the host ORs them per row)."""
        draws = sampling.temperature > 0
        return ((cls.DRAW if draws else 0) | (cls.SORT if draws and (sampling.top_k > 0 or sampling.top_p < 1) else 0)
                | (cls.PROCESS if sampling.processes_logits else 0)
                | (cls.LOGPROBS if sampling.logprobs is not None else 0))


GREEDY, ALL = Sampler(0), Sampler(15)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy; `top_k=0`, `top_p=1` and `min_p=0` are off
    (`min_p`: drop tokens less likely than min_p times the most likely one, after temperature).

    The logits processors follow vLLM and run on the device in this order: `logit_bias`
    (token id -> added to its logit, clipped to [-100, 100] as OpenAI does), `min_tokens`
    (EOS and `stop_token_ids` masked until that many tokens are out), then the penalties:
    `repetition_penalty` (transformers' and vLLM's: a logit of a token seen in the prompt
    or the output is divided by it when positive, multiplied when negative; 1 is off),
    `frequency_penalty` and `presence_penalty` (OpenAI's: minus `frequency x count` and
    `presence x [count > 0]` over the output's tokens). `logprobs=k` returns, per output
    token, its log-probability and the k most likely tokens', from the raw logits (before
    any processor or temperature, as vLLM's default). `n` samples come back per prompt;
    with `best_of`, that many are drawn and the `n` of highest cumulative log-probability
    kept. Sample i draws with seed `seed + i`, so it equals a single run with that seed.
    `prompt_logprobs=k`: each prompt token's log-probability (and the k likeliest tokens at its
    position), computed in the batched step (cbjax/prompt_scores.py); `prompt_logprobs_from`:
    the first position scored (earlier entries None), so the prefix cache may serve the tokens
    before it (a task's shared context, scored once).
    `structured`: a `StructuredOutput` the output must match (the engine masks tokens that
    cannot continue it; the request decodes one token per step and never runs ahead)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # or a dict {token id: bias}
    logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    min_p: float = 0.0
    structured: StructuredOutput | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 0

    def __post_init__(self):
        # Normalised to plain Python values that fit the device's int32/float32 arrays.
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", checks.integer("max_tokens", self.max_tokens, 1))
        put("temperature", checks.real("temperature", self.temperature, 0.0))
        put("top_k", checks.integer("top_k (0 disables it)", self.top_k, 0, field="top_k"))
        put("top_p", checks.real("top_p", self.top_p, 0.0, 1.0, low_open=True))
        put("min_p", checks.real("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            put("seed", checks.integer("seed", self.seed, 0))
        stop = self.stop_token_ids
        if stop is None or isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            stop = () if stop is None else [stop]
        put("stop_token_ids", tuple(checks.integer("stop_token_ids", t, 0) for t in stop))
        if not isinstance(self.ignore_eos, bool):
            raise checks.FieldError(f"ignore_eos must be a bool, got {self.ignore_eos!r}", "ignore_eos")
        put("min_tokens", checks.integer("min_tokens", self.min_tokens, 0, self.max_tokens))
        put("presence_penalty", checks.real("presence_penalty", self.presence_penalty, -2.0, 2.0))
        put("frequency_penalty", checks.real("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        put("repetition_penalty", checks.real("repetition_penalty", self.repetition_penalty, 0.0, 1e4,
                                              low_open=True))
        bias = self.logit_bias
        if bias is None:
            bias = ()
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(checks.integer("a logit_bias token id", t, 0), checks.real("a logit_bias value", b))
                     for t, b in items]
        except (TypeError, ValueError) as e:
            raise checks.FieldError(f"logit_bias must map token ids to numbers: {e}", "logit_bias") from None
        put("logit_bias", tuple(sorted((t, min(max(b, -100.0), 100.0)) for t, b in dict(pairs).items())))
        if self.logprobs is not None:
            put("logprobs", checks.integer("logprobs", self.logprobs, 0, 1024))
        if self.prompt_logprobs is not None:
            put("prompt_logprobs", checks.integer("prompt_logprobs", self.prompt_logprobs, 0, 1024))
        put("prompt_logprobs_from", checks.integer("prompt_logprobs_from", self.prompt_logprobs_from, 0))
        put("n", checks.integer("n", self.n, 1, 1024))
        if self.best_of is not None:
            put("best_of", checks.integer("best_of", self.best_of, self.n, 1024))
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise checks.FieldError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}",
                                    "structured")

    @property
    def num_samples(self) -> int:
        """Samples drawn for the request: `best_of`, else `n`."""
        return self.best_of or self.n

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (the device skips them when no row has one)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the `k` likeliest tokens', best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None  # 1 = the likeliest token (prompt logprobs carry it)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the engine's max_seq_len
    ABORT = "abort"
    ERROR = "error"


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # holds a slot, prompt partly in the cache (chunked prefill)
    RUNNING = "running"  # holds a slot, decoding
    FINISHED = "finished"


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock (or fake-clock) times in seconds."""

    arrival_time: float
    scheduled_time: float | None = None  # first prefill chunk issued
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for it
    num_accepted_tokens: int = 0  # ... and kept

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    seed: int = 0  # sampling noise seed (the front sets it: the user's, or one derived from the id)
    # Scheduler state.
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens already in the cache
    placed_at: int = 0  # num_prefilled when it took its slot (past 0: cached prefix pages or a fork)
    swapped: bool = False  # preempted with its KV and state in the host tier (preemption_mode="swap")
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    seq_index: int = 0  # admission order, breaks ties after priority and arrival
    metrics: RequestMetrics = None  # type: ignore[assignment]
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when sampling.logprobs is set
    # Parallel sampling (n / best_of): the sibling whose prompt this one may copy instead of
    # prefilling it (the scheduler forks it once that prefill is in the cache).
    fork_of: "Request | None" = None
    # Output tokens a length predictor expects (ordering="sjf"/"score"); None: max_tokens.
    predicted_len: int | None = None
    # The structured output's matcher (cbjax/grammar.py `GrammarState`) when `sampling.structured`.
    grammar: object | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when sampling.prompt_logprobs is set
    prompt_scores: object | None = None  # a `PromptScores` the step fills, while they are computed
    # The LoRA adapter it runs (None: the base model), and the device pool slot the scheduler
    # pinned for it from its first placement until it finishes (0: none yet).
    lora: str | None = None
    lora_slot: int = 0
    # Where its prefix-cache keys start: 0 for the base model, its adapter's registration's own
    # number otherwise (a name loaded again is another adapter), so no KV is shared across adapters.
    prefix_salt: int = 0

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.logprobs)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def expected_len(self) -> int:
        """What a length-aware scheduler can know ahead: prompt plus the output budget."""
        return self.prompt_len + self.sampling.max_tokens

    @property
    def predicted_remaining(self) -> int:
        """Output tokens still expected: the predictor's length (else the max_tokens budget)
        less those generated, at least 1."""
        expected = self.sampling.max_tokens if self.predicted_len is None else self.predicted_len
        return max(expected - len(self.output_token_ids), 1)

    @property
    def finished(self) -> bool:
        return self.state == RequestState.FINISHED

    @property
    def prefill_token_ids(self) -> list[int]:
        """What a (re)admission prefills: the prompt, plus the tokens generated before a
        preemption (recompute)."""
        return self.prompt_token_ids + self.output_token_ids if self.output_token_ids else self.prompt_token_ids

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_prefilled >= self.prefill_len


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None
    new_token_ids: list[int] = dataclasses.field(default_factory=list)  # since the last step (streaming)
    logprobs: list[TokenLogprob] | None = None  # per output token, when asked for (streaming: the new ones)
    cumulative_logprob: float | None = None
    index: int = 0  # which of the request's n samples
    samples: list["RequestOutput"] | None = None  # generate() with n > 1: every sample, by index
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first), when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_output(r: Request, tokenizer, since: int | None = None) -> RequestOutput:
    """`r`'s output; streamed (`since`: the tokens already handed out), with only the new tokens
    in `new_token_ids` and their logprobs, and text once it has finished."""
    tokens = list(r.output_token_ids)
    new = tokens[since:] if since is not None else []
    text = None
    if tokenizer is not None and tokens and r.finished:  # streamed steps carry new_token_ids only
        text = tokenizer.decode(tokens, skip_special_tokens=True)
    reason = None if r.finish_reason is None else r.finish_reason.value
    logprobs = cumulative = None
    if r.sampling.logprobs is not None:
        logprobs = r.logprobs[len(tokens) - len(new):] if since is not None else list(r.logprobs)
        cumulative = r.cumulative_logprob
    return RequestOutput(r.request_id, list(r.prompt_token_ids), tokens, text, reason, r.metrics, prompt=r.prompt,
                         error=r.error, new_token_ids=new, logprobs=logprobs, cumulative_logprob=cumulative,
                         prompt_logprobs=r.prompt_logprobs if not since else None)


def is_int_list(x) -> bool:
    try:
        return len(x) > 0 and all(isinstance(t, int) or hasattr(t, "__index__") for t in x) \
            and not isinstance(x, str)
    except TypeError:
        return False


def error_output(now: float, request_id: str, prompt, message: str) -> RequestOutput:
    """The output of a request refused with `message` at `now`."""
    ids = list(prompt) if not isinstance(prompt, (str, bytes, bytearray)) and is_int_list(prompt) else []
    metrics = RequestMetrics(arrival_time=now, finish_time=now)
    return RequestOutput(request_id, ids, [], None, FinishReason.ERROR.value, metrics,
                         prompt=prompt if isinstance(prompt, str) else None, error=message)
