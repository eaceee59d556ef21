"""cbjax `continuous` against transformers' own continuous batching (`generate_batch`), side by side.

Both run the same random-init Llama (built with transformers, saved as a Hugging
Face directory, loaded by cbjax) on the same prompts and output lengths, greedy
and with EOS ignored so every request makes exactly its budget. Prints output
tokens/s for both and their ratio, how many requests agree token for token, and
the host time per decode step the cbjax scheduler loop costs at 64 slots.

    python -m experiments bench_engine
    python -m experiments bench_engine --shape=smollm2 --num_requests=32
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

from experiments.lib import common  # noqa: F401  (quiets transformers and matplotlib)

from absl import app, flags

from experiments.lib.cpu_roofline import CpuRoofline, define_read_flag, kv_bytes_per_token, share_text
from experiments.lib.hf_peers import configure_torch, continuous_generate_batch
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_enum("shape", "small", ["tiny", "small", "smollm2"],
                  "Model shape: 'tiny' (2 layers, d=64), 'small' (4 layers, d=256) or 'smollm2' "
                  "(30 layers, d=576, the 135M shape).")
flags.DEFINE_integer("num_requests", 64, "Requests in the workload.", lower_bound=1)
EngineArgs.define_flags(["num_slots", "decode_steps"], num_slots=32)
flags.DEFINE_integer("min_prompt", 16, "Shortest prompt (tokens).", lower_bound=1)
flags.DEFINE_integer("max_prompt", 128, "Longest prompt (tokens).", lower_bound=1)
flags.DEFINE_integer("min_output", 16, "Shortest output budget (tokens).", lower_bound=1)
flags.DEFINE_integer("max_output", 128, "Longest output budget (tokens).", lower_bound=1)
flags.DEFINE_integer("scheduler_slots", 64, "Slots for the scheduler host-overhead measurement.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload and init seed.")
flags.DEFINE_bool("skip_transformers", False, "Only run cbjax.")
flags.DEFINE_string("output_json", "results/bench_engine.json", "Where to write the results.")
define_read_flag()

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                    tie_word_embeddings=True, rope_theta=100000.0),
}


def build_model(shape: str, seed: int, path: str):
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def workload(vocab: int):
    import numpy as np

    rng = np.random.default_rng(FLAGS.seed)
    prompts = [rng.integers(3, vocab, size=int(n)).tolist()
               for n in rng.integers(FLAGS.min_prompt, FLAGS.max_prompt + 1, size=FLAGS.num_requests)]
    outputs = rng.integers(FLAGS.min_output, FLAGS.max_output + 1, size=FLAGS.num_requests).tolist()
    return prompts, outputs


def run_cbjax(model, prompts, outputs, max_seq_len):
    from cbjax import LLM, SamplingParams

    llm = LLM(model, policy="continuous", num_slots=FLAGS.num_slots, max_seq_len=max_seq_len,
              decode_steps=FLAGS.decode_steps)
    t0 = time.perf_counter()
    llm.warmup()
    compile_s = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in outputs]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    return [r.token_ids for r in results], elapsed, compile_s, llm.stats


def scheduler_overhead(slots: int) -> dict:
    """Host time per decode step of the cbjax loop at `slots` slots on a tiny model, where the
    device step is cheap and the host share is easy to see."""
    import numpy as np

    from cbjax import LLM, SamplingParams

    llm = LLM("tiny-llama", num_slots=slots, max_seq_len=128)
    llm.warmup()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in rng.integers(4, 64, size=4 * slots)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in rng.integers(8, 64, size=4 * slots)]
    llm.generate(prompts, params, use_tqdm=False)
    s = llm.stats
    return {"slots": slots, "decode_steps": s.decode_steps, "rounds": s.rounds,
            "host_ms_per_decode_step": s.host_ms_per_decode_step(),
            "schedule_ms_per_round": 1000 * s.schedule_s / max(s.rounds, 1),
            "process_ms_per_round": 1000 * s.process_s / max(s.rounds, 1),
            "device_wait_ms_per_round": 1000 * s.device_wait_s / max(s.rounds, 1)}


def decode_roofline(model, stats, prompts, outputs, seconds: float) -> dict:
    """The run's decode steps at the CPU roofline (experiments/lib/cpu_roofline.py): as many steps
    as it ran, each at the floor of a step of its mean running rows at the mean context; the
    prompts' prefill is not in the floor, so the share is a lower bound."""
    from cbjax.experimental import quant

    rows = max(1, round(stats.mean_running))
    roofline = CpuRoofline(model.config, quant.weight_bytes(model.params), [rows],
                           read_bytes=FLAGS.roofline_read_mb << 20)
    context = (sum(map(len, prompts)) + sum(outputs) / 2) / len(prompts)
    floor = roofline.floor_ms(rows, rows * context * kv_bytes_per_token(model.config, "auto", "float32"))
    floor_s = stats.decode_steps * floor["ms"] / 1e3
    print(f"{roofline.describe()}\ncbjax's {stats.decode_steps} decode steps at {rows} rows: floor {floor_s:.2f} s "
          f"({floor['bound']}-bound), the run {seconds:.2f} s: {share_text(floor_s / seconds)}")
    return {"rows": rows, "floor_s": floor_s, "share": floor_s / seconds, "floor_step": floor, **roofline.to_json()}


