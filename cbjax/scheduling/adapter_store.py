"""LoRA adapters behind the device pool: the registered ones (name -> directory), the host tier
(an LRU of `max_cpu_loras` adapters read into host memory) and the disk behind it.

An adapter is read and checked in full when it is registered (`register`: a bad one is refused
there, by name, before any request names it). Later it may fall out of host memory; a request
that needs it then has it read again on a background thread (`ready`), and waits meanwhile
while the others run: the read is never on a step's path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools

from cbjax.config import ModelConfig
from cbjax.loading.peft import SYNTHETIC, Adapter, AdapterError, read_adapter, synthetic_adapter


class AdapterStore:
    def __init__(self, config: ModelConfig, max_rank: int, modules, max_cpu_loras: int, simulated: bool = False):
        """`simulated`: a simulated engine's, which also takes synthetic adapters (`peft.synthetic_adapter`)."""
        self.simulated = simulated
        self.config = config
        self.max_rank = max_rank
        self.modules = tuple(modules)
        self.max_cpu_loras = max_cpu_loras
        self.paths: dict[str, str] = {}  # registered name -> directory
        self.salts: dict[str, int] = {}  # registered name -> its registration's number (prefix keys)
        self.host: collections.OrderedDict[str, Adapter] = collections.OrderedDict()  # LRU, oldest first
        self._reading: dict[str, concurrent.futures.Future] = {}
        self._reader: concurrent.futures.ThreadPoolExecutor | None = None
        self._serial = itertools.count(1)
        self.disk_reads = 0  # reads after registration (the host tier missed)

    def register(self, name: str, path: str) -> Adapter:
        """Read and check `path` as adapter `name` (AdapterError naming it when the engine cannot take it)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise AdapterError(f"a LoRA adapter's name must be a non-empty string without outer spaces, got {name!r}")
        if name in self.paths:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded (unload it first)")
        adapter = self._read(name, str(path))
        self.paths[name] = str(path)
        self.salts[name] = next(self._serial)
        self._keep(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        self.paths.pop(name)
        self.salts.pop(name)
        self.host.pop(name, None)
        self._reading.pop(name, None)

    def names(self) -> list[str]:
        return list(self.paths)

    def ready(self, name: str) -> Adapter | None:
        """The adapter in host memory, or None while it is read back from disk (started here).
        A read that failed (the directory changed since it was registered) raises its AdapterError."""
        adapter = self.host.get(name)
        if adapter is not None:
            self.host.move_to_end(name)
            return adapter
        if self.simulated:  # a simulated clock cannot wait for a thread: read at once (not charged)
            self._keep(self._read(name, self.paths[name]))
            self.disk_reads += 1
            return self.host[name]
        future = self._reading.get(name)
        if future is None:
            if self._reader is None:
                self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cbjax-lora-read")
            self.disk_reads += 1
            self._reading[name] = self._reader.submit(self._read, name, self.paths[name])
            return None
        if not future.done():
            return None
        del self._reading[name]
        adapter = future.result()  # raises the read's AdapterError
        self._keep(adapter)
        return adapter

    def _read(self, name: str, path: str) -> Adapter:
        if path.startswith(SYNTHETIC):
            if not self.simulated:
                raise AdapterError(f"LoRA adapter {name!r}: synthetic adapters ({path!r}) run on a simulated engine "
                                   "alone (they have no weights)")
            return synthetic_adapter(name, path, self.config, self.max_rank, self.modules)
        return read_adapter(name, path, self.config, self.max_rank, self.modules)

    def _keep(self, adapter: Adapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)


__all__ = ["AdapterError", "AdapterStore"]
