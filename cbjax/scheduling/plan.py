"""What the scheduler hands the executor each round, and what comes back: a `Plan` of device
`Call`s of `Row`s, and a `RoundResult` of each call's tokens on the host.

`Row` is the one row type from the plan to the device step: the engine packs rows into
its jitted programs' arrays, and the scheduler records their results; nobody converts
them in between.
"""

from __future__ import annotations

import dataclasses

from cbjax.request import Request, SamplingParams


@dataclasses.dataclass
class Row:
    """One sequence's part of a device step: prompt `tokens` written to `slot` from
    position `start` (a prefill chunk), or, with no tokens, a decode of the slot's last
    sampled token at position `start` (a mixed step's decode row). A chunk that ends its
    prompt (`is_last`) samples the first token with `sampling` and `seed`, as output
    index `generated` (tokens generated before a preemption: recompute)."""

    slot: int
    tokens: list[int]
    start: int  # tokens of the sequence already in the cache
    is_last: bool = False
    sampling: SamplingParams | None = None
    seed: int = 0
    generated: int = 0
    request: Request | None = None  # the scheduler's request, whose result this row carries
    prompt_len: int = 0  # positions before it are the prompt, after it output (a resumed request's)
    # The tokens before `start` when the row's request starts past position 0 (cached prefix
    # pages, a fork of a sibling's prompt) and its logits processors need them on the device.
    history: list[int] | None = None
    # A speculating request's row: `tokens` are its last sampled token and the proposed ones after
    # it, from position `start` (the last token's); the step samples every position and keeps
    # the proposal's longest prefix the target agrees with (cbjax/runtime/traced/speculative.py).
    verify: bool = False

    @classmethod
    def chunk(cls, request: Request, start: int, length: int) -> "Row":
        """The prompt positions `start:start+length` of a request holding a slot. `is_last`
        and `tokens` are fixed now: recording the chunk grows the request's `prefill_len`,
        and the round still has to know that this chunk ended the prompt."""
        ids = request.prefill_token_ids
        history = ids[:start] if start and start == request.placed_at and request.sampling.processes_logits else None
        return cls(request.slot, ids[start:start + length], start, start + length >= request.prefill_len,
                   request.sampling, request.seed, len(request.output_token_ids), request, request.prompt_len,
                   history)

    @classmethod
    def decode(cls, request: Request) -> "Row":
        return cls(request.slot, [], request.num_tokens - 1, request=request, prompt_len=request.prompt_len)

    @classmethod
    def speculating(cls, request: Request, proposal: list[int]) -> "Row":
        """A running request's last token and the `proposal` after it, verified in one row."""
        last = request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]
        return cls(request.slot, [last, *proposal], request.num_tokens - 1, request=request,
                   prompt_len=request.prompt_len, verify=True)

    @property
    def adapter(self) -> int:
        """The LoRA slot the row's tokens read (0: the base model; cbjax/models/lora.py)."""
        return self.request.lora_slot if self.request is not None else 0

    @property
    def decodes(self) -> bool:
        """A running request's row: a decode, or a speculating one's verification."""
        return not self.tokens or self.verify

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def is_decode(self) -> bool:
        return not self.tokens

    @property
    def starts_history(self) -> bool:
        """Whether the row starts at position 0 a request whose logits processors read the
        penalties' history (its slot's row is cleared first)."""
        return self.start == 0 and not self.is_decode and self.sampling is not None and self.sampling.processes_logits

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) or 1


@dataclasses.dataclass
class Call:
    """One device step program's call: `rows`, run for `steps` decode steps (1 for a prompt
    call, a mixed one, or a decode whose next token the host must see first)."""

    rows: list[Row]
    steps: int = 1


@dataclasses.dataclass
class CallResult:
    """A call's results on the host: per piece of the call (`members`: the row index behind
    each of the piece's rows, -1 for a piece of a prompt chunk that continues later), its
    `[steps, rows, 2]` tokens and device-side finished flags, and its logprob columns or None."""

    rows: list[Row]
    pieces: list[tuple[list[int], object, object]]  # (members, out, logprobs)


@dataclasses.dataclass
class RoundResult:
    calls: list[CallResult]
    now: float  # the clock when the results reached the host


@dataclasses.dataclass
class Plan:
    prefills: list[Row]
    decode: bool
    # When there is nothing to do now: the earliest time something could change
    # without a new arrival (a dynamic window closing), else None.
    wake_time: float | None = None
    preempted_slots: list[int] = dataclasses.field(default_factory=list)  # to deactivate on the device
    mixed: bool = False  # prefills and decodes go in one mixed step
    # KV to copy before the round's steps, (source, destination): pages of the paged cache, or
    # whole slots of the slot cache (forks of a sibling's prompt, n > 1).
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Moves between the device cache and its host tier, in order (host_tier.KVOp), run after
    # the preempted slots are deactivated and before the copies and the steps.
    kv_ops: list = dataclasses.field(default_factory=list)
    # LoRA adapters to write into the device pool before the calls: (slot, host adapter)
    lora_loads: list = dataclasses.field(default_factory=list)
    # Requests it finished with an error before running them (an adapter no longer readable)
    failed: list = dataclasses.field(default_factory=list)
    draft_len: int = 0  # speculative decoding: the most tokens a decoding request proposes this round
    calls: list[Call] = dataclasses.field(default_factory=list)  # the device calls, in order
    # The slots a decode call may be dispatched for before this round's results are recorded
    # (host/device overlap), or None.
    ahead: list[int] | None = None
    in_flight: bool = False  # its one call was dispatched ahead, in an earlier round
    time: float = 0.0  # the clock when it was planned

    @property
    def idle(self) -> bool:
        return not self.prefills and not self.decode
