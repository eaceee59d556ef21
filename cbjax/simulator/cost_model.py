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
from cbjax.simulator.hardware import ACCELERATORS, Accelerator, kv_bytes_per_token, matmul_params, weight_bytes

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

    def features(self) -> np.ndarray:
        return np.array([self.steps, self.tokens, self.attended, self.kv_read, self.rows], np.float64)


class RooflineCost:
    """max(FLOPs at the assumed compute efficiency, bytes at the assumed bandwidth
    efficiency) + a fixed overhead per forward pass. Bytes: the weights once per forward
    pass plus the keys and values read."""

    def __init__(self, accelerator: Accelerator, config: ModelConfig, dtype_bytes: int = 2):
        self.accelerator = accelerator
        self.config = config
        self.dtype_bytes = dtype_bytes
        self._matmul_flops_per_token = 2.0 * matmul_params(config)
        self._attention_flops_per_pair = 4.0 * config.num_layers * config.num_heads * config.head_dim
        self._weight_bytes = float(weight_bytes(config, dtype_bytes))
        self._kv_bytes = float(kv_bytes_per_token(config, dtype_bytes))

    def seconds(self, call: Call) -> float:
        a = self.accelerator
        flops = self._matmul_flops_per_token * call.tokens + self._attention_flops_per_pair * call.attended
        memory = self._weight_bytes * call.steps + self._kv_bytes * call.kv_read
        return call.steps * a.call_overhead_s + max(flops / (a.peak_flops * a.compute_efficiency),
                                                    memory / (a.hbm_bytes_per_s * a.bandwidth_efficiency))

    def describe(self) -> dict:
        return {"cost_model": "roofline", **dataclasses.asdict(self.accelerator), "dtype_bytes": self.dtype_bytes}


class CalibratedCost:
    """seconds = coefficients[kind] . features(call), fitted on measured rounds."""

    def __init__(self, coefficients: dict[str, dict[str, float]], info: dict | None = None):
        self.coefficients = coefficients
        self.info = info or {}
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


def load_cost_model(spec: str, config: ModelConfig, dtype_bytes: int = 2):
    """`spec` is an accelerator name (roofline) or a calibration JSON file."""
    if spec.endswith(".json"):
        return CalibratedCost.load(spec)
    if spec.lower() in ACCELERATORS:
        return RooflineCost(ACCELERATORS[spec.lower()], config, dtype_bytes)
    raise ValueError(f"--simulate must be an accelerator ({', '.join(ACCELERATORS)}) or a calibration .json file, "
                     f"got {spec!r}")
