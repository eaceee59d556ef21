"""What an engine core offers the front door (`LLM`), the server's loop and the simulator's
profiler: the contract `EngineCore` and `DisaggregatedCore` keep (tests/test_contracts.py
checks each). A core runs one scheduling round at a time over the requests handed to it. It
hands out no engine, scheduler or page pool: what a front or a study reads of them comes
from its methods and its read-only `snapshot()`.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

from cbjax.core.snapshot import Snapshot
from cbjax.core.step_stats import StepStats
from cbjax.request import Request, SamplingParams
from cbjax.runtime.interface import EngineInfo, StepEngine


@runtime_checkable
class Core(Protocol):
    clock: Callable[[], float]
    stats: StepStats  # since the start or the last reset: where a round's time went
    # Prompt token ids -> expected output tokens, for the length-aware orderings; None: max_tokens only.
    predict_len: Callable[[list[int]], int] | None
    # Whether requests have arrived that the front has not handed in yet (a server's queue); None:
    # the front hands requests in only between rounds. A core that runs ahead checks it first.
    arrivals_pending: Callable[[], bool] | None

    @property
    def idle(self) -> bool:
        """The latest round ran nothing."""

    @property
    def wake_time(self) -> float | None:
        """When idle: the earliest time something could change without an arrival."""

    def check_request(self, ids: list[int], sampling: SamplingParams) -> None:
        """Refuse (ValueError) a request it could never run."""

    def add(self, request: Request) -> None: ...

    def abort(self, request: Request) -> None: ...

    def has_unfinished(self) -> bool: ...

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""

    def warmup(self) -> int:
        """Compile every program its configuration can reach; returns how many."""

    def load(self) -> Any:
        """What it holds after its latest round (`engine_core.Load`)."""

    def run_round(self) -> list[Request]:
        """One scheduling round; returns the requests it touched (got tokens or finished)."""

    def engine_swapped(self, wrap: Callable[[StepEngine], StepEngine]) -> ContextManager:
        """Run rounds on `wrap(engine)` over the same state (the profiler's shadowed engine)."""

    def info(self) -> EngineInfo:
        """The configuration of the engine its rounds run on (a disaggregated core: its first
        prefill instance's), as a front reports it."""

    def wait_for_compiles(self) -> int:
        """Block until the programs compiling in the background are ready; how many there were."""

    def warm_structured_output(self, background: bool = False) -> int:
        """Compile the programs structured-output requests run; how many (0 where none)."""

    @property
    def scores_prompts(self) -> bool:
        """Whether the engine's step scores prompts (`PromptScores`); else `prompt_scorer` does."""

    def prompt_scorer(self, ids: list[int], k: int | None) -> Any:
        """The scorer that computes a prompt's logprobs a chunk at a time (`PromptScorer`)."""

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT LoRA adapter directory as `name` (checked now)."""

    def unload_lora(self, name: str) -> None:
        """Forget an adapter no request uses."""

    def lora_adapters(self) -> list[str]:
        """The loaded adapters' names."""

    def lora_salt(self, name: str | None) -> int:
        """A request's prefix-cache salt for adapter `name` (ValueError when not loaded)."""

    def snapshot(self) -> Snapshot:
        """A read-only copy of what it holds: the page pool, the host tier, the call log,
        the compile counts, the speculation counters."""
