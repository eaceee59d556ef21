"""Requests and their results: `SamplingParams`, `Request`, `RequestOutput`.

Names follow vLLM's where one exists, so user scripts read the same.
"""

from __future__ import annotations

import dataclasses
import enum

from cbjax import checks


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy; `top_k=0` and `top_p=1` are off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # Normalised to plain Python values that fit the device's int32/float32 arrays.
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", checks.integer("max_tokens", self.max_tokens, 1))
        put("temperature", checks.real("temperature", self.temperature, 0.0))
        put("top_k", checks.integer("top_k (0 disables it)", self.top_k, 0))
        put("top_p", checks.real("top_p", self.top_p, 0.0, 1.0, low_open=True))
        if self.seed is not None:
            put("seed", checks.integer("seed", self.seed, 0))
        stop = self.stop_token_ids
        if stop is None or isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            stop = () if stop is None else [stop]
        put("stop_token_ids", tuple(checks.integer("stop_token_ids", t, 0) for t in stop))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    seq_index: int = 0  # admission order, breaks ties after priority and arrival
    metrics: RequestMetrics = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def expected_len(self) -> int:
        """What a length-aware scheduler can know ahead: prompt plus the output budget."""
        return self.prompt_len + self.sampling.max_tokens

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
