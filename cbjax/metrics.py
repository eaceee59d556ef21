"""Serving metrics under the names `vllm bench serve` uses, so numbers line up.

Per request: TTFT (first token - arrival), TPOT ((e2e - TTFT) / (output tokens - 1)),
ITL (gaps between consecutive tokens), E2EL (finish - arrival). Per run: request,
output-token and total-token throughput over the run's duration, mean / median /
std / p90 / p99 of each latency in milliseconds, and goodput: requests per second
that met every given SLO.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class SLO:
    """Limits in milliseconds; None means no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met(self, ttft: float, tpot: float | None, e2el: float) -> bool:
        return ((self.ttft_ms is None or 1000 * ttft <= self.ttft_ms)
                and (self.tpot_ms is None or tpot is None or 1000 * tpot <= self.tpot_ms)
                and (self.e2el_ms is None or 1000 * e2el <= self.e2el_ms))


@dataclasses.dataclass
class RequestTimes:
    arrival: float
    first_token: float
    finish: float
    token_times: Sequence[float]
    num_prompt_tokens: int
    num_output_tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(np.asarray(self.token_times, dtype=float)))

    @classmethod
    def from_output(cls, out) -> "RequestTimes":
        m = out.metrics
        return cls(m.arrival_time, m.first_token_time, m.finish_time, m.token_times,
                   len(out.prompt_token_ids), len(out.token_ids))


def _summary(name: str, values_s: Iterable[float]) -> dict[str, float]:
    v = 1000 * np.asarray(list(values_s), dtype=float)
    if v.size == 0:
        v = np.zeros(1)
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std()), f"max_{name}_ms": float(v.max())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p))
    return out


def summarize(requests: Sequence[RequestTimes], duration: float | None = None, slo: SLO | None = None) -> dict:
    """Run metrics over finished requests. `duration` defaults to first arrival -> last finish."""
    done = [r for r in requests if r.first_token is not None and r.finish is not None]
    if not done:
        raise ValueError("no finished requests to summarize")
    if duration is None:
        duration = max(r.finish for r in done) - min(r.arrival for r in done)
    if duration <= 0:
        raise ValueError(f"run duration must be positive, got {duration}")
    total_in = sum(r.num_prompt_tokens for r in done)
    total_out = sum(r.num_output_tokens for r in done)
    result = {
        "completed": len(done),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    result.update(_summary("ttft", (r.ttft for r in done)))
    result.update(_summary("tpot", (r.tpot for r in done if r.tpot is not None)))
    result.update(_summary("itl", (gap for r in done for gap in r.itls)))
    result.update(_summary("e2el", (r.e2el for r in done)))
    if slo is not None:
        good = sum(slo.met(r.ttft, r.tpot, r.e2el) for r in done)
        result["good_requests"] = good
        result["request_goodput"] = good / duration
    return result


def summarize_outputs(outputs, duration: float | None = None, slo: SLO | None = None) -> dict:
    """`summarize` over `RequestOutput`s, skipping error/abort outputs."""
    ok = [o for o in outputs if o.finish_reason in ("stop", "length")]
    return summarize([RequestTimes.from_output(o) for o in ok], duration, slo)


def find_capacity(passes, start: float, low: float, high: float, steps: int) -> tuple[float, list[float]]:
    """The highest rate in [low, high] at which `passes(rate)` holds, assuming it holds below
    some threshold and fails above: double (or halve) from `start` to bracket the threshold,
    then bisect `steps` times. Returns (capacity, or 0.0 when even `low` fails; rates probed)."""
    probed = []

    def probe(rate):
        probed.append(rate)
        return passes(rate)

    rate = min(max(start, low), high)
    if probe(rate):
        good, bad = rate, None
        while bad is None and good < high:
            rate = min(2 * good, high)
            if probe(rate):
                good = rate
            else:
                bad = rate
        if bad is None:
            return good, probed
    else:
        good, bad = None, rate
        while good is None and bad / 2 >= low:
            rate = bad / 2
            if probe(rate):
                good = rate
            else:
                bad = rate
        if good is None:
            return 0.0, probed
    for _ in range(steps):
        rate = (good + bad) / 2
        if probe(rate):
            good = rate
        else:
            bad = rate
    return good, probed


def machine_info() -> dict:
    import jax

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [getattr(d, "device_kind", str(d)) for d in jax.devices()]}
    return info


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=_jsonable)
    return path


def _jsonable(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)
