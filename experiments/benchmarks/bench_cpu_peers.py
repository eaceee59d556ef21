"""cbjax's decode against llama.cpp on the same weights, and against the memory roofline, in one run.

For each batch size (default 1, 8 and 32 sequences of a 64-token prompt making 128
new tokens each, greedy, EOS ignored) this prints:

- cbjax: the engine's decode steps alone (time per step and generated tokens/s, as
  llama.cpp's S_TG counts them), also at several steps a device call (`--multi_step`: the
  engine's `decode_steps`, which drops the per-call dispatch from the step), with the CPU
  kernels off (`--compare_xla`), and the
  whole `LLM.generate` (prefill, scheduling and decode: tokens/s as llama.cpp's S t/s
  counts them);
- llama.cpp's `llama-batched-bench` on the same weights (SmolLM2's GGUF requantized
  to F32 by `llama-quantize --allow-requantize`, so both sides hold the same f32
  numbers), when its binaries are found (`--llama_cpp_dir` or PATH);
- the two-sided roofline at every batch size, measured in this run (experiments/lib/cpu_roofline.py):
  the larger of the step's bytes (weights, and the keys and values of every row's mean
  context) over the best read bandwidth, and the step's matmuls through the best GEMM at its
  shapes; its floor in ms, the share of it a step reaches, and which side bounds it (m/c).

llama.cpp is an optional external peer, never installed by the project; how to build
it is in docs/experiments.md. Without it the script prints cbjax and the roofline.

    python -m experiments bench_cpu_peers
    python -m experiments bench_cpu_peers --llama_cpp_dir=/path/to/llama.cpp/build/bin --batch_sizes=1,8,32
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import tempfile
import time

from experiments.lib import common  # also quiets transformers and matplotlib

from absl import app, flags

from experiments.lib.cpu_decode import DecodeTimer, median_row
from experiments.lib.cpu_roofline import CpuRoofline, define_read_flag, kv_bytes_per_token, share_text

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset or .gguf file (llama.cpp needs a GGUF: the preset's is used).")
flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Numbers of sequences decoded together.")
common.validate_list("batch_sizes", int, 1, "positive integers")
flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per sequence.", lower_bound=1)
flags.DEFINE_integer("new_tokens", 128, "Generated tokens per sequence.", lower_bound=2)
flags.DEFINE_string("llama_cpp_dir", None, "Directory with llama-batched-bench and llama-quantize (default: PATH).")
flags.DEFINE_string("llama_cpp_gguf", None, "An F32 GGUF for llama.cpp (default: the model's GGUF requantized to "
                    "F32 into a temporary directory).")
flags.DEFINE_integer("threads", None, "llama.cpp threads (default: the cores this process may use).", lower_bound=1)
flags.DEFINE_integer("repeats", 1, "Timed decode passes per batch size for cbjax in each round (the median is "
                     "kept).", lower_bound=1)
flags.DEFINE_integer("rounds", 3, "Rounds in turn of cbjax's decode and llama.cpp's run at every batch size; "
                     "each ratio printed is the median of the rounds' own ratios (their range beside it).",
                     lower_bound=1)
flags.DEFINE_enum("quantization", "none", ["none", "int8", "gguf"], "cbjax's weights: f32 (none), int8 groups, "
                  "or the GGUF file's own blocks (gguf; llama.cpp then runs that same file, not an F32 copy).")
flags.DEFINE_enum("kv_cache_dtype", "float16", ["float16", "auto"], "The KV cache's storage on both sides, so "
                  "each streams the same KV bytes: float16 (cbjax's kv_cache_dtype float16; llama.cpp's default "
                  "f16) or auto (cbjax's f32 activations; llama.cpp -ctk f32 -ctv f32).")
flags.DEFINE_enum("cpu_kernels", "auto", ["auto", "on", "off"], "cbjax's CPU kernels (EngineConfig.cpu_kernels).")
flags.DEFINE_integer("multi_step", 8, "Also time cbjax's decode at this many steps per device call "
                     "(EngineConfig.decode_steps: the host syncs once per call), beside one step a call; "
                     "1 turns the column off.", lower_bound=1)
flags.DEFINE_bool("compare_xla", True, "Also time cbjax's decode with the CPU kernels off (XLA only), side by side.")
define_read_flag()
flags.DEFINE_string("output_json", "results/bench_cpu_peers.json", "Where to write the results.")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def decoder(model, batch: int, cpu_kernels: str, decode_steps: int = 1) -> DecodeTimer:
    return DecodeTimer(model, batch, FLAGS.prompt_len, FLAGS.new_tokens, cpu_kernels, FLAGS.kv_cache_dtype, decode_steps)


def cbjax_generate(model, batch: int, max_seq_len: int) -> dict:
    """The whole path a user takes: `LLM.generate` of `batch` prompts on `batch` slots."""
    import numpy as np

    from cbjax import LLM, SamplingParams

    llm = LLM(model, policy="continuous", num_slots=batch, max_seq_len=max_seq_len, cpu_kernels=FLAGS.cpu_kernels,
              kv_cache_dtype=FLAGS.kv_cache_dtype)
    rng = np.random.default_rng(1000 + batch)
    warm, prompts = ([rng.integers(3, model.config.vocab_size, FLAGS.prompt_len).tolist() for _ in range(batch)]
                     for _ in range(2))
    sampling = SamplingParams(max_tokens=FLAGS.new_tokens, ignore_eos=True)
    llm.generate(warm, sampling, use_tqdm=False)  # untimed: compiles what the timed run reaches
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert all(len(o.token_ids) == FLAGS.new_tokens for o in outs)
    return {"generate_s": seconds, "tokens_per_s": batch * (FLAGS.prompt_len + FLAGS.new_tokens) / seconds,
            "output_tokens_per_s": batch * FLAGS.new_tokens / seconds}


def _binary(name: str) -> str | None:
    if FLAGS.llama_cpp_dir:
        path = os.path.join(FLAGS.llama_cpp_dir, name)
        return path if os.access(path, os.X_OK) else None
    return shutil.which(name)


def llama_cpp_file(gguf: str, tmp: str) -> str | None:
    """The GGUF llama.cpp runs (an F32 copy of `gguf` unless `--llama_cpp_gguf`), or None when
    llama.cpp is not found."""
    if _binary("llama-batched-bench") is None:
        print("llama.cpp not found (--llama_cpp_dir or PATH): its rows are skipped")
        return None
    if FLAGS.llama_cpp_gguf is not None:
        return FLAGS.llama_cpp_gguf
    quantize = _binary("llama-quantize")
    if quantize is None:
        print("llama-quantize not found: pass --llama_cpp_gguf=<an F32 GGUF>")
        return None
    f32 = os.path.join(tmp, "model-f32.gguf")
    subprocess.run([quantize, "--allow-requantize", gguf, f32, "F32"], check=True, capture_output=True)
    return f32


def _llama_cpp_cache_type() -> str:
    """llama.cpp's KV cache type holding what cbjax's holds (its activations are f32 here)."""
    return "f16" if FLAGS.kv_cache_dtype == "float16" else "f32"


def llama_cpp(path: str, batches: list[int]) -> dict:
    """One llama-batched-bench run over `path`: its rows by batch size."""
    threads = FLAGS.threads or _cores()
    context = max(batches) * (FLAGS.prompt_len + FLAGS.new_tokens)
    cache = _llama_cpp_cache_type()
    cmd = [_binary("llama-batched-bench"), "-m", path, "-t", str(threads), "-c", str(context), "-b", "2048",
           "-ub", "512", "-npp", str(FLAGS.prompt_len), "-ntg", str(FLAGS.new_tokens),
           "-npl", ",".join(map(str, batches)), "-ctk", cache, "-ctv", cache]
    print("running", " ".join(cmd), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in text.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"\d+", cells[0]):
            pp, tg, b = (int(c) for c in cells[:3])
            t_tg, s_tg, t_all, s_all = (float(c) for c in cells[6:10])
            rows[b] = {"ms_per_step": 1000 * t_tg / tg, "tg_tokens_per_s": s_tg, "seconds": t_all,
                       "tokens_per_s": s_all}
    return {"threads": threads, "gguf": path, "rows": rows}


def _ratio(ratios: list[float], width: int) -> str:
    """The median of the rounds' ratios, with their range when there are several."""
    import numpy as np

    text = f"{np.median(ratios):.2f}x" + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")
    return f"{text:>{width}}"


