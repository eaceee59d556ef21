"""Which scheduling knobs win which application profile (source note 003).

Reading comprehension (long prompts sharing documents, short answers, an offline batch)
is judged by throughput, chat (short and short, Poisson) by p99 end-to-end latency,
creative writing (a short brief, a long text, Poisson) by p99 time to first token. Each
profile's workload (cbjax/workload.py `PROFILES`) is replayed under every configuration of
a knob sweep (merge mode and token budget, refill interval, waiting-served ratio,
ordering, slots, prefix caching where prompts share prefixes); the table gives each
configuration's objective against the default's and the winner per profile.

    python -m experiments profiles --flagfile=configs/profiles_cpu.cfg      # SmolLM2 on this CPU
    python -m experiments profiles --flagfile=configs/profiles_h100.cfg     # Llama-3-8B shape, simulated H100
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments.lib import common

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory (a "
                    "shape under --simulate).")
flags.DEFINE_list("profiles", ["reading", "chat", "creative"], "Profiles to run (cbjax/workload.py PROFILES).")
flags.DEFINE_list("configs", None, "Configurations to sweep (default: all that apply to the profile): "
                  "default, fused, chunked@<budget>..., refill4, wsr1, sjf, score, half_slots, double_slots, "
                  "prefix_cache.")
flags.DEFINE_list("budgets", ["64", "256"], "Token budgets of the chunked configurations.")
flags.DEFINE_integer("num_requests", 32, "Requests per profile.", lower_bound=4)
flags.DEFINE_float("scale", 0.125, "Length scale of the profiles' GPU-scale distributions (1: as defined).",
                   lower_bound=1e-3)
flags.DEFINE_float("chat_qps", 4.0, "Poisson rate of the chat profile.", lower_bound=1e-6)
flags.DEFINE_float("creative_qps", 1.0, "Poisson rate of the creative-writing profile.", lower_bound=1e-6)
flags.DEFINE_integer("num_slots", 8, "Slots of the default configuration.", lower_bound=2)
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and KV-cache dtype.")
flags.DEFINE_bool("paged_kernels", False, "Run every configuration on the paged cache with the Pallas kernels (what "
                  "a GPU engine runs; under --simulate, charged as ragged kernels: real tokens, causal pairs, live pages).")
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_dir", "results/profiles", "Where the JSON, the table and the plot go.")
common.define_simulate_flag()
common.validate_list("profiles", lambda p: 0 if p in ("reading", "chat", "creative") else -1, 0,
                     "profiles among reading, chat, creative")
common.validate_list("budgets", int, 1, "positive token budgets")


def configurations(profile, num_slots: int) -> dict[str, dict]:
    """The knob sweep: name -> `LLM` overrides of the default (prefill_first, fcfs, refill 1)."""
    sweep = {"default": {}, "fused": dict(merge_mode="fused")}
    for budget in FLAGS.budgets:
        sweep[f"chunked@{budget}"] = dict(merge_mode="chunked", max_num_batched_tokens=max(int(budget), num_slots + 1))
    sweep.update({"refill4": dict(refill_interval=4), "wsr1": dict(waiting_served_ratio=1.0, max_waiting_steps=8),
                  "sjf": dict(ordering="sjf"), "score": dict(ordering="score", score_short=50.0),
                  "half_slots": dict(num_slots=max(1, num_slots // 2)), "double_slots": dict(num_slots=2 * num_slots)})
    if profile.questions_per_document > 1:
        sweep["prefix_cache"] = dict(kv_cache="paged", page_size=16, enable_prefix_caching=True)
    if FLAGS.configs:
        sweep = {k: v for k, v in sweep.items() if k in FLAGS.configs or k == "default"}
    return sweep


def better(objective: str, a: float, b: float) -> bool:
    return a > b if objective == "output_throughput" else a < b


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.experimental import PROFILES, profile_workload

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, FLAGS.dtype)
    results, lines = {}, []
    for name in FLAGS.profiles:
        profile = PROFILES[name]
        qps = {"chat": FLAGS.chat_qps, "creative": FLAGS.creative_qps}.get(name, 1.0)
        workload = profile_workload(profile, FLAGS.num_requests, vocab_size=model.config.vocab_size, qps=qps,
                                    scale=FLAGS.scale, seed=FLAGS.seed)
        longest = max(len(w.prompt) + w.sampling.max_tokens for w in workload) + 1
        max_seq_len = -(-longest // 16) * 16  # whole pages for the paged configuration
        rows = {}
        for config, overrides in configurations(profile, FLAGS.num_slots).items():
            options = {"num_slots": FLAGS.num_slots, "max_seq_len": max_seq_len, "dtype": FLAGS.dtype,
                       **(dict(kv_cache="paged", page_size=16, attention="pallas") if FLAGS.paged_kernels else {}),
                       **overrides}
            llm = LLM(model, **options, **common.llm_options())
            rows[config] = {"options": options, **common.run_replay(llm, workload, desc=f"{name}/{config}")}
            rows[config].pop("e2el_s", None)
            del llm
            common.release_programs()
        objective = profile.objective
        base = rows["default"][objective]
        winner = "default"
        for config, m in rows.items():
            m["vs_default"] = m[objective] / base if base else float("nan")
            if better(objective, m[objective], rows[winner][objective]):
                winner = config
        results[name] = {"objective": objective, "qps": qps if profile.arrival == "poisson" else None,
                         "winner": winner, "margin_vs_default": rows[winner]["vs_default"], "rows": rows}
        lines += table(name, objective, rows, winner)
    text = "\n".join(lines)
    print("\n" + text)
    common.write_outputs(FLAGS.output_dir, "profiles", text, {"results": results, "wall_s": time.perf_counter() - start},
                         lambda path: plot(results, path))
    print(f"\nwrote {FLAGS.output_dir}/profiles.json, profiles.txt and profiles.png in "
          f"{time.perf_counter() - start:.0f}s")


def table(name: str, objective: str, rows: dict, winner: str) -> list[str]:
    keys = ("output_throughput", "p99_e2el_ms", "p99_ttft_ms", "median_tpot_ms")
    header = f"{name + ' (' + objective + ')':<34}" + "".join(f"{k:>18}" for k in keys) + f"{'vs default':>12}"
    out = [header, "-" * len(header)]
    for config, m in rows.items():
        mark = " *" if config == winner else ""
        out.append(f"{config + mark:<34}" + "".join(f"{m[k]:>18.1f}" for k in keys) + f"{m['vs_default']:>11.2f}x")
    return out + [""]


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        configs = list(r["rows"])
        values = [r["rows"][c]["vs_default"] for c in configs]
        colors = ["tab:green" if c == r["winner"] else "tab:gray" if c == "default" else "tab:blue" for c in configs]
        ax.barh(configs, values, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        arrow = "higher" if r["objective"] == "output_throughput" else "lower"
        ax.set(title=f"{name}: {r['objective']} ({arrow} is better)", xlabel="relative to default")
        ax.invert_yaxis()
    common.savefig(fig, path)


if __name__ == "__main__":
    common.quiet_libraries()
    app.run(main)
