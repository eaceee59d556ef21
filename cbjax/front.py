"""What a front offers the server and the experiments: the contract `LLM` and `Replicas`
(data-parallel `LLM`s behind a router) keep, checked by tests/test_contracts.py. Nothing
outside `cbjax/` needs more of either than this: the engine, the core and the scheduler
behind them are theirs.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from cbjax.request import Request, RequestOutput, SamplingParams
from cbjax.runtime.interface import EngineInfo

Prompt = str | Sequence[int]


@runtime_checkable
class Front(Protocol):
    tokenizer: Any  # the model's, or None (prompts then come as token ids)
    grammars: Any  # structured output's compiler over the tokenizer (`Grammars`)
    clock: Callable[[], float]  # the time arrivals, first tokens and finishes are stamped with
    data_parallel: int  # engines behind it

    @property
    def max_model_len(self) -> int:
        """Tokens of one sequence: prompt and output."""

    @property
    def engine_info(self) -> EngineInfo: ...

    @property
    def scheduler_config(self) -> Any:
        """Its `SchedulerConfig` (the batching policy and its knobs)."""

    @property
    def requests(self) -> Mapping[str, Request]:
        """The live requests, by id."""

    @property
    def idle(self) -> bool:
        """The latest round ran nothing (a dynamic batch's window may be open)."""

    @property
    def wake_time(self) -> float | None:
        """When idle: the earliest time something could change without an arrival."""

    # Requests in.
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: float = 0, arrival_time: float | None = None,
                    scored_prompt: list | None = None, lora: str | None = None) -> str:
        """Queue a request (`lora`: a loaded LoRA adapter's name); ValueError for a bad one
        (nothing else is touched)."""

    def prompt_scorer(self, prompt: Prompt, sampling: SamplingParams) -> Any:
        """For a request asking for prompt logprobs: a scorer that computes them a chunk at a
        time, for `add_request(..., scored_prompt=)`; None: `add_request` computes them itself."""

    def abort(self, request_id: str, index: int | None = None) -> Any:
        """A live request's final output (a group's: its samples' outputs)."""

    def has_request(self, request_id: str) -> bool: ...

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""

    def watch_arrivals(self, pending: Callable[[], bool]) -> None:
        """`pending()`: whether requests have arrived that the front has not handed in yet."""

    def use_length_predictor(self, predict: Callable[[list[int]], int] | None) -> None:
        """Prompt token ids -> expected output tokens, for the length-aware orderings."""

    # Rounds, outputs out.
    def step(self) -> list[RequestOutput]:
        """One scheduling round: an output for every request that got tokens or finished."""

    def has_unfinished_requests(self) -> bool: ...

    def load(self) -> Any:
        """What its engines hold after their latest round (`Load`)."""

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]: ...

    def replay(self, workload: Sequence[tuple[float, Prompt, SamplingParams]], use_tqdm: bool = True,
               desc: str | None = None, concurrency: int | None = None) -> list[RequestOutput]: ...

    # LoRA adapters (enable_lora).
    def load_lora(self, name: str, path: str) -> None: ...

    def unload_lora(self, name: str) -> None: ...

    def lora_adapters(self) -> list[str]: ...

    # Compiling ahead.
    def warmup(self) -> int: ...

    def warm_structured_output(self, background: bool = False) -> int: ...

    def wait_for_compiles(self) -> int: ...
