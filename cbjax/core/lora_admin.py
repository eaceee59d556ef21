"""What a core answers and does about its LoRA adapters (`enable_lora`): load one from a PEFT
directory, unload one nobody uses, the names loaded, and the prefix-cache salt of a request
that names one (cbjax/scheduling/adapter_slots.py holds the device slots, adapter_store.py the
registered adapters and their host copies)."""

from __future__ import annotations

from typing import Any

from cbjax.checks import FieldError
from cbjax.loading.peft import AdapterError


class LoraAdmin:
    scheduler: Any

    def _adapters(self, field: str = "lora"):
        adapters = self.scheduler.adapters
        if adapters is None:
            raise FieldError("LoRA adapters need an engine built with enable_lora=True", field)
        return adapters

    def load_lora(self, name: str, path: str) -> None:
        """Register the adapter at `path` as `name` (read and checked now: AdapterError naming it)."""
        self._adapters().store.register(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`: refused (AdapterError) while a request waits for it or runs it."""
        adapters = self._adapters()
        if name not in adapters.store.paths:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        sched = self.scheduler
        users = [r.request_id for r in sched.waiting + sched.running if r.lora == name]
        if users:
            raise AdapterError(f"LoRA adapter {name!r} is in use by {len(users)} request(s) "
                               f"({', '.join(users[:4])}): unload it when they have finished")
        adapters.evict(name)
        adapters.store.unregister(name)

    def lora_adapters(self) -> list[str]:
        """The loaded adapters' names (none without enable_lora)."""
        adapters = self.scheduler.adapters
        return [] if adapters is None else adapters.store.names()

    def lora_salt(self, name: str | None) -> int:
        """A request's prefix-cache salt for adapter `name` (0: the base model); ValueError naming
        the adapter when it is not loaded."""
        if name is None:
            return 0
        adapters = self._adapters()
        salt = adapters.store.salts.get(name)
        if salt is None:
            raise FieldError(f"LoRA adapter {name!r} is not loaded (loaded: {adapters.store.names()})", "lora")
        return salt
