"""Published GPU measurements, and the simulator's prediction of each.

A measurement names a model shape, an accelerator preset, tensor parallelism, weight and
KV dtypes, a benchmark mode and one metric:

- `static`: one batch of `batch` requests, all `input` tokens in and exactly `output`
  out (TensorRT-LLM's gptSessionBenchmark). `throughput_per_gpu` is output tokens per
  second over the batch's latency, per GPU; `ttft_ms` (with batch 1) its first token.
- `closed_loop`: `concurrency` requests in flight, the next one sent as one finishes
  (AIPerf, `vllm bench serve --max-concurrency`). `ttft_ms` / `itl_ms` are means,
  `throughput` output tokens per second of the deployment.

Both run the real scheduler (`LLM(..., simulate=...)`) on the paged cache with the
ragged-kernel cost (`attention="pallas"`), EOS ignored; a source's `scheduler` options
(say `merge_mode="fused"` for TensorRT-LLM's in-flight batching, which runs new prompts
and running decodes in one forward pass) apply to its closed-loop rows.
"""

from __future__ import annotations

import dataclasses
import json

MODES = ("static", "closed_loop")
METRICS = {"static": ("throughput_per_gpu", "ttft_ms"), "closed_loop": ("throughput", "ttft_ms", "itl_ms")}
ROLES = ("fit", "validate")


@dataclasses.dataclass(frozen=True)
class Measurement:
    id: str
    source: str
    role: str
    model: str
    accelerator: str
    mode: str
    input: int
    output: int
    metric: str
    published: float
    tp: int = 1
    weight_dtype: str = "bfloat16"
    kv_dtype: str | None = None
    batch: int = 1
    concurrency: int = 1
    engine: dict = dataclasses.field(default_factory=dict)  # what its source's engine differs in (Efficiency)
    scheduler: dict = dataclasses.field(default_factory=dict)  # how its source's engine batches (LLM options)
    note: str = ""

    @property
    def setup(self) -> str:
        dtype = self.weight_dtype + (f"/kv {self.kv_dtype}" if self.kv_dtype and self.kv_dtype != self.weight_dtype
                                     else "")
        load = f"batch {self.batch}" if self.mode == "static" else f"{self.concurrency} in flight"
        return f"{self.model} {self.accelerator} x{self.tp} {dtype}, {self.input}/{self.output}, {load}"


