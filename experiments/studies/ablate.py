"""Sweep one scheduler knob of continuous batching; plot throughput against median and p99 latency.

    python -m experiments ablate --knob=refill_interval --values=1,4,16
    python -m experiments ablate --knob=num_slots --values=2,4,8,16 --qps=8
    python -m experiments ablate --knob=waiting_served_ratio --values=0,0.5,1.2,3
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import engine_args
from cbjax import EngineArgs

FLAGS = flags.FLAGS
KNOBS = {  # knob -> (LLM keyword, parse)
    "refill_interval": ("refill_interval", int),
    "waiting_served_ratio": ("waiting_served_ratio", float),
    "max_waiting_steps": ("max_waiting_steps", int),
    "prefill_bucket": ("prefill_floor", int),  # smallest prefill bucket: coarser floors pad more
    "max_prefill_tokens": ("max_prefill_tokens", int),
    "num_slots": ("num_slots", int),
    "decode_steps": ("decode_steps", int),
}
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_enum("knob", "refill_interval", sorted(KNOBS), "The knob to sweep.")
flags.DEFINE_list("values", ["1", "4", "16"], "Values of the knob.")
flags.DEFINE_float("qps", 0.0, "Poisson arrival rate; 0 sends every request at once (offline).",
                   lower_bound=0.0)
EngineArgs.define_flags(["num_slots", "max_seq_len", "waiting_served_ratio", "dtype"], max_seq_len=256)
flags.adopt_module_key_flags(engine_args)  # the EngineArgs knobs, in --help
flags.DEFINE_string("output_dir", "results/ablate", "Where the JSON and the plot go.")
common.define_simulate_flag()
common.define_workload_flags(num_requests=32, output_mean=32.0, output_cap=96)
flags.adopt_module_key_flags(common)
flags.register_validator("values", lambda v: len(v) > 0, message="--values needs at least one value")


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbjax import LLM
    from cbjax.experimental import write_json

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=common.wants_tokenizer())
    arrival = "all_at_once" if FLAGS.qps <= 0 else "poisson"
    workload = common.make_workload(model, arrival, max(FLAGS.qps, 1e-9))
    keyword, parse = KNOBS[FLAGS.knob]
    runs = []
    for raw in FLAGS.values:
        value = parse(raw)
        options = dict(policy="continuous", num_slots=FLAGS.num_slots, max_seq_len=FLAGS.max_seq_len,
                       waiting_served_ratio=FLAGS.waiting_served_ratio, dtype=FLAGS.dtype)
        options[keyword] = value
        common.release_programs()
        llm = LLM(model, **options, **common.llm_options())
        metrics = common.run_replay(llm, workload, desc=f"{FLAGS.knob}={value}")
        runs.append({"value": value, **metrics})

    cols = ("output_throughput", "median_e2el_ms", "p99_e2el_ms", "median_ttft_ms", "p99_ttft_ms", "mean_running")
    header = f"{FLAGS.knob:>22}" + "".join(f"{c:>20}" for c in cols)
    table = "\n".join([header, "-" * len(header)] + [
        f"{r['value']:>22}" + "".join(f"{r[c]:>20.2f}" for c in cols) for r in runs])
    print("\n" + table)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    tput = [r["output_throughput"] for r in runs]
    for key, label in (("median_e2el_ms", "median E2E"), ("p99_e2el_ms", "p99 E2E")):
        ax.plot(tput, [r[key] for r in runs], marker="o", label=label)
        for r in runs:
            ax.annotate(f"{FLAGS.knob}={r['value']}", (r["output_throughput"], r[key]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"{FLAGS.model}: sweep of {FLAGS.knob} ({'offline' if FLAGS.qps <= 0 else f'{FLAGS.qps:g} req/s'})")
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    common.savefig(fig, os.path.join(FLAGS.output_dir, f"ablate_{FLAGS.knob}.png"))
    write_json(os.path.join(FLAGS.output_dir, f"ablate_{FLAGS.knob}.json"),
               {"flags": common.script_flags(), "runs": runs, "table": table, "wall_s": time.perf_counter() - start})
    print(f"\nwrote {FLAGS.output_dir}/ablate_{FLAGS.knob}.json and .png in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
