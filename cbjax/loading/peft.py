"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read
into host arrays the engine's adapter pool takes (cbjax/models/lora.py).

What the engine applies: `y = base(x) + scale * B @ (A @ x)` on any subset of the Llama-like
families' q/k/v/o and gate/up/down projections (the attention projections alone in a
mixture of experts), with `scale = lora_alpha / r`, or `lora_alpha / sqrt(r)` under
`use_rslora`. Everything else PEFT can write is refused by name, before anything reaches the
engine: DoRA, `modules_to_save`, per-module ranks or alphas, trained biases, a layer subset,
GPT-2's fused Conv1D projections, embedding or LM-head adapters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from cbjax.config import ModelConfig
from cbjax.models.lora import MODULES, adapter_bytes, module_shapes

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
_GPT2_MODULES = ("c_attn", "c_proj", "c_fc")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """A LoRA adapter the engine cannot take; the message names the adapter."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter's weights on the host: for each target it touches (PEFT's module name),
    `A [layers, rank, in]` and `B [layers, out, rank]` float32 (zeros on layers it leaves alone)."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict  # module name -> (A, B)
    synthetic_bytes: int = 0  # a synthetic adapter's (no weights: a simulated engine's)

    @property
    def nbytes(self) -> int:
        """Its A and B in float32."""
        return self.synthetic_bytes or sum(a.nbytes + b.nbytes for a, b in self.weights.values())


SYNTHETIC = "synthetic:"


def synthetic_adapter(name: str, spec: str, config: ModelConfig, max_rank: int, allowed=MODULES) -> Adapter:
    """An adapter without weights, for a simulated engine (a study of many adapters on a shape
    whose weights nobody has): `synthetic:RANK:MODULE+MODULE...`, its bytes those of real A and B."""
    try:
        rank_text, modules_text = spec[len(SYNTHETIC):].split(":")
        rank, modules = int(rank_text), [m for m in modules_text.split("+") if m]
    except ValueError:
        raise AdapterError(f"LoRA adapter {name!r}: {spec!r} is not synthetic:RANK:MODULE+MODULE") from None
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds this engine's max_lora_rank={max_rank}")
    check_targets(name, modules, config, allowed)
    return Adapter(name, spec, rank, 1.0, {}, synthetic_bytes=adapter_bytes(config, rank, modules))


def read_config(name: str, path: str) -> dict:
    """The adapter's `adapter_config.json`, with what the engine cannot apply refused by name."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise AdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not readable JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and any(t in _GPT2_MODULES for t in targets):
        raise AdapterError(f"LoRA adapter {name!r}: target modules {targets}: adapters on GPT-2's fused Conv1D "
                           "projections (c_attn, c_proj, c_fc) are not supported")
    refused = [("use_dora", cfg.get("use_dora")), ("modules_to_save", cfg.get("modules_to_save")),
               ("rank_pattern", cfg.get("rank_pattern")), ("alpha_pattern", cfg.get("alpha_pattern")),
               ("layers_to_transform", cfg.get("layers_to_transform")), ("lora_bias", cfg.get("lora_bias")),
               ("fan_in_fan_out", cfg.get("fan_in_fan_out")), ("layer_replication", cfg.get("layer_replication")),
               ("bias", cfg.get("bias", "none") != "none" and cfg.get("bias"))]
    for key, value in refused:
        if value:
            raise AdapterError(f"LoRA adapter {name!r}: {key}={value!r} is not supported (cbjax applies plain "
                               "LoRA: A and B on q/k/v/o and gate/up/down, no DoRA, per-module ranks, biases, "
                               "saved modules or layer subsets)")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def check_targets(name: str, targets, config: ModelConfig, allowed) -> None:
    """Refuse target modules the family lacks (GPT-2's fused ones by name) or the engine's pool
    does not hold (`allowed`: PEFT module names)."""
    family = module_shapes(config)
    for module in targets:
        if module in _GPT2_MODULES or config.is_gpt2:
            raise AdapterError(f"LoRA adapter {name!r}: target module {module!r}: adapters on GPT-2's fused "
                               "Conv1D projections (c_attn, c_proj, c_fc) are not supported")
        if module not in family:
            where = " (a mixture of experts takes adapters on its attention projections alone)" \
                if config.is_moe and module in MLP_TARGETS else ""
            raise AdapterError(f"LoRA adapter {name!r}: target module {module!r} is not one this "
                               f"{config.model_type} model has{where}; supported: {sorted(family)}")
        if module not in allowed:
            raise AdapterError(f"LoRA adapter {name!r}: target module {module!r} is outside this engine's "
                               f"lora_target_modules {sorted(allowed)}")


def read_adapter(name: str, path: str, config: ModelConfig, max_rank: int, allowed=MODULES) -> Adapter:
    """Read and check one adapter directory against the base model's config (`AdapterError`,
    naming the adapter, for anything the engine cannot take)."""
    cfg = read_config(name, path)
    rank = cfg["r"]
    if rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r}: rank {rank} exceeds this engine's max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", rank)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, path)
    shapes = module_shapes(config)
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                               "layer's projection (embedding, LM-head and saved modules are not supported)")
        layer, module, side = int(match[1]), match[2], match[3]
        check_targets(name, [module], config, allowed)
        if layer >= config.num_layers:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key!r} names layer {layer}, the base model has "
                               f"{config.num_layers}: made for another base model?")
        found.setdefault(module, {}).setdefault(layer, {})[side] = value
    if not found:
        raise AdapterError(f"LoRA adapter {name!r}: no LoRA weights in {path!r}")
    weights = {}
    for module, layers in found.items():
        fan_in, fan_out = shapes[module]
        a = np.zeros((config.num_layers, rank, fan_in), np.float32)
        b = np.zeros((config.num_layers, fan_out, rank), np.float32)
        for layer, sides in layers.items():
            for side, want, out in (("A", (rank, fan_in), a), ("B", (fan_out, rank), b)):
                got = sides.get(side)
                if got is None:
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has no lora_{side}")
                if tuple(got.shape) != want:
                    raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {module}.lora_{side} is "
                                       f"{list(got.shape)}, the base model wants {list(want)}: made for another "
                                       "base model?")
                out[layer] = got
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise AdapterError(f"LoRA adapter {name!r}: {module} holds NaN or infinite weights")
        weights[module] = (a, b)
    return Adapter(name, path, rank, float(scale), weights)


def _read_tensors(name: str, path: str) -> dict[str, np.ndarray]:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        other = " (adapter_model.bin is not read: save with safe_serialization)" \
            if os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
        raise AdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}{other}")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return {key: np.asarray(f.get_tensor(key), np.float32) for key in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise AdapterError(f"LoRA adapter {name!r}: {file} is not a readable safetensors file ({e})") from e


def write_random_adapter(path: str, config: ModelConfig, rank: int, modules, seed: int = 0, alpha: float | None = None,
                         std: float = 0.02) -> str:
    """A random adapter for `config` in PEFT's format at `path` (studies and benchmarks: no
    download, no torch): Gaussian A and B (B non-zero, so it changes the outputs) on `modules`."""
    from safetensors.numpy import save_file

    shapes = module_shapes(config)
    check_targets(os.path.basename(path), modules, config, MODULES)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in modules:
            fan_in, fan_out = shapes[module]
            part = "mlp" if module in MLP_TARGETS else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, std, (rank, fan_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, std, (fan_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
                   "target_modules": list(modules), "bias": "none", "use_rslora": False}, f)
    return path
