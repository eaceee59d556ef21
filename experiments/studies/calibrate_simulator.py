"""Calibrate the scheduling simulator on this machine: time every round of the real engine
over a profile of configurations, fit the simulator's cost model to those rounds, and
write it as JSON for `--simulate=<file>`.

The profile (slot counts x policies, random prompt and output lengths) is deliberately
not the workloads the simulator is then validated on (experiments/studies/validate_simulator.py).

    python -m experiments calibrate_simulator                          # SmolLM2 on this CPU
    python -m experiments calibrate_simulator --model=tiny-llama --output=results/sim_tiny.json
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_list("slots", ["4", "16", "48"], "Slot counts to profile.")
flags.DEFINE_list("max_seq_lens", ["64", "256"], "Context lengths to profile (each with every slot count).")
flags.DEFINE_list("policies", ["static", "continuous"], "Policies to profile (static leaves slots idle in a batch).")
flags.DEFINE_bool("paged", False, "Also profile the paged cache (continuous, pool of 3/4 of the slots' memory).")
flags.DEFINE_list("merge_modes", [], "Also profile these mixed-step modes (fused, chunked), continuous.")
flags.DEFINE_integer("num_requests", 40, "Requests per profiled configuration.", lower_bound=1)
EngineArgs.define_flags(["dtype"])
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_string("output", "results/sim_calibration.json", "Where the fitted cost model goes.")
flags.DEFINE_bool("host_costs", False, "Instead: time this engine's host work per round (free simulated device "
                  "calls) and print the per-call and per-request costs to add to an accelerator preset.")
common.validate_list("slots", int, 1, "positive integers")
common.validate_list("max_seq_lens", int, 8, "context lengths >= 8")
common.validate_list("policies", lambda p: 0 if p in ("static", "dynamic", "continuous") else -1, 0,
                     "policies among static, dynamic, continuous")
flags.register_validator("merge_modes", lambda v: all(m in ("fused", "chunked") for m in v),
                         message="--merge_modes must be among fused, chunked")


def configurations() -> list[tuple[str, dict]]:
    runs = []
    for max_len in (int(x) for x in FLAGS.max_seq_lens):
        for slots in (int(x) for x in FLAGS.slots):
            base = dict(num_slots=slots, max_seq_len=max_len, dtype=FLAGS.dtype)
            runs += [(f"{p} slots={slots} len={max_len}", dict(base, policy=p)) for p in FLAGS.policies]
            if FLAGS.paged:
                pages = max(max_len // 16, slots * max_len * 3 // 4 // 16)
                runs.append((f"paged slots={slots} len={max_len}",
                             dict(base, kv_cache="paged", page_size=16, num_pages=pages)))
            runs += [(f"{m} slots={slots} len={max_len}", dict(base, merge_mode=m)) for m in FLAGS.merge_modes]
    return runs


def main(argv):
    del argv
    from tqdm.auto import tqdm

    from cbjax import LLM
    from cbjax.experimental import calibrate, LengthDist, load_model, machine_info, profile_rounds, synthetic

    start = time.perf_counter()
    if FLAGS.host_costs:
        from cbjax.experimental import measure_host_costs

        host = measure_host_costs()
        print(f"this engine's host, per round: {1e6 * host['call_overhead_s']:.0f} us + "
              f"{1e6 * host['request_overhead_s']:.2f} us per running request ({host['rounds']} rounds, median "
              f"{1e6 * host['median_round_s']:.0f} us)")
        return
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, with_tokenizer=False)
    rounds, profiled = [], []
    for name, options in tqdm(configurations(), desc="profiling", unit="config"):
        max_len = options["max_seq_len"]
        work = synthetic(FLAGS.num_requests, prompt_len=LengthDist("uniform", low=4, high=max_len // 2),
                         output_len=LengthDist("capped_exponential", mean=max_len / 6, cap=max_len // 2 - 1),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed + len(profiled))
        common.release_programs()
        llm = LLM(model, **options)
        llm.warmup()
        measured = profile_rounds(llm, [(w.prompt, w.sampling) for w in work])
        rounds += measured
        profiled.append({"name": name, "options": options, "rounds": len(measured),
                         "seconds": sum(s for _, s in measured)})
    cost = calibrate(rounds, {"model": FLAGS.model, "dtype": FLAGS.dtype, "machine": machine_info(),
                              "profile": profiled})
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    cost.save(FLAGS.output)
    fit = cost.info["fit"]
    print(f"\nfitted {fit['rounds']} rounds from {len(profiled)} configurations: median |error| per round "
          f"{100 * fit['median_abs_rel_error']:.1f}%, total time error {100 * fit['total_rel_error']:.2f}%")
    for kind, coefficients in cost.coefficients.items():
        print(f"  {kind:<8}" + "  ".join(f"{k}={v:.3g}" for k, v in coefficients.items()))
    print(f"wrote {FLAGS.output} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