def main(argv):
    del argv
    import jax

    from cbjax.experimental import load_hf_dir

    with tempfile.TemporaryDirectory() as tmp:
        configure_torch()
        hf = build_model(FLAGS.shape, FLAGS.seed, tmp)
        model = load_hf_dir(tmp, with_tokenizer=False)
    prompts, outputs = workload(model.config.vocab_size)
    max_seq_len = 1 << (FLAGS.max_prompt + FLAGS.max_output).bit_length()
    total = sum(outputs)

    ours, ours_s, compile_s, stats = run_cbjax(model, prompts, outputs, max_seq_len)
    assert sum(len(t) for t in ours) == total
    result = {
        "shape": FLAGS.shape, "num_requests": FLAGS.num_requests, "num_slots": FLAGS.num_slots,
        "output_tokens": total, "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                            "jax_backend": jax.default_backend(),
                                            "devices": [str(d) for d in jax.devices()]},
        "cbjax": {"seconds": ours_s, "tokens_per_s": total / ours_s, "compile_s": compile_s,
                  "host_ms_per_decode_step": stats.host_ms_per_decode_step(), "decode_steps": stats.decode_steps},
    }
    print(f"\ncbjax continuous: {total} tokens in {ours_s:.2f}s = {total / ours_s:.1f} tok/s "
          f"(compile {compile_s:.1f}s, host {stats.host_ms_per_decode_step():.3f} ms/decode step)")
    if jax.default_backend() == "cpu":
        result["cbjax"]["roofline"] = decode_roofline(model, stats, prompts, outputs, ours_s)
    if not FLAGS.skip_transformers:
        theirs, theirs_s = continuous_generate_batch(hf, prompts, outputs, FLAGS.num_slots, return_tokens=True)
        same = sum(a == b for a, b in zip(ours, theirs))
        ratio = (total / ours_s) / (total / theirs_s)
        result["transformers"] = {"seconds": theirs_s, "tokens_per_s": total / theirs_s}
        result["ratio_cbjax_over_transformers"] = ratio
        result["identical_requests"] = same
        print(f"transformers generate_batch: {total} tokens in {theirs_s:.2f}s = {total / theirs_s:.1f} tok/s")
        print(f"ratio cbjax / transformers: {ratio:.2f}x   (identical greedy outputs: {same}/{len(prompts)})")
    overhead = scheduler_overhead(FLAGS.scheduler_slots)
    result["scheduler_overhead"] = overhead
    print(f"scheduler host time at {overhead['slots']} slots: {overhead['host_ms_per_decode_step']:.3f} ms per "
          f"decode step (schedule {overhead['schedule_ms_per_round']:.3f} ms + process "
          f"{overhead['process_ms_per_round']:.3f} ms per round)")
    if FLAGS.output_json:
        common.write_json(result, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
