"""The LoRA adapter pool on the device (`LoraPool`, cbjax/models/lora.py), as an engine holds it:
made empty for the engine's model and knobs, an adapter written into a slot by one small
program with the pool donated (so loading never copies the pool, and compiles once: every
adapter is padded to the pool's rank and modules, one shape)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from cbjax.models.lora import LoraPool, module_shapes, write_slot
from cbjax.runtime.traced.device_state import TRACE_COUNTS


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write(pool: LoraPool, slot, a: dict, b: dict, scale) -> LoraPool:
    TRACE_COUNTS[("lora_write", tuple(pool.a), pool.num_slots)] += 1
    return write_slot(pool, slot, a, b, scale)


class DeviceAdapters:
    """An engine's adapter pool: `max_loras` slots (and slot 0, the base model) of rank
    `max_lora_rank` on `modules`, in the activations' dtype; replicated over a mesh."""

    def __init__(self, model_config, modules, max_loras: int, rank: int, dtype, put):
        family = module_shapes(model_config)
        if model_config.is_gpt2:
            raise ValueError("enable_lora: LoRA adapters on GPT-2's fused Conv1D projections (c_attn, c_proj, c_fc) "
                             "are not supported")
        missing = [m for m in modules if m not in family]
        if missing:
            raise ValueError(f"lora_target_modules {missing}: not projections a LoRA adapter may target in "
                             f"{model_config.model_type} (these are: {sorted(family)})")
        self.shapes = {m: family[m] for m in modules}
        self.rank = rank
        self.num_layers = model_config.num_layers
        self.dtype = np.dtype(dtype)
        self._put = put  # a host array onto the engine's device(s)
        shape = jax.eval_shape(lambda: LoraPool.init(self.shapes, self.num_layers, max_loras + 1, rank, dtype))
        self.pool = jax.tree.map(lambda s: put(np.zeros(s.shape, s.dtype)), shape)

    def padded(self, adapter) -> tuple[dict, dict, float]:
        """The adapter's `A` and `B` of every module of the pool, zero-padded to its rank (zeros
        for modules it leaves alone), as host arrays of the pool's dtype."""
        a, b = {}, {}
        for module, (fan_in, fan_out) in self.shapes.items():
            a[module] = np.zeros((self.num_layers, self.rank, fan_in), self.dtype)
            b[module] = np.zeros((self.num_layers, fan_out, self.rank), self.dtype)
            if module in adapter.weights:
                got_a, got_b = adapter.weights[module]
                a[module][:, :adapter.rank] = got_a
                b[module][:, :, :adapter.rank] = got_b
        return a, b, adapter.scale

    def load(self, slot: int, adapter) -> None:
        """Write `adapter` (a host `peft.Adapter`, or None: zeros) into `slot`; nothing waits for it."""
        if adapter is None:
            a = {m: np.zeros((self.num_layers, self.rank, i), self.dtype) for m, (i, _) in self.shapes.items()}
            b = {m: np.zeros((self.num_layers, o, self.rank), self.dtype) for m, (_, o) in self.shapes.items()}
            scale = 0.0
        else:
            a, b, scale = self.padded(adapter)
        self.pool = _write(self.pool, self._put(np.int32(slot)), jax.tree.map(self._put, a), jax.tree.map(self._put, b),
                           self._put(np.float32(scale)))

    def warmup(self) -> int:
        """Compile the write program (writing zeros into the base model's slot 0, which holds zeros)."""
        self.load(0, None)
        return 1
