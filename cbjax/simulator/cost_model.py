"""What one device call of the engine costs: a roofline for a named accelerator, or a
linear model fitted to measured rounds of this engine on this machine.

A call is described by what the engine's program computes (padded shapes, as compiled):
`tokens` query positions, `attended` query-key pairs, `kv_read` key positions read
from memory, `rows` requests touched (the host's per-request work scales with it) and
`steps` forward passes.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from cbjax.config import ModelConfig
from cbjax.runtime.scale.expert_parallel import link_bytes_per_layer
from cbjax.simulator.hardware import (ACCELERATORS, DTYPE_BYTES, LINKS, Accelerator, Link, expert_params,
                                      gemm_inner_dim, kv_bytes_per_token, matmul_params, moe_layers, weight_bytes)

KINDS = ("prefill", "decode", "mixed")
FEATURES = ("steps", "tokens", "attended", "kv_read", "rows")


@dataclasses.dataclass(frozen=True)
class Call:
    kind: str
    tokens: int
    attended: int
    kv_read: int
    rows: int
    steps: int = 1
    adapter_bytes: float = 0.0  # LoRA adapters' bytes each forward pass reads (its rows' distinct adapters)

    def features(self) -> np.ndarray:
        return np.array([self.steps, self.tokens, self.attended, self.kv_read, self.rows], np.float64)


class RooflineCost:
    """What an engine on `accelerator` takes for a call (every term in docs/simulator.md):

        compute = FLOPs / (tp x peak(weight dtype) x compute x M / (M + half_tokens)),
                  M = query tokens per forward pass, the matmuls' FLOPs further over
                  K / (K + half_inner), K their per-device inner dimension
        memory  = ((weights + LoRA adapters read) x steps + KV bytes read) / (tp x HBM bandwidth x bandwidth efficiency)
        device  = max(compute, memory) + (1 - overlap) x min(compute, memory)
        comm    = steps x 2 x layers x (ring all-reduce(M x hidden x 2 bytes) + all-reduce overhead)
                  (+ steps x MoE layers x (link bytes of expert parallelism + 3 collective overheads))
        host    = steps x (pass overhead + rows x request overhead) + call overhead
                  (+ prefill overhead for a call that prefills)

    FLOPs: 2 x matmul weights per query token, plus 4 x layers x heads x head_dim per
    attended query-key pair (the engine reports causal pairs where its kernels skip the
    masked half, the padded square where they do not).

    A mixture of experts (docs/moe.md) reads, per forward pass of M tokens, its dense weights and
    the experts its tokens touch: sum over experts of 1 - (1 - p_e)^M of each layer's experts, p_e
    the chance that a token routes to expert e (`routing`: tokens per expert measured, else uniform,
    p_e = k / E). Under `expert_parallel` each device holds E / ep experts and computes their share
    of the expert FLOPs; attention is replicated over ep; the all-to-alls' bytes
    (runtime/scale/expert_parallel.py) cross the accelerator's link."""

    def __init__(self, accelerator: Accelerator, config: ModelConfig, dtype_bytes: float = 2,
                 tensor_parallel: int = 1, weight_dtype: str | None = None, kv_dtype: str | None = None,
                 expert_parallel: int = 1, routing=None):
        if tensor_parallel < 1 or config.num_kv_heads % tensor_parallel and tensor_parallel % config.num_kv_heads:
            raise ValueError(f"tensor_parallel={tensor_parallel} does not divide {config.num_kv_heads} KV heads")
        default = {4: "float32", 2: "bfloat16", 1: "fp8"}.get(dtype_bytes, "bfloat16")
        self.weight_dtype = weight_dtype or default
        self.kv_dtype = kv_dtype or self.weight_dtype
        for name, dtype in (("weight_dtype", self.weight_dtype), ("kv_dtype", self.kv_dtype)):
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {tuple(DTYPE_BYTES)}, got {dtype!r}")
        self.accelerator = accelerator
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.link = LINKS[accelerator.link]
        self.host_link = LINKS[accelerator.host_link]
        self._matmul_flops_per_token = 2.0 * matmul_params(config)
        self._inner_dim = gemm_inner_dim(config, tensor_parallel)
        self._attention_flops_per_pair = 4.0 * config.num_layers * config.num_heads * config.head_dim
        self._weight_bytes = float(weight_bytes(config, DTYPE_BYTES[self.weight_dtype]))
        self._kv_bytes = float(kv_bytes_per_token(config, DTYPE_BYTES[self.kv_dtype]))
        self._peak = accelerator.peak_for(self.weight_dtype)
        self._moe(config, expert_parallel, routing)

    def _moe(self, config: ModelConfig, expert_parallel: int, routing) -> None:
        """The mixture of experts' terms (none for a dense model): the routed experts' bytes and
        FLOPs per token, each expert's chance of a token, the expert-parallel degree."""
        config.check_expert_parallel(expert_parallel)
        self.expert_parallel = expert_parallel
        if not config.is_moe:
            self._expert_bytes, self._expert_flops_per_token, self._route = 0.0, 0.0, None
            return
        self._expert_bytes = expert_params(config) * DTYPE_BYTES[self.weight_dtype]
        self._expert_flops_per_token = 2.0 * expert_params(config, config.num_experts_per_tok)
        share = np.full(config.num_experts, 1.0 / config.num_experts) if routing is None else np.asarray(routing, float)
        if share.shape != (config.num_experts,) or (share < 0).any() or not share.sum() > 0:
            raise ValueError(f"routing must give {config.num_experts} non-negative token counts, one per expert")
        self._route = np.minimum(config.num_experts_per_tok * share / share.sum(), 1.0)

    def experts_read(self, tokens: float) -> float:
        """Experts of one layer that `tokens` tokens touch, in expectation."""
        return float(np.sum(1.0 - (1.0 - self._route) ** tokens)) if self._route is not None else 0.0

    def seconds(self, call: Call) -> float:
        a, e, tp = self.accelerator, self.accelerator.efficiency, self.tensor_parallel
        ep = self.expert_parallel
        inner = self._inner_dim / (self._inner_dim + e.half_inner)
        expert_flops = self._expert_flops_per_token * call.tokens / inner
        flops = ((self._matmul_flops_per_token * call.tokens / inner - expert_flops) + expert_flops / ep
                 + self._attention_flops_per_pair * call.attended)
        rows_per_pass = call.tokens / max(call.steps, 1)
        efficiency = e.compute * rows_per_pass / (rows_per_pass + e.half_tokens)
        compute = flops / (tp * self._peak * efficiency) if flops else 0.0
        kv_bytes = self._kv_bytes * call.kv_read
        if call.kind != "prefill":
            kv_bytes *= min(e.gqa_kv_reads, self.config.num_heads / self.config.num_kv_heads)
        experts = self._expert_bytes * self.experts_read(rows_per_pass) / max(self.config.num_experts, 1) / ep
        memory = ((self._weight_bytes - self._expert_bytes + experts + call.adapter_bytes) * call.steps + kv_bytes) / (
            tp * a.hbm_bytes_per_s * e.bandwidth)
        device = max(compute, memory) + (1.0 - e.overlap) * min(compute, memory)
        comm = 0.0
        if tp > 1:
            one = self.link.all_reduce_seconds(rows_per_pass * self.config.hidden_size * 2.0, tp)
            comm = call.steps * 2 * self.config.num_layers * (one + e.all_reduce_overhead_s)
        if ep > 1:
            exchange = link_bytes_per_layer(round(rows_per_pass), self.config.num_experts_per_tok,
                                            self.config.hidden_size, ep, DTYPE_BYTES[self.weight_dtype])
            comm += call.steps * moe_layers(self.config) * (
                self.link.transfer_seconds(exchange) + 3 * e.all_reduce_overhead_s)
        host = call.steps * (e.pass_overhead_s + call.rows * e.request_overhead_s) + e.call_overhead_s
        if call.kind == "prefill" or call.tokens > call.rows:  # the call prefills something
            host += e.prefill_overhead_s
        return device + comm + host

    def describe(self) -> dict:
        return {"cost_model": "roofline", "accelerator": dataclasses.asdict(self.accelerator),
                "link": dataclasses.asdict(self.link), "tensor_parallel": self.tensor_parallel,
                "expert_parallel": self.expert_parallel,
                "weight_dtype": self.weight_dtype, "kv_dtype": self.kv_dtype}


