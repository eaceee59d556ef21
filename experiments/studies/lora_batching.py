"""Many LoRA adapters in one batch: throughput and TPOT as the workload's distinct adapters grow.

Each request runs one of `n` adapters (--adapter_counts), drawn Zipf-popular (--zipf), rank
--rank on --targets. Three ways to serve the same requests:

- `batched`: every adapter in one continuous batch (cbjax's pool: `max_loras` slots on the device,
  `max_cpu_loras` in host memory, the disk behind);
- `merged`: the same requests on one merged adapter (its weights folded into the base: the base
  model's cost, the ceiling a single fine-tune reaches);
- `one at a time`: a batch per adapter, the adapters in turn (PEFT's server, S-LoRA's baseline).

Sections (--sections): `cpu` runs them on this machine's engine (random adapters in PEFT's format
written at the start: about 1 GB at 512 for SmolLM2 in f32), every request at once; `simulated` runs
S-LoRA's S1 setting on the roofline simulator (--accelerators; Llama-7B, rank 8, synthetic adapters,
--qps Poisson arrivals for --duration s, lengths uniform in [8, 512]) beside S-LoRA's published
figures for it (A100-80GB). Writes JSON, a text table and a plot.

    python -m experiments lora_batching --flagfile=configs/lora_batching.cfg
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from absl import app, flags
from tqdm import tqdm

from experiments.lib import common

FLAGS = flags.FLAGS
SECTIONS = ("cpu", "simulated")
MODES = ("batched", "merged", "one at a time")
flags.DEFINE_list("sections", list(SECTIONS), f"Which parts to run: {', '.join(SECTIONS)}.")
flags.DEFINE_list("adapter_counts", ["1", "8", "32", "128", "512"], "Distinct adapters in the workload.")
flags.DEFINE_string("model", "smollm2-135m", "cpu: preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("rank", 8, "The adapters' rank.", lower_bound=1)
flags.DEFINE_list("targets", ["q_proj", "v_proj"], "cpu: the adapters' target modules (PEFT names).")
flags.DEFINE_float("zipf", 1.0, "Popularity: adapter i is drawn with weight 1 / (i + 1)^zipf.", lower_bound=0.0)
flags.DEFINE_integer("num_requests", 128, "cpu: requests per cell.", lower_bound=1)
flags.DEFINE_integer("prompt_len", 32, "cpu: prompt tokens per request.", lower_bound=1)
flags.DEFINE_integer("output_len", 32, "cpu: output tokens per request.", lower_bound=1)
flags.DEFINE_integer("num_slots", 32, "Sequences decoding together.", lower_bound=1)
flags.DEFINE_integer("max_loras", 32, "Adapters on the device at once.", lower_bound=1)
flags.DEFINE_integer("max_cpu_loras", 128, "Adapters in host memory at once.", lower_bound=1)
flags.DEFINE_list("accelerators", ["h100", "a100-80gb"], "simulated: the accelerators.")
flags.DEFINE_float("qps", 10.0, "simulated: request rate (S-LoRA's S1: 10).", lower_bound=0.01)
flags.DEFINE_float("duration", 120.0, "simulated: seconds of arrivals (S-LoRA's: 120).", lower_bound=1.0)
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_string("output_dir", "results/lora_batching", "Where lora_batching.json/.txt/.png go.")
common.validate_list("adapter_counts", int, 1, "positive integers")

# S-LoRA's published S1 figures (Sheng et al. 2023, Table 3; the repository's
# benchmarks/paper/synthetic/slora/synthetic_num_adapters_a100-80_S1_slora_table.jsonl and
# benchmarks/paper/peft/num_adapter_a100-80_S1_peft_fig3.jsonl): Llama-7B, rank 8, A100-80GB,
# 10 req/s (gamma arrivals, cv 1) for 120 s, power-law popularity (alpha 1), input and output
# lengths uniform in [8, 512]. adapters -> (S-LoRA req/s, its ms per output token, PEFT req/s or None).
SLORA_S1 = {5: (8.05, 81.2, 0.88), 100: (7.99, 84.3, 0.25), 1000: (7.64, 105.1, None), 2000: (7.61, 106.6, None)}
SIM_MODEL, SIM_TARGETS = "llama2-7b", "q_proj+k_proj+v_proj+o_proj"


def zipf_names(n: int, count: int, rng) -> list[str]:
    weights = 1.0 / np.arange(1, n + 1) ** FLAGS.zipf
    return [f"a{i}" for i in rng.choice(n, size=count, p=weights / weights.sum())]


def measure(llm, prompts, sampling, names, mode: str) -> dict:
    """Serve the requests one way; tokens/s, requests/s and mean ms per output token (TPOT)."""
    t0, outs = llm.clock(), []
    if mode == "one at a time":
        for name in dict.fromkeys(names):  # the adapters in order of first appearance
            group = [i for i, n in enumerate(names) if n == name]
            outs += llm.generate([prompts[i] for i in group], [sampling[i] for i in group], lora=name, use_tqdm=False)
    else:
        outs = llm.generate(prompts, sampling, lora=None if mode == "merged" else names, use_tqdm=False)
    seconds = llm.clock() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    tpot = [(o.metrics.e2e_latency - o.metrics.ttft) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    return dict(seconds=seconds, tok_s=tokens / seconds, req_s=len(outs) / seconds, tpot_ms=1000 * float(np.mean(tpot)))


def cpu_section(counts: list[int]) -> dict:
    from cbjax import LLM, SamplingParams
    from cbjax.experimental import load_model, write_random_adapter

    model = load_model(FLAGS.model, with_tokenizer=False)
    root = tempfile.mkdtemp(prefix="cbjax-lora-batching-")
    paths = [write_random_adapter(os.path.join(root, f"a{i}"), model.config, FLAGS.rank, FLAGS.targets, seed=i)
             for i in tqdm(range(max(counts)), desc="write adapters")]
    common_args = dict(num_slots=FLAGS.num_slots, max_seq_len=FLAGS.prompt_len + FLAGS.output_len + 8)
    lora = LLM(model, enable_lora=True, max_loras=FLAGS.max_loras, max_lora_rank=FLAGS.rank,
               max_cpu_loras=max(FLAGS.max_cpu_loras, FLAGS.max_loras), lora_target_modules=",".join(FLAGS.targets),
               **common_args)
    for i, path in enumerate(tqdm(paths, desc="load adapters")):
        lora.load_lora(f"a{i}", path)
    engines = {"batched": lora, "merged": LLM(model, **common_args), "one at a time": lora}
    for llm in tqdm(set(engines.values()), desc="warm up"):
        llm.warmup()
    rng = np.random.default_rng(FLAGS.seed)
    prompts = [rng.integers(3, model.config.vocab_size, size=FLAGS.prompt_len).tolist()
               for _ in range(FLAGS.num_requests)]
    sampling = [SamplingParams(max_tokens=FLAGS.output_len, ignore_eos=True)] * FLAGS.num_requests
    # One untimed pass per engine first: a program's first run sets XLA:CPU's matmuls up, and the
    # adapters read back into host memory (only `max_cpu_loras` of them stay) are then warm alike.
    warm = zipf_names(min(counts[-1], FLAGS.num_slots), FLAGS.num_slots, rng)
    for mode in ("batched", "merged"):
        measure(engines[mode], prompts[:FLAGS.num_slots], sampling[:FLAGS.num_slots], warm, mode)
    results = {}
    for n in tqdm(counts, desc="adapter counts"):
        names = zipf_names(n, FLAGS.num_requests, rng)
        results[n] = {mode: measure(engines[mode], prompts, sampling, names, mode) for mode in MODES}
        results[n]["distinct"] = len(set(names))
    return results


def simulated_section(counts: list[int]) -> dict:
    from cbjax import LLM, SamplingParams

    results = {}
    for accelerator in FLAGS.accelerators:
        lora = LLM(SIM_MODEL, simulate=accelerator, dtype="float16", enable_lora=True, max_loras=FLAGS.max_loras,
                   max_lora_rank=FLAGS.rank, max_cpu_loras=max(counts + [FLAGS.max_loras]), num_slots=FLAGS.num_slots * 4,
                   max_seq_len=1088, lora_target_modules=SIM_TARGETS.replace("+", ","), kv_cache="paged")
        merged = LLM(SIM_MODEL, simulate=accelerator, dtype="float16", num_slots=FLAGS.num_slots * 4, max_seq_len=1088,
                     kv_cache="paged")
        for i in range(max(counts)):
            lora.load_lora(f"a{i}", f"synthetic:{FLAGS.rank}:{SIM_TARGETS}")
        rng = np.random.default_rng(FLAGS.seed)
        count = int(FLAGS.qps * FLAGS.duration)
        arrivals = np.cumsum(rng.exponential(1.0 / FLAGS.qps, size=count))
        prompts = [[1] * int(rng.integers(8, 513)) for _ in range(count)]
        outputs = [SamplingParams(max_tokens=int(rng.integers(8, 513)), ignore_eos=True) for _ in range(count)]
        for n in counts:
            names = zipf_names(n, count, rng)
            row = {}
            for mode, llm in (("batched", lora), ("merged", merged)):
                t0 = llm.clock()
                workload = [(float(t), p, s) for t, p, s in zip(arrivals, prompts, outputs)]
                outs = replay_with_lora(llm, workload, names if mode == "batched" else None)
                seconds = llm.clock() - t0
                tpot = [(o.metrics.e2e_latency - o.metrics.ttft) / (len(o.token_ids) - 1) for o in outs]
                per_token = [o.metrics.e2e_latency / len(o.token_ids) for o in outs]  # S-LoRA's latency measure
                row[mode] = dict(seconds=seconds, req_s=len(outs) / seconds, tpot_ms=1000 * float(np.mean(tpot)),
                                 latency_per_token_ms=1000 * float(np.mean(per_token)))
            results.setdefault(accelerator, {})[n] = row
    return results


def replay_with_lora(llm, workload, names) -> list:
    """Admit each request at its arrival on the (simulated) clock with its adapter; run to the end."""
    start, ids, pending = llm.clock(), [], list(range(len(workload)))
    outputs = {}
    while pending or llm.has_unfinished_requests():
        now = llm.clock() - start
        while pending and workload[pending[0]][0] <= now + 1e-9:  # (a jump to an arrival may fall an ulp short)
            i = pending.pop(0)
            ids.append(llm.add_request(workload[i][1], workload[i][2], arrival_time=start + workload[i][0],
                                       lora=None if names is None else names[i]))
        if llm.has_unfinished_requests():
            for o in llm.step():
                if o.finished:
                    outputs[o.request_id] = o
        elif pending:
            llm.clock.advance(start + workload[pending[0]][0] - llm.clock())
    return [outputs[i] for i in ids]


def table(cpu: dict, simulated: dict) -> str:
    lines = []
    if cpu:
        lines += [f"cpu: {FLAGS.model} f32, {FLAGS.num_requests} requests x {FLAGS.output_len} tokens, rank {FLAGS.rank} "
                  f"on {','.join(FLAGS.targets)}, {FLAGS.num_slots} slots, max_loras {FLAGS.max_loras}",
                  f"{'adapters':>9}{'distinct':>9}" + "".join(f"{m + ' tok/s':>20}{'TPOT ms':>9}" for m in MODES)
                  + f"{'batched/merged':>16}{'batched/one':>13}"]
        for n, row in cpu.items():
            lines.append(f"{n:>9}{row['distinct']:>9}" + "".join(f"{row[m]['tok_s']:>20.0f}{row[m]['tpot_ms']:>9.1f}"
                                                            for m in MODES)
                         + f"{row['batched']['tok_s'] / row['merged']['tok_s']:>15.2f}x"
                         + f"{row['batched']['tok_s'] / row['one at a time']['tok_s']:>12.2f}x")
    for accelerator, rows in simulated.items():
        lines += ["", f"simulated {accelerator}: Llama-7B fp16, rank {FLAGS.rank} on q/k/v/o, {FLAGS.qps:g} req/s for "
                  f"{FLAGS.duration:g} s, lengths uniform in [8, 512] (S-LoRA's S1)",
                  f"{'adapters':>9}{'batched req/s':>15}{'TPOT ms':>9}{'ms/token':>10}{'merged req/s':>14}{'TPOT ms':>9}"]
        for n, row in rows.items():
            lines.append(f"{n:>9}{row['batched']['req_s']:>15.2f}{row['batched']['tpot_ms']:>9.1f}"
                         f"{row['batched']['latency_per_token_ms']:>10.1f}"
                         f"{row['merged']['req_s']:>14.2f}{row['merged']['tpot_ms']:>9.1f}")
    if simulated:
        lines += ["", "S-LoRA published (A100-80GB, S1): adapters, S-LoRA req/s, ms per output token (latency / "
                  "output tokens, queueing included), PEFT req/s"]
        lines += [f"{n:>9}{r:>15.2f}{ms:>9.1f}{'' if p is None else f'{p:>14.2f}'}" for n, (r, ms, p) in SLORA_S1.items()]
    return "\n".join(lines)


def plot(cpu: dict, simulated: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if cpu:
        for mode in MODES:
            axes[0].plot(list(cpu), [cpu[n][mode]["tok_s"] for n in cpu], marker="o", label=mode)
        axes[0].set(xscale="log", xlabel="distinct adapters", ylabel="tokens/s", title=f"{FLAGS.model} on this CPU")
        axes[0].legend()
    for accelerator, rows in simulated.items():
        axes[1].plot(list(rows), [rows[n]["batched"]["req_s"] for n in rows], marker="o", label=f"cbjax, {accelerator}")
    if simulated:
        axes[1].plot(list(SLORA_S1), [r for r, _, _ in SLORA_S1.values()], marker="s", label="S-LoRA published, A100")
        axes[1].set(xscale="log", xlabel="distinct adapters", ylabel="requests/s", title="Llama-7B, S-LoRA's S1")
        axes[1].legend()
    fig.tight_layout()
    common.savefig(fig, path)


def main(argv):
    del argv
    counts = [int(n) for n in FLAGS.adapter_counts]
    t0 = time.perf_counter()
    cpu = cpu_section(counts) if "cpu" in FLAGS.sections else {}
    simulated = simulated_section(counts) if "simulated" in FLAGS.sections else {}
    text = table(cpu, simulated)
    print(f"\n{text}\n({time.perf_counter() - t0:.0f} s)")
    common.write_outputs(FLAGS.output_dir, "lora_batching", text, {"cpu": cpu, "simulated": simulated,
                                                                  "slora_s1": SLORA_S1},
                         plot=lambda path: plot(cpu, simulated, path))


if __name__ == "__main__":
    app.run(main)
