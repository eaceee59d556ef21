"""The CPU decode step against its two-sided roofline: every weight format at every batch, one run.

For each format (f32; int8 groups; Q4_1, SmolLM2's GGUF file's own blocks) and batch (1, 8, 32
and 64 sequences of a 64-token prompt making 128 new tokens, greedy), the engine's decode
steps alone (experiments/lib/cpu_decode.py), in rounds: each round measures the roofline's
two sides (experiments/lib/cpu_roofline.py: the best read bandwidth, the step's GEMMs at
their shapes) and then times every format at every batch in turn, so a drift of the shared
machine falls on all of them alike. Prints per format and batch the median ms/step and tok/s,
the floor (the larger of the step's bytes over the bandwidth and its GEMMs' time), the
median of the rounds' shares of it and the side that bounds it (m/c); flags a share above
100% (a suspect roof) and tok/s that falls as the batch grows. Writes a JSON file.

    python -m experiments bench_cpu_step
    python -m experiments bench_cpu_step --formats=f32,q4_1 --batches=8,32 --rounds=2
"""

from __future__ import annotations

import platform

from experiments.lib import common  # also quiets transformers and matplotlib

from absl import app, flags

from experiments.lib.cpu_decode import DecodeTimer, median_row
from experiments.lib.cpu_roofline import (CpuRoofline, compute_side, define_read_flag, kv_bytes_per_token,
                                          memory_side, share_text)

FORMATS = {"f32": "f32", "int8": "int8", "q4_1": "gguf"}  # -> the roofline's arithmetic

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory or .gguf file (q4_1 needs a GGUF: "
                    "the smollm2-135m preset's file or a .gguf of Q4_1 blocks).")
flags.DEFINE_list("formats", list(FORMATS), f"Weight formats, of {', '.join(FORMATS)} (q4_1: the preset's GGUF "
                  "file's own blocks).")
flags.register_validator("formats", lambda v: bool(v) and set(v) <= set(FORMATS), f"formats of {', '.join(FORMATS)}")
flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Sequences decoded together (at most 64: the CPU kernels' rows).")
common.validate_list("batches", int, 1, "positive integers")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.", lower_bound=2)
flags.DEFINE_integer("rounds", 3, "Rounds of (roofline, then every format at every batch); the medians are kept.",
                     lower_bound=1)
flags.DEFINE_enum("kv_cache_dtype", "float16", ["float16", "auto"], "The KV cache's storage (EngineConfig).")
flags.DEFINE_string("output_json", "results/bench_cpu_step.json", "Where to write the results.")
define_read_flag()


def load_format(model_name: str, name: str):
    """A model's weights in one format: f32, int8 groups, or its GGUF file's own blocks (q4_1)."""
    import jax

    from cbjax.experimental import load_model, quant, quantized

    model = load_model(model_name, dtype="float32", keep_gguf_blocks=name == "q4_1")
    if name == "q4_1" and quant.quantization_of(model.params) != "gguf":
        raise app.UsageError(f"q4_1 takes a GGUF file's blocks; {model_name} has none")
    return quantized(model, "int8", jax.devices()[0]) if name == "int8" else model


def main(argv):
    del argv
    import jax
    from tqdm.auto import tqdm

    from cbjax.experimental import quant

    batches = sorted({int(b) for b in FLAGS.batches})
    models = {f: load_format(FLAGS.model, f) for f in FLAGS.formats}
    config = next(iter(models.values())).config
    kv_per_row = kv_bytes_per_token(config, FLAGS.kv_cache_dtype, "float32") * (FLAGS.prompt_len + FLAGS.new_tokens / 2)
    timers = {}
    for f, model in tqdm(models.items(), desc="engines"):
        for b in batches:
            timers[f, b] = DecodeTimer(model, b, FLAGS.prompt_len, FLAGS.new_tokens, kv_cache_dtype=FLAGS.kv_cache_dtype)
            common.release_programs()
    rounds = []
    for _ in tqdm(range(FLAGS.rounds), desc="rounds"):
        memory = memory_side(FLAGS.roofline_read_mb << 20)
        compute = compute_side(config, batches)
        steps = {}
        for (f, b), timer in timers.items():
            roof = CpuRoofline(config, quant.weight_bytes(models[f].params), batches, FORMATS[f],
                               memory=memory, compute=compute)
            t = timer.timed()
            steps[f, b] = {**t, "floor_ms": roof.floor_ms(b, b * kv_per_row)["ms"],
                           "share": roof.share(t["ms_per_step"], b, b * kv_per_row)}
        rounds.append({"memory": memory, "compute": compute, "steps": steps})
        tqdm.write(f"roofline: memory {memory['GBps']:.1f} GB/s, compute "
                   + ", ".join(f"{b} rows {compute[b]['GFLOPs']:.0f} GFLOP/s" for b in batches))
    header = (f"{'format':>6} | {'batch':>5} | {'ms/step':>8} | {'tok/s':>7} | {'floor ms':>8} | "
              f"{'of roofline':>14} | {'GB/s':>5} | {'GFLOP/s':>7}")
    print("\n" + header + "\n" + "-" * len(header))
    table = {}
    for f in FLAGS.formats:
        weight_bytes = quant.weight_bytes(models[f].params)
        last = None
        for b in batches:
            row = median_row([r["steps"][f, b] for r in rounds])
            bound = CpuRoofline(config, weight_bytes, batches, FORMATS[f], memory=rounds[0]["memory"],
                                compute=rounds[0]["compute"]).floor_ms(b, b * kv_per_row)["bound"]
            row["GBps"] = (weight_bytes + b * kv_per_row) / row["ms_per_step"] / 1e6
            row["GFLOPs"] = rounds[0]["compute"][b]["GFLOP"] / row["ms_per_step"] * 1e3
            row["falls"] = last is not None and row["tg_tokens_per_s"] < last
            print(f"{f:>6} | {b:>5} | {row['ms_per_step']:>8.1f} | {row['tg_tokens_per_s']:>7.1f} | "
                  f"{row['floor_ms']:>8.1f} | {share_text(row['share']) + ' ' + bound[0]:>14} | {row['GBps']:>5.1f} | "
                  f"{row['GFLOPs']:>7.1f}" + ("  (tok/s below the smaller batch's)" if row["falls"] else ""))
            table[f"{f}/{b}"] = {**row, "bound": bound, "weight_bytes": weight_bytes}
            last = row["tg_tokens_per_s"]
    common.write_json({
        "model": FLAGS.model, "formats": FLAGS.formats, "batches": batches, "prompt_len": FLAGS.prompt_len, "new_tokens": FLAGS.new_tokens,
        "kv_cache_dtype": FLAGS.kv_cache_dtype, "kv_bytes_per_row": kv_per_row, "table": table,
        "rounds": [{"memory": r["memory"], "compute": {str(b): c for b, c in r["compute"].items()},
                    "steps": {f"{f}/{b}": s for (f, b), s in r["steps"].items()}} for r in rounds],
        "machine": {"platform": platform.platform(), "jax": jax.__version__}}, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
