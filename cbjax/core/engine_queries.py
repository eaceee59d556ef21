"""What a core answers about the engine its rounds run on (a disaggregated core: its first
prefill instance's), so that a front asks the core and never holds the engine."""

from __future__ import annotations

from typing import Any

from cbjax.core.snapshot import Snapshot, snapshot_of
from cbjax.runtime.interface import EngineInfo
from cbjax.runtime.compiled.warmup import warm_structured_output


class EngineQueries:
    engine: Any  # the `StepEngine` the core's rounds run on
    scheduler: Any
    pages: Any

    def info(self) -> EngineInfo:
        """The engine's configuration as a front reports it."""
        return self.engine.info()

    def wait_for_compiles(self) -> int:
        """Block until the programs compiling in the background are ready; how many there were."""
        return self.engine.wait_for_compiles()

    def warm_structured_output(self, background: bool = False) -> int:
        """Compile the programs structured-output requests run, now or on a thread of their own;
        how many (0 where the engine has none)."""
        if not self.engine.supports_structured_output:
            return 0
        return warm_structured_output(self.engine, background)

    @property
    def scores_prompts(self) -> bool:
        """Whether the engine's step scores prompts (else `prompt_scorer` does, before queueing)."""
        return self.engine.scores_prompts

    def prompt_scorer(self, ids: list[int], k: int | None):
        """The scorer that computes a prompt's logprobs a chunk at a time (`PromptScorer`)."""
        return self.engine.prompt_scorer(ids, k)

    def snapshot(self) -> Snapshot:
        """A read-only copy of what the core holds now."""
        return snapshot_of(self.engine, self.scheduler, self.pages, self.load(), self.stats)
