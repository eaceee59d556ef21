"""Model configuration: one frozen dataclass for every supported family.

`ModelConfig` is hashable so it can be a static argument of `jax.jit`. It is
built from a Hugging Face `config.json` (`from_hf_dict`), from GGUF metadata
(see `checkpoint.py`), or from a named preset (`presets.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    # "rope" (llama-like) or "learned" (gpt2)
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    # Sorted (key, value) pairs of the HF rope_scaling dict; () for plain RoPE.
    rope_scaling: tuple = ()
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # OLMoE normalizes the whole q and k projections ([heads * head_dim]), not each head.
    qk_norm_whole: bool = False
    clip_qkv: float | None = None
    # Per layer: the sliding-window size, or 0 for full attention.
    sliding_windows: tuple = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple = ()
    # Mixture of experts (cbjax/models/moe.py); num_experts 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Qwen2-MoE's shared expert beside the routed ones (0: none), with its sigmoid gate.
    shared_expert_intermediate_size: int = 0
    # Per layer: whether its MLP is the experts (True) or one dense MLP (False); () = all MoE.
    moe_layers: tuple = ()
    # Tokens an expert takes in one call: ceil(factor * tokens * top_k / experts), the rest dropped
    # (their expert's share is zero). None: no token is ever dropped (the default).
    expert_capacity_factor: float | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(f"unknown position_embedding {self.position_embedding!r}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows needs one entry per layer")
        self._check_moe()

    def _check_moe(self):
        if not self.num_experts:
            if self.moe_layers and any(self.moe_layers):
                raise ValueError("moe_layers names expert layers but num_experts is 0")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ValueError("moe_layers needs one entry per layer")
        factor = self.expert_capacity_factor
        if factor is not None and not factor > 0:
            raise ValueError(f"expert_capacity_factor must be > 0 (or None: drop no token), got {factor}")

    @property
    def is_gpt2(self) -> bool:
        return self.model_type == "gpt2"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def check_expert_parallel(self, expert_parallel: int) -> None:
        """Refuse (ValueError) spreading this model's experts over `expert_parallel` devices where
        it is dense or the count does not divide its experts."""
        if expert_parallel > 1 and not self.is_moe:
            raise ValueError(f"expert_parallel={expert_parallel} spreads a mixture of experts; "
                             f"{self.model_type!r} is dense")
        if self.is_moe and self.num_experts % expert_parallel:
            raise ValueError(f"expert_parallel={expert_parallel} must divide the model's num_experts "
                             f"({self.num_experts})")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the routed experts."""
        return self.is_moe and (not self.moe_layers or bool(self.moe_layers[layer]))

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def windows(self) -> tuple:
        return self.sliding_windows or (0,) * self.num_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = _freeze(d.get("rope_scaling") or {})
        d["sliding_windows"] = tuple(d.get("sliding_windows") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        d["moe_layers"] = tuple(d.get("moe_layers") or ())
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        return _from_hf(hf)

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {path!r}")
        with open(config_path) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{config_path}: not valid JSON ({e})") from e
        try:
            return _from_hf(hf)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{config_path}: missing or malformed field {e}") from e


def _freeze(d: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


def _eos_tuple(eos: Any) -> tuple:
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def _rope_fields(hf: dict) -> tuple[float, tuple]:
    """RoPE theta and scaling from either transformers v5 `rope_parameters` or v4 fields."""
    params = dict(hf.get("rope_parameters") or {})
    if hf.get("rope_scaling"):
        params.update(hf["rope_scaling"])
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    if params.get("rope_type", "default") == "default":
        params = {}
    return theta, _freeze(params)


def _sliding_windows(hf: dict, model_type: str, num_layers: int) -> tuple:
    window = hf.get("sliding_window")
    if not window:
        return ()
    layer_types = hf.get("layer_types")
    if layer_types:
        return tuple(int(window) if t == "sliding_attention" else 0 for t in layer_types)
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not hf.get("use_sliding_window", False):
            return ()
        max_window_layers = hf.get("max_window_layers", num_layers)
        return tuple(int(window) if i >= max_window_layers else 0 for i in range(num_layers))
    return (int(window),) * num_layers


def _from_hf(hf: dict) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if model_type == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise ValueError("gpt2 attention-scaling variants other than 1/sqrt(head_dim) are not supported")
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"gpt2 activation {act!r} is not supported (gelu_new only)")
        d = hf["n_embd"]
        heads = hf["n_head"]
        return ModelConfig(
            model_type="gpt2",
            vocab_size=hf["vocab_size"],
            hidden_size=d,
            num_layers=hf["n_layer"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=d // heads,
            intermediate_size=hf.get("n_inner") or 4 * d,
            max_position_embeddings=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            position_embedding="learned",
            tie_embeddings=hf.get("tie_word_embeddings", True),
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
        )

    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    theta, scaling = _rope_fields(hf)
    if dict(scaling).get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    heads = hf["num_attention_heads"]
    num_layers = hf["num_hidden_layers"]
    attention_bias = bool(hf.get("attention_bias", False))
    qwen2_like = model_type in ("qwen2", "qwen2_moe")
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or (qwen2_like and hf.get("qkv_bias", True)),
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_whole=model_type == "olmoe",
        clip_qkv=hf.get("clip_qkv"),
        sliding_windows=_sliding_windows(hf, model_type, num_layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_tuple(hf.get("eos_token_id")),
        **(_moe_fields(hf, model_type, num_layers) if model_type in MOE_MODEL_TYPES else {}),
    )


def _moe_fields(hf: dict, model_type: str, num_layers: int) -> dict:
    """The experts of a MoE config, under either spelling of the expert count (`num_experts`,
    `num_local_experts`: the hub's files and current transformers differ by family)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise ValueError(f"a {model_type} config needs num_experts (or num_local_experts) > 0, got {experts!r}")
    if model_type == "mixtral":  # Mixtral: the experts' width is intermediate_size; top-k always renormalized
        return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    width = hf.get("moe_intermediate_size") or hf["intermediate_size"]  # OLMoE: intermediate_size
    sparse_step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense_only = set(hf.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense_only and (i + 1) % sparse_step == 0 for i in range(num_layers))
    return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(width), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0,
                moe_layers=() if all(moe_layers) else moe_layers)
