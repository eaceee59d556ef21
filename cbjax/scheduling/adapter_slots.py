"""The LoRA adapter pool's slots on the host (the device pool is cbjax/models/lora.py): which
adapter each of the `max_loras` slots holds, the requests pinning it, the loads a round asks
for, and which waiting requests admission may start.

A request pins its adapter's slot from its first placement until it finishes (preempted or
swapped out, it keeps it), so a round never holds more than `max_loras` distinct adapters and
a running request's adapter is never replaced under it. A slot nobody pins stays resident,
least recently used first out, so a popular adapter loads once.

Admission (the policy, after S-LoRA's and vLLM's): a waiting request may start when its
adapter is resident, or is in host memory and a slot is free or idle. A request whose adapter
cannot get a slot yet (all pinned) or is still being read from disk waits, and requests behind
it may start past it, but only `lora_max_bypass` times: after that admission stops at it
until a slot frees, so a cold adapter is never starved by a stream of warm ones.
"""

from __future__ import annotations

import collections
import dataclasses

from cbjax.request import Request
from cbjax.scheduling.adapter_store import AdapterError, AdapterStore


@dataclasses.dataclass
class AdapterCounters:
    loads: int = 0  # adapters written into a device slot
    hits: int = 0  # placements whose adapter was resident
    waits: int = 0  # requests that waited for their adapter at least one round
    wait_s: float = 0.0  # their time from arrival to placement, summed


class AdapterSlots:
    def __init__(self, store: AdapterStore, max_loras: int, max_bypass: int):
        self.store = store
        self.max_bypass = max_bypass
        self.holder: list[str | None] = [None] * (max_loras + 1)  # slot -> adapter name (slot 0: the base)
        self.slot_of: dict[str, int] = {}
        self.pins = [0] * (max_loras + 1)
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # resident, unpinned; LRU first
        self.loads: list[tuple[int, object]] = []  # (slot, host Adapter) to write before this round's calls
        self.counters = AdapterCounters()
        self._bypassed: dict[str, int] = {}  # waiting request id -> later requests placed before it
        self._blocked_ahead: dict[str, tuple[str, ...]] = {}  # request id -> blocked ids ahead of it
        self._waited: set[str] = set()
        self._claimed: set[str] = set()  # adapters the latest `startable` let start: not evicted for another

    @property
    def max_loras(self) -> int:
        return len(self.holder) - 1

    def pinned_names(self) -> list[str]:
        return [name for slot, name in enumerate(self.holder) if name is not None and self.pins[slot] > 0]

    def unreadable(self, waiting: list[Request]) -> list[tuple[Request, str]]:
        """Waiting requests whose adapter can no longer be read (its files changed since it was
        registered), with the error to finish them with; starts the disk reads of the adapters
        the first waiting requests need, as many as host memory holds (reading more would evict
        what those need, and read them again every round)."""
        wanted: set[str] = set()
        errors: dict[str, str] = {}
        for r in waiting:
            name = r.lora
            if name is None or r.lora_slot or name in self.slot_of or name in wanted:
                continue
            if len(wanted) >= self.store.max_cpu_loras:
                break
            wanted.add(name)
            try:
                self.store.ready(name)
            except AdapterError as e:
                errors[name] = str(e)
        return [(r, errors[r.lora]) for r in waiting if r.lora in errors and not r.lora_slot]

    def startable(self, ordered) -> list[Request]:
        """The requests of `ordered` (in admission order) admission may start now (module doc)."""
        # In order: a resident adapter keeps its slot; a new one takes a free slot, else the least
        # recently used idle one that no request before it claimed (that adapter is then gone for
        # the requests after it). `_claimed` tells `pin` which resident adapters must stay.
        self._claimed = set()
        free = self.holder[1:].count(None)
        evictable = [self.holder[s] for s in self.idle]  # LRU first
        pinned = set(self.pinned_names())
        out, blocked = [], []
        for r in ordered:
            name = r.lora
            ok = name is None or r.lora_slot > 0 or name in self._claimed
            if not ok and name in self.slot_of and (name in pinned or name in evictable):
                ok = True
                self._claimed.add(name)
                if name in evictable:
                    evictable.remove(name)
            elif not ok and name in self.store.host and (free or evictable):
                ok = True
                self._claimed.add(name)
                if free:
                    free -= 1
                else:
                    evictable.pop(0)
            if ok:
                if blocked:
                    self._blocked_ahead[r.request_id] = tuple(blocked)
                out.append(r)
                continue
            self._waited.add(r.request_id)
            if self._bypassed.get(r.request_id, 0) >= self.max_bypass:
                break  # nobody passes it any more: admission waits for its slot
            blocked.append(r.request_id)
        return out

    def pin(self, r: Request, now: float) -> None:
        """Give a request being placed its adapter's slot, loading the adapter there if it is not
        resident (admission checked there is room: `startable`)."""
        for waiting in self._blocked_ahead.pop(r.request_id, ()):
            self._bypassed[waiting] = self._bypassed.get(waiting, 0) + 1
        self._bypassed.pop(r.request_id, None)
        if r.request_id in self._waited:
            self._waited.discard(r.request_id)
            self.counters.waits += 1
            self.counters.wait_s += max(now - r.arrival_time, 0.0)
        if r.lora is None or r.lora_slot:
            return
        slot = self.slot_of.get(r.lora)
        if slot is not None:
            self.counters.hits += 1
        else:
            slot = self._free_slot()
            adapter = self.store.ready(r.lora)
            if adapter is None:
                raise AssertionError(f"LoRA adapter {r.lora!r} placed before it was read")
            self.holder[slot], self.slot_of[r.lora] = r.lora, slot
            self.loads.append((slot, adapter))
            self.counters.loads += 1
        self.idle.pop(slot, None)
        self.pins[slot] += 1
        r.lora_slot = slot

    def _free_slot(self) -> int:
        if None in self.holder[1:]:
            return self.holder.index(None, 1)
        # The least recently used resident adapter that no request admission let start leaves.
        slot = next((s for s in self.idle if self.holder[s] not in self._claimed), None)
        if slot is None:
            raise AssertionError("no LoRA slot free to load into")
        del self.idle[slot]
        del self.slot_of[self.holder[slot]]
        self.holder[slot] = None
        return slot

    def release(self, r: Request) -> None:
        """A finished request lets go of its adapter's slot (resident still, idle when unpinned)."""
        self._bypassed.pop(r.request_id, None)
        self._blocked_ahead.pop(r.request_id, None)
        self._waited.discard(r.request_id)
        if not r.lora_slot:
            return
        slot, r.lora_slot = r.lora_slot, 0
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            self.idle[slot] = None

    def evict(self, name: str) -> None:
        """Drop an unpinned adapter from the device (its slot frees; nothing is written)."""
        slot = self.slot_of.pop(name, None)
        if slot is None:
            return
        if self.pins[slot]:
            raise AssertionError(f"LoRA adapter {name!r} is pinned")
        self.idle.pop(slot, None)
        self.holder[slot] = None

    def take_loads(self) -> list[tuple[int, object]]:
        loads, self.loads = self.loads, []
        return loads