class CalibratedCost:
    """seconds = coefficients[kind] . features(call), fitted on measured rounds."""

    def __init__(self, coefficients: dict[str, dict[str, float]], info: dict | None = None):
        self.coefficients = coefficients
        self.info = info or {}
        # The host tier on a CPU: a copy within host memory, at the bandwidth the calibration
        # measured (else a default a 2-core machine reaches), and a call's fixed cost.
        self.host_link = Link("host memory copy (this CPU)", self.info.get("host_copy_bytes_per_s", 4e9), 50e-6)
        self._vectors = {k: np.array([coefficients[k][f] for f in FEATURES]) for k in KINDS}

    def seconds(self, call: Call) -> float:
        return float(self._vectors[call.kind] @ call.features())

    @classmethod
    def fit(cls, rounds: list[tuple[list[Call], float]], info: dict | None = None) -> "CalibratedCost":
        """Non-negative least squares of each round's measured seconds on the summed
        features of its calls, one coefficient per (kind, feature)."""
        if not rounds:
            raise ValueError("no measured rounds to fit")
        design = np.stack([_round_features(calls) for calls, _ in rounds])
        seconds = np.array([s for _, s in rounds])
        coef = _nonnegative_lstsq(design, seconds)
        predicted = design @ coef
        rel = np.abs(predicted - seconds) / np.maximum(seconds, 1e-9)
        fit = {"rounds": len(rounds), "median_abs_rel_error": float(np.median(rel)),
               "total_rel_error": float(abs(predicted.sum() - seconds.sum()) / seconds.sum())}
        coefficients = {k: {f: float(coef[i * len(FEATURES) + j]) for j, f in enumerate(FEATURES)}
                        for i, k in enumerate(KINDS)}
        return cls(coefficients, {**(info or {}), "fit": fit})

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"cost_model": "calibrated", "coefficients": self.coefficients, **self.info}, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CalibratedCost":
        try:
            with open(path) as f:
                data = json.load(f)
            coefficients = data.pop("coefficients")
            data.pop("cost_model", None)
            return cls({k: {f: float(coefficients[k][f]) for f in FEATURES} for k in KINDS}, data)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is not a calibration file of the simulator: {e}") from None

    def describe(self) -> dict:
        return {"cost_model": "calibrated", **self.info}


