"""Where the host loop's time goes: `StepStats`, summed over rounds by `LLM`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepStats:
    """Where the host loop's time goes (seconds, summed over rounds)."""

    rounds: int = 0
    decode_steps: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (cached prefix pages and forks are not; recomputes are)
    schedule_s: float = 0.0  # Scheduler.schedule
    dispatch_s: float = 0.0  # enqueueing the jitted steps (async)
    device_wait_s: float = 0.0  # waiting for the round's one host copy
    process_s: float = 0.0  # recording tokens, stop checks, building outputs
    active_slot_steps: int = 0  # sum over decode steps of slots that produced a token
    ahead_calls: int = 0  # decode calls dispatched before the previous one was recorded (overlap)

    @property
    def mean_running(self) -> float:
        """Mean number of sequences decoding per decode step (batch utilization)."""
        return self.active_slot_steps / max(self.decode_steps, 1)

    @property
    def host_s(self) -> float:
        """Scheduler and bookkeeping time: what the device would idle for without overlap."""
        return self.schedule_s + self.process_s

    def host_ms_per_decode_step(self) -> float:
        return 1000 * self.host_s / max(self.decode_steps, 1)
