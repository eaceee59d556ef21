"""The hand-off of a disaggregated front: which prefilled request moves to which decode
instance, and the move itself (gather on the prefill instance, `jax.device_put` to the
decode instance's devices, insert into its slot or pages: cbjax/runtime/kv_transfer.py).

Simulated, a move moves no bytes: its KV arrives `transfer_seconds(tokens)` after the
request's first token, and a decode instance that is running takes it once its own
lane's time reaches that.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from cbjax.core.engine_core import EngineCore
from cbjax.request import Request
from cbjax.runtime import kv_transfer


@dataclasses.dataclass
class TransferStats:
    moved: int = 0
    failed: int = 0
    bytes: int = 0  # KV and state moved (simulated: KV modelled)
    seconds: float = 0.0  # simulated transfer time, summed over moves


class KVHandOff:
    def __init__(self, prefill: list[EngineCore], decode: list[EngineCore], simulated: bool,
                 transfer_seconds: Callable[[int], float] | None, kv_bytes_per_token: int):
        self.prefill, self.decode = prefill, decode
        self.simulated = simulated
        self.transfer_seconds = transfer_seconds
        self.kv_bytes_per_token = kv_bytes_per_token
        self.transfers = TransferStats()

    def padded(self, length: int) -> int:
        """The length a move of `length` tokens is gathered at (one program per padded length)."""
        page = max((c.engine.config.page_size for c in self.decode if c.pages is not None), default=1)
        return kv_transfer.padded_length(length, self.prefill[0].engine.max_len, page)

    def ready_moves(self) -> Iterator[tuple[EngineCore, EngineCore, Request, float | None]]:
        """(prefill instance, decode instance, request, simulated arrival time) for every
        prefilled request a decode instance has room for now (simulated: whose KV has arrived
        by that instance's time), oldest first token first. Lazy: each move is made before
        the next one's room is looked at."""
        for p in self.prefill:
            for r in sorted(p.scheduler.prefilled(), key=lambda r: r.metrics.token_times[-1]):
                ready = seconds = None
                if self.simulated:
                    seconds = self.transfer_seconds(r.num_tokens - 1)
                    ready = r.metrics.token_times[-1] + seconds
                room = [d for d in self.decode if not d.in_flight and d.scheduler.can_insert(r)]
                if not room:
                    continue
                d = min(room, key=lambda d: len(d.scheduler.running))
                if self.simulated:
                    if d.scheduler.running and d.clock() < ready:
                        continue  # in flight: that instance takes it once its own time reaches `ready`
                    self.transfers.seconds += seconds
                    self.transfers.bytes += self.kv_bytes_per_token * (r.num_tokens - 1)
                yield p, d, r, ready

    def move(self, p: EngineCore, d: EngineCore, r: Request) -> bool:
        """Move `r` from `p` to `d`; False when the move failed, which ends `r` with an error
        and frees both sides."""
        slot_p = r.slot
        try:
            seq = None
            if not self.simulated:
                seq = kv_transfer.move(held_sequence(p, r, self.padded(r.num_tokens - 1)), d.engine)
                self.transfers.bytes += seq.num_bytes
            p.scheduler.release(r)
            insert_held(d, r, seq)
        except Exception as e:  # noqa: BLE001 (any failure of the move: the request ends, nothing leaks)
            p.scheduler.fail(r, f"KV transfer to a decode instance failed: {type(e).__name__}: {e}", p.clock())
            p.engine.deactivate(slot_p)
            self.transfers.failed += 1
            return False
        p.engine.deactivate(slot_p)
        self.transfers.moved += 1
        return True

    def warmup(self) -> int:
        """The move's gather and insert at every transfer length, between every pair."""
        count = 0
        lengths = sorted({self.padded(n) for n in range(1, self.prefill[0].engine.max_len)})
        for p in self.prefill:
            for n in lengths:
                seq = kv_transfer.get_sequence(p.engine, 0, n, [0] * n, n)
                for d in self.decode:
                    kv_transfer.insert_sequence(d.engine, kv_transfer.move(seq, d.engine), 0, [])
                    count += 1
        for d in self.decode:
            d.engine.reset()
        return count


def held_sequence(core: EngineCore, r: Request, padded: int) -> kv_transfer.SequenceKV:
    """The KV and state row of a request a prefill instance holds prefilled."""
    pages = core.pages.table(r.request_id) if core.pages is not None else None
    return kv_transfer.get_sequence(core.engine, r.slot, r.num_tokens - 1, pages, padded)


def insert_held(core: EngineCore, r: Request, seq: kv_transfer.SequenceKV | None) -> None:
    """Place a prefilled request in a decode instance (`can_insert` checked) with its moved
    KV `seq` (None on a simulated engine, which only keeps the slot's counters); if the
    write fails, the slot and pages are given back and the error raised."""
    slot, pages = core.scheduler.insert(r)
    try:
        if seq is None:
            core.engine.insert_prefilled(slot, r.num_tokens - 1, r.sampling, len(r.output_token_ids))
        else:
            kv_transfer.insert_sequence(core.engine, seq, slot, pages)
    except Exception:
        core.scheduler.release(r)
        core.engine.deactivate(slot)
        raise