def main(argv):
    del argv
    import jax

    from cbjax.experimental import load_model, smollm2_gguf_path

    batches = [int(b) for b in FLAGS.batch_sizes]
    gguf = smollm2_gguf_path() if FLAGS.model == "smollm2-135m" else FLAGS.model
    from cbjax.experimental import quant

    model = load_model(FLAGS.model, dtype="float32", keep_gguf_blocks=FLAGS.quantization == "gguf")
    if FLAGS.quantization == "int8":
        from cbjax.experimental import quantized

        model = quantized(model, "int8", jax.devices()[0])
    weight_bytes = quant.weight_bytes(model.params)
    max_seq_len = 1 << (FLAGS.prompt_len + FLAGS.new_tokens - 1).bit_length()
    from cbjax.experimental import kernels as cpu_kernels

    import numpy as np
    from tqdm.auto import tqdm

    roofline = CpuRoofline(model.config, weight_bytes, batches, arithmetic={"none": "f32"}.get(
        FLAGS.quantization, FLAGS.quantization), read_bytes=FLAGS.roofline_read_mb << 20)
    # Each row reads its keys and values at the decode's mean context, in the cache's dtype.
    kv_bytes_per_row = (kv_bytes_per_token(model.config, FLAGS.kv_cache_dtype, "float32")
                        * (FLAGS.prompt_len + FLAGS.new_tokens / 2))
    print(f"weights {weight_bytes / 1e6:.0f} MB; {roofline.describe()}", flush=True)
    multi_step = min(FLAGS.multi_step, FLAGS.new_tokens - 1)  # at least one whole call
    ours = {}
    decoders = {}
    for b in batches:
        ours[b] = cbjax_generate(model, b, max_seq_len)
        if FLAGS.compare_xla and FLAGS.cpu_kernels != "off":
            ours[b]["xla_only_ms_per_step"] = decoder(model, b, "off").timed()["ms_per_step"]
        common.release_programs()
        decoders[b] = [decoder(model, b, FLAGS.cpu_kernels)] + (
            [decoder(model, b, FLAGS.cpu_kernels, multi_step)] if multi_step > 1 else [])
    # Rounds in turn, cbjax then llama.cpp: each ratio is the median of the rounds' own ratios,
    # so a drift in the machine's speed (30% within an hour on the 2-core VM) falls on both
    # sides of each ratio rather than on one side of it.
    rounds = {b: [] for b in batches}
    peer_rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        if FLAGS.quantization == "gguf" and FLAGS.llama_cpp_gguf is None:
            FLAGS.llama_cpp_gguf = gguf  # the same blocks on both sides
        peer_file = llama_cpp_file(gguf, tmp) if gguf.endswith(".gguf") or FLAGS.llama_cpp_gguf else None
        for _ in tqdm(range(FLAGS.rounds), desc="rounds"):
            for b in batches:
                one = decoders[b][0].timed(FLAGS.repeats)
                rounds[b].append({**one, **({f"multi_step_{k}": v for k, v in decoders[b][1].timed(FLAGS.repeats).items()}
                                            if len(decoders[b]) > 1 else {})})
            if peer_file is not None:
                peer_rounds.append(llama_cpp(peer_file, batches))
    peer = None
    if peer_rounds:
        peer = {"threads": peer_rounds[0]["threads"], "gguf": peer_rounds[0]["gguf"],
                "rows": {b: {**median_row([p["rows"][b] for p in peer_rounds]),
                             "rounds": [p["rows"][b] for p in peer_rounds]}
                         for b in batches if all(b in p["rows"] for p in peer_rounds)}}
    for b in batches:
        ours[b].update(median_row(rounds[b]))
        ours[b]["rounds"] = rounds[b]
        print(f"cbjax batch {b}: {ours[b]['ms_per_step']:.1f} ms/step, {ours[b]['tg_tokens_per_s']:.1f} tok/s "
              f"decode; generate {ours[b]['tokens_per_s']:.1f} tok/s", flush=True)
    xla_column = all("xla_only_ms_per_step" in ours[b] for b in batches)
    multi_column = all("multi_step_ms_per_step" in ours[b] for b in batches)
    multi_name = f"{multi_step} steps/call"

    header = f"{'batch':>5} | {'cbjax ms/step':>13} | {'cbjax tok/s':>11} | {'floor ms':>8} | {'of roofline':>14}" + (
        f" | {multi_name + ' ms/step':>22}" if multi_column else "") + (
        f" | {'XLA-only ms/step':>16}" if xla_column else "")
    if peer:
        header += f" | {'llama.cpp ms/step':>17} | {'llama.cpp tok/s':>15} | {'cbjax/llama.cpp':>19}" + (
            f" | {multi_name + ' / llama.cpp':>25}" if multi_column else "")
    print("\n" + header + "\n" + "-" * len(header))
    for b in batches:
        r = ours[b]
        r["floor"] = roofline.floor_ms(b, b * kv_bytes_per_row)
        r["fraction_of_roofline"] = r["floor"]["ms"] / r["ms_per_step"]
        line = (f"{b:>5} | {r['ms_per_step']:>13.1f} | {r['tg_tokens_per_s']:>11.1f} | {r['floor']['ms']:>8.1f} | "
                f"{share_text(r['fraction_of_roofline']) + ' ' + r['floor']['bound'][0]:>14}") + (
            f" | {r['multi_step_ms_per_step']:>22.1f}" if multi_column else "") + (
            f" | {r['xla_only_ms_per_step']:>16.1f}" if xla_column else "")
        if peer and b in peer["rows"]:
            theirs = peer["rows"][b]
            for prefix in ("", "multi_step_") if multi_column else ("",):
                ratios = [ours_r[f"{prefix}tg_tokens_per_s"] / theirs_r["tg_tokens_per_s"]
                          for ours_r, theirs_r in zip(r["rounds"], theirs["rounds"])]
                r[f"{prefix}throughput_vs_llama_cpp"] = float(np.median(ratios))
                r[f"{prefix}throughput_vs_llama_cpp_rounds"] = ratios
            line += f" | {theirs['ms_per_step']:>17.1f} | {theirs['tg_tokens_per_s']:>15.1f} | " + _ratio(
                r["throughput_vs_llama_cpp_rounds"], 19)
            if multi_column:
                line += " | " + _ratio(r["multi_step_throughput_vs_llama_cpp_rounds"], 25)
        print(line)
    result = {"model": FLAGS.model, "quantization": FLAGS.quantization, "kv_cache_dtype": FLAGS.kv_cache_dtype,
              "prompt_len": FLAGS.prompt_len, "new_tokens": FLAGS.new_tokens, "multi_step": multi_step,
              "weight_bytes": weight_bytes, "roofline": roofline.to_json(), "kv_bytes_per_row": kv_bytes_per_row,
              "cpu_kernels": FLAGS.cpu_kernels, "cpu_kernels_built": cpu_kernels.available(),
              "cbjax": ours, "llama_cpp": peer,
              "machine": {"platform": platform.platform(), "cores": _cores(), "jax": jax.__version__,
                          "backend": jax.default_backend()}}
    if FLAGS.output_json:
        common.write_json(result, FLAGS.output_json)


if __name__ == "__main__":
    app.run(main)
