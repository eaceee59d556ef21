"""What an engine offers the engine core: the contract `Engine`, `PipelineEngine` and
`SimulatedEngine` keep (tests/test_contracts.py checks each), and a new engine (a draft
model's, say) must keep.

The core asks nothing by probing: what an engine can do is declared, as the class
attributes under "capabilities", and the core branches on them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from cbjax.request import SamplingParams
from cbjax.scheduling.plan import Row


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """An engine's configuration as a front reports it (a bench's table, the server's banner)."""

    platform: str  # "cpu", "gpu", "tpu", ...: the one its programs are built for
    kind: str  # "engine", "pipeline" or "simulated"
    attention: str  # "pallas" or "reference"
    num_slots: int
    max_model_len: int  # tokens of one sequence: prompt and output
    token_buckets: tuple[int, ...]  # the flat-buffer sizes its step is compiled for
    ops: str  # the operations its programs are traced with (`Ops`: XLA's, the CPU kernels, Pallas)
    num_devices: int  # devices its params and cache span
    # The Pallas kernels' launches its warm-up tuned: ((kernel, shape, chosen launch), ...)
    kernel_launches: tuple = ()
    fused_projections: bool = False  # q/k/v and gate/up as one matmul each (cbjax/models/fusion.py)


@runtime_checkable
class StepEngine(Protocol):
    # Capabilities.
    reads_block_tables: bool  # the paged cache's tables are copied to it each round
    can_run_ahead: bool  # a decode reads its last tokens on the device: the next may be dispatched first
    supports_structured_output: bool  # its step applies structured-output masks
    takes_sampler_variants: bool  # its step compiles only the sampling its rows need

    platform: str
    model: Any  # the loaded `Model` (`.config`, `.params`)
    config: Any  # its `EngineConfig`
    max_len: int
    host_kv: Any  # the KV cache's host tier's data and moves (`HostKV`), or None
    host_s: float  # seconds of KV moves over the host link, where they are simulated (0 elsewhere)

    @property
    def num_slots(self) -> int: ...

    @property
    def call_log(self) -> Sequence:
        """A pipeline's rounds of stage calls, in dispatch order (empty elsewhere)."""

    def info(self) -> EngineInfo: ...

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse (ValueError) sampling parameters it cannot apply."""

    def run(self, rows: list[Row], steps: int = 1) -> list:
        """Dispatch a round's rows; each call's `[steps, rows, 2]` result stays on the device."""

    def take_expert_tokens(self) -> list:
        """A mixture of experts' tokens per expert and layer in the calls since the last take
        (device arrays, copied with the round's tokens); empty for a dense model."""

    def take_prompt_scores(self) -> list:
        """The prompt scores of the calls since the last take: (device score columns, their
        pieces), for `PromptScores.fill` once the round's results are on the host."""

    def deactivate(self, slot: int) -> None: ...

    def copy_kv(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def move_kv(self, ops: list) -> None:
        """A round's moves between the cache and its host tier (`KVOp`s)."""

    def set_block_tables(self, tables: np.ndarray) -> None: ...

    def warmup(self, only: str | None = None) -> int:
        """Compile every program a workload can reach; returns how many."""

    def wait_for_compiles(self) -> int:
        """Block until programs compiling in the background are ready; returns how many there were."""

    def reset(self) -> None: ...

    @property
    def scores_prompts(self) -> bool:
        """Whether its step scores the prompt rows that ask for prompt logprobs; else a request's
        are computed by `prompt_scorer` before it is queued."""

    def prompt_scorer(self, ids: list[int], k: int) -> Any:
        """A `PromptScorer`: the prompt's logprobs, a chunk at a time."""

    def prompt_logprobs(self, ids: list[int], k: int) -> list: ...