def load(path: str) -> tuple[dict, list[Measurement]]:
    """The sources and measurements of a published-figures file, checked."""
    from cbjax.simulator.hardware import ACCELERATORS, MODEL_SHAPES

    try:
        with open(path) as f:
            data = json.load(f)
        sources = data["sources"]
        rows = [Measurement(**row, engine=dict(sources[row["source"]].get("efficiency", {}).get(row["accelerator"], {})),
                            scheduler=dict(sources[row["source"]].get("scheduler", {})))
                for row in data["measurements"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a file of published measurements: {e}") from None
    for m in rows:
        problems = [msg for bad, msg in (
            (m.source not in sources, f"source {m.source!r} is not among {sorted(sources)}"),
            (m.role not in ROLES, f"role must be one of {ROLES}"),
            (m.model not in MODEL_SHAPES, f"model must be one of {sorted(MODEL_SHAPES)}"),
            (m.accelerator not in ACCELERATORS, f"accelerator must be one of {sorted(ACCELERATORS)}"),
            (m.mode not in MODES, f"mode must be one of {MODES}"),
            (m.metric not in METRICS.get(m.mode, ()), f"metric must be one of {METRICS.get(m.mode)}"),
            (min(m.input, m.output, m.batch, m.concurrency, m.tp) < 1, "lengths, batch, concurrency and tp are >= 1"),
            (not m.published > 0, "published must be > 0"),
            (not set(m.engine) <= _efficiency_fields(), f"engine keys must be among {sorted(_efficiency_fields())}"))
            if bad]
        if problems:
            raise ValueError(f"{path}: measurement {m.id!r}: " + "; ".join(problems))
    return sources, rows


def simulate(m: Measurement, accelerator=None, requests_per_client: int = 8) -> float:
    """The simulator's value of `m.metric` (on `accelerator`, default the named preset)."""
    from cbjax import LLM
    from cbjax.metrics import summarize_outputs
    from cbjax.simulator.cost_model import RooflineCost
    from cbjax.simulator.hardware import ACCELERATORS, MODEL_SHAPES
    from cbjax.workload import LengthDist, synthetic

    config = MODEL_SHAPES[m.model]
    accelerator = (accelerator or ACCELERATORS[m.accelerator]).with_efficiency(**m.engine)
    cost = RooflineCost(accelerator, config, tensor_parallel=m.tp,
                        weight_dtype=m.weight_dtype, kv_dtype=m.kv_dtype)
    n = m.batch if m.mode == "static" else max(requests_per_client * m.concurrency, 2 * m.concurrency + 4)
    slots = m.batch if m.mode == "static" else m.concurrency
    page = 16
    max_len = -(-(m.input + m.output) // page) * page
    work = synthetic(n, prompt_len=LengthDist("fixed", value=m.input), output_len=LengthDist("fixed", value=m.output),
                     vocab_size=config.vocab_size, seed=0)
    options = dict(dtype="bfloat16", kv_cache="paged", attention="pallas", page_size=page, num_slots=slots,
                   num_pages=slots * (max_len // page), max_seq_len=max_len, tensor_parallel=m.tp,
                   max_prefill_tokens=max(m.input, 8192), weight_dtype=m.weight_dtype, kv_dtype=m.kv_dtype,
                   # The presets were fitted on prefill calls of at most 8 prompts (the engine's
                   # call size then); these rows keep that size until they are refitted.
                   max_step_tokens=8 * m.input)
    if m.mode == "static":
        llm = LLM(m.model, simulate=cost, policy="static", batch_size=m.batch, **options)
        start = llm.clock()
        outs = llm.generate([w.prompt for w in work], [w.sampling for w in work], use_tqdm=False)
        metrics = summarize_outputs(outs, duration=llm.clock() - start)
        if m.metric == "ttft_ms":
            return metrics["mean_ttft_ms"]
        return metrics["output_throughput"] / m.tp
    if m.scheduler.get("merge_mode") in ("fused", "chunked"):
        options.pop("max_prefill_tokens")
    llm = LLM(m.model, simulate=cost, **{**options, **m.scheduler})
    outs = llm.replay([w.as_tuple() for w in work], use_tqdm=False, concurrency=m.concurrency)
    metrics = summarize_outputs(outs)
    return {"throughput": metrics["output_throughput"], "ttft_ms": metrics["mean_ttft_ms"],
            "itl_ms": metrics["mean_itl_ms"]}[m.metric]


def _efficiency_fields() -> set[str]:
    from cbjax.simulator.hardware import Efficiency

    return {f.name for f in dataclasses.fields(Efficiency)}


# What `fit` may move for an accelerator, with the prior it is pulled toward and its range;
# a source's own engine parameters (its "fit" list) get ENGINE_PARAMETERS'.
FIT_PARAMETERS = {"compute": (0.7, 0.3, 0.95), "half_tokens": (64.0, 1.0, 2048.0), "half_inner": (512.0, 1.0, 16384.0),
                  "bandwidth": (0.8, 0.5, 0.95), "overlap": (0.5, 0.01, 1.0), "pass_overhead_s": (100e-6, 5e-6, 2e-3),
                  "prefill_overhead_s": (1e-3, 1e-5, 2e-2), "all_reduce_overhead_s": (10e-6, 1e-6, 2e-4)}
ENGINE_PARAMETERS = {"gqa_kv_reads": (2.0, 1.0, 8.0), "call_overhead_s": (1e-3, 1e-5, 2e-2),
                     "compute": (0.6, 0.2, 0.95), "bandwidth": (0.8, 0.5, 0.95), "prefill_overhead_s": (1e-3, 1e-5, 2e-2),
                     "pass_overhead_s": (100e-6, 5e-6, 2e-3), "all_reduce_overhead_s": (10e-6, 1e-6, 2e-4)}


def fit(rows: list[Measurement], accelerator, source_keys: dict[str, list[str]], prior_weight: float = 0.05,
        max_evaluations: int = 400, start: dict | None = None) -> tuple[dict, dict[str, dict], float]:
    """Efficiencies of `accelerator`, and each source's own engine parameters
    (`source_keys`), that minimise the squared log error of the simulated `rows`, pulled
    weakly (in log space) toward the priors; Nelder-Mead from the priors, or from `start`
    ({name: value} for the accelerator's, {source: {name: value}} for a source's).
    Returns (efficiency, {source: engine}, loss)."""
    import numpy as np
    from scipy.optimize import minimize

    names = [("", n, FIT_PARAMETERS[n]) for n in FIT_PARAMETERS]
    names += [(source, n, ENGINE_PARAMETERS[n]) for source, keys in sorted(source_keys.items()) for n in keys]
    low, prior, high = (np.log([spec[i] for _, _, spec in names]) for i in (1, 0, 2))

    def unpack(x):
        values = np.exp(np.clip(x, low, high))
        shared = {n: float(v) for (source, n, _), v in zip(names, values) if not source}
        engines: dict[str, dict] = {}
        for (source, n, _), v in zip(names, values):
            if source:
                engines.setdefault(source, {})[n] = float(v)
        return shared, engines

    def loss(x):
        shared, engines = unpack(x)
        device = accelerator.with_efficiency(**shared)
        total = sum(np.log(simulate(dataclasses.replace(m, engine={**m.engine, **engines.get(m.source, {})}),
                                    device) / m.published) ** 2 for m in rows)
        return total + prior_weight * float(np.sum((np.clip(x, low, high) - prior) ** 2)) / len(x)

    start = start or {}
    given = [start.get(source, {}).get(n) if source else start.get(n) for source, n, _ in names]
    x0 = np.array([np.log(value) if value else p for value, p in zip(given, prior)])  # 0 or missing: the prior
    result = minimize(loss, x0, method="Nelder-Mead", options={"maxfev": max_evaluations, "xatol": 1e-3,
                                                                   "fatol": 1e-6})
    shared, engines = unpack(result.x)
    return shared, engines, float(result.fun)