def _round_features(calls: list[Call]) -> np.ndarray:
    x = np.zeros(len(KINDS) * len(FEATURES))
    for call in calls:
        i = KINDS.index(call.kind) * len(FEATURES)
        x[i:i + len(FEATURES)] += call.features()
    return x


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: solve, drop the negative ones, repeat.
    Columns are scaled to unit norm first (tokens and query-key pairs differ by 1e6)."""
    norms = np.linalg.norm(a, axis=0)
    used = norms > 0
    coef = np.zeros(a.shape[1])
    while used.any():
        cols = np.flatnonzero(used)
        solution, *_ = np.linalg.lstsq(a[:, cols] / norms[cols], b, rcond=None)
        solution /= norms[cols]
        if (solution >= 0).all():
            coef[cols] = solution
            break
        used[cols[solution < 0]] = False
    return coef


def kv_transfer_cost(cost, config: ModelConfig, dtype: str, parallel: int = 1, link: str | None = None):
    """What moving a prefilled sequence's KV between instances takes, `(seconds(tokens),
    bytes per token)`: its bytes at the cost model's KV dtype over `link` (default: the
    accelerator's; a calibrated CPU cost, which has none, PCIe 4), split over `parallel`
    device pairs sending their shards at once."""
    kv_dtype = getattr(cost, "kv_dtype", dtype)
    per_token = kv_bytes_per_token(config, DTYPE_BYTES.get(kv_dtype, 4))
    if link is not None and link not in LINKS:
        raise ValueError(f"kv_link must be one of {tuple(LINKS)}, got {link!r}")
    over = LINKS[link] if link is not None else getattr(cost, "link", LINKS["pcie4"])
    return (lambda tokens: over.transfer_seconds(per_token * tokens / parallel)), per_token


def load_cost_model(spec: str, config: ModelConfig, dtype_bytes: int = 2, tensor_parallel: int = 1,
                    weight_dtype: str | None = None, kv_dtype: str | None = None, expert_parallel: int = 1):
    """`spec` is an accelerator name (roofline) or a calibration JSON file (measured on
    one device of this machine: no tensor parallelism, no other dtypes)."""
    if spec.endswith(".json") and config.is_moe:  # a fitted line has no term for the experts a batch touches
        raise ValueError(f"{spec}: a calibration fitted on a dense model does not price a mixture of experts "
                         f"({config.model_type!r}): simulate an accelerator")
    if spec.endswith(".json"):
        if tensor_parallel > 1 or expert_parallel > 1 or weight_dtype or kv_dtype:
            raise ValueError(f"{spec} was calibrated on one device at its own dtype: simulate an accelerator "
                             "for tensor_parallel, expert_parallel, weight_dtype or kv_dtype")
        return CalibratedCost.load(spec)
    if spec.lower() in ACCELERATORS:
        return RooflineCost(ACCELERATORS[spec.lower()], config, dtype_bytes, tensor_parallel, weight_dtype, kv_dtype,
                            expert_parallel)
    raise ValueError(f"--simulate must be an accelerator ({', '.join(ACCELERATORS)}) or a calibration .json file, "
                     f"got {spec!r}")
