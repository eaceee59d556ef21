"""What batching does to a mixture-of-experts step, against dense models of its active parameters.

At one sequence a MoE decode step reads only its tokens' experts. As the batch grows it reads more
of them (about E (1 - (1 - k/E)^B) a layer under uniform routing), so its step cost climbs where a
dense model's stays flat. Sections (--sections):

- `cpu`: this machine, the engine on random-init shapes (experiments/lib/moe_models.py: a MoE of
  Mixtral's proportions and a dense model of its active parameters), decode step time and tokens/s
  over --cpu_batches.
- `simulated`: the roofline simulator (cbjax/simulator, docs/moe.md) over --batches, each pair a
  MoE and its dense comparison on one --accelerator: Mixtral-8x7B (fp8, to fit one H100) against a
  dense 12.9B and Mistral-7B, and Qwen3-30B-A3B (bf16) against Qwen2.5-3B.
- `ep`: Mixtral-8x7B in bf16 over expert_parallel 1/2/4/8 (ep 1 on an H200, whose memory holds it),
  with what crosses the link per step.
- `policies`: the seeds' study on the MoE model: static against continuous batching at equal KV
  memory, output budgets capped at --max_gen_lens, beside the dense model of its active parameters.

For each pair, where batching's gain for the MoE ends (`per_token_falls`): over each doubling of the
batch, the fall of the MoE's time per token against the dense model's. Writes JSON, a text table and a plot.

    python -m experiments moe_batching --flagfile=configs/moe_batching.cfg
"""

from __future__ import annotations

from absl import app, flags

from experiments.lib import common, moe_models

FLAGS = flags.FLAGS
SECTIONS = ("cpu", "simulated", "ep", "policies")
flags.DEFINE_list("sections", list(SECTIONS), f"Which parts to run: {', '.join(SECTIONS)}.")
flags.DEFINE_list("cpu_batches", ["1", "2", "4", "8", "16", "32", "64"], "cpu: sequences decoding together.")
moe_models.define_flags(flags)
flags.DEFINE_integer("steps", 16, "cpu: timed decode steps per measurement.", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "cpu: measurements per cell; the best is kept.", lower_bound=1)
flags.DEFINE_list("batches", ["1", "2", "4", "8", "16", "32", "64", "128", "256"],
                  "simulated, ep: sequences decoding together.")
flags.DEFINE_string("accelerator", "h100", "simulated: the accelerator of the pairs.")
flags.DEFINE_integer("context", 1024, "simulated, ep: tokens each decoding sequence attends to.", lower_bound=1)
flags.DEFINE_list("max_gen_lens", ["32", "128", "512"], "policies: output caps (the seeds' columns).")
flags.DEFINE_integer("prompt_len", 512, "policies: prompt length; cpu: prompt tokens of each sequence (capped "
                     "at 16 there).", lower_bound=1)
flags.DEFINE_integer("num_requests", 2000, "policies: requests per cell.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "policies: workload seed.", lower_bound=0)
flags.DEFINE_string("output_dir", "results/moe_batching", "Where moe_batching.json/.txt/.png go.")
common.validate_list("cpu_batches", int, 1, "positive integers")
common.validate_list("batches", int, 1, "positive integers")
common.validate_list("max_gen_lens", int, 1, "positive integers")
flags.register_validator("sections", lambda v: bool(v) and set(v) <= set(SECTIONS),
                         message=f"--sections must name some of {', '.join(SECTIONS)}")
flags.register_validator("accelerator", lambda v: v in ("h100", "h200", "a100-80gb", "a100-40gb", "tpu-v5e"),
                         message="--accelerator must name an accelerator of the simulator")

# (MoE, weight dtype, dense comparisons): the simulated pairs.
PAIRS = (("mixtral-8x7b", "fp8", ("dense-12.9b", "mistral-7b")), ("qwen3-30b-a3b", "bfloat16", ("qwen2.5-3b",)))
# Published MoE serving figures to set beside the simulator's: (source, setting, tokens/s, TTFT ms).
PUBLISHED = ("Baseten, 'Faster Mixtral inference with TensorRT-LLM and quantization' (baseten.co blog, 2024): "
             "Mixtral-8x7B int8 on one A100 80GB, TensorRT-LLM, 512-token prompt, 128 output tokens, one request",
             81.0, 127.0)


def published_line() -> str:
    """The published figure beside the simulator's for the same setting."""
    from cbjax.experimental import Call, load_cost_model, model_for_simulation

    source, tokens_per_s, ttft_ms = PUBLISHED
    cost = load_cost_model("a100-80gb", model_for_simulation("mixtral-8x7b").config, 1, 1, "int8")
    step = cost.seconds(Call("decode", tokens=1, attended=576, kv_read=576, rows=1))
    prefill = cost.seconds(Call("prefill", tokens=512, attended=512 * 513 // 2, kv_read=0, rows=1))
    return (f"published: {source}: {tokens_per_s:.0f} tokens/s, TTFT {ttft_ms:.0f} ms; simulated: "
            f"{1 / step:.0f} tokens/s ({step * tokens_per_s:.2f}x the published time per token), prefill "
            f"{1000 * prefill:.0f} ms (the published TTFT includes the server's own overheads)")


def per_token_falls(moe: dict, dense: dict) -> tuple[int | None, int | None]:
    """Over each doubling of the batch, how much the time per token falls, MoE against dense:
    `(catches_up, ends)`: the first batch from which the MoE's falls at least as fast as the dense
    model's (its experts all read: batching pays again), and the first batch after that from which
    it falls no faster (batching's extra gain for the MoE has ended); None where not reached."""
    batches = sorted(moe)
    catches_up = ends = None
    for lo, hi in zip(batches, batches[1:]):
        fall_moe = (moe[lo] / lo) / (moe[hi] / hi)
        fall_dense = (dense[lo] / lo) / (dense[hi] / hi)
        if catches_up is None and fall_moe >= fall_dense:
            catches_up = lo
        elif catches_up is not None and ends is None and fall_moe <= fall_dense:
            ends = lo
    return catches_up, ends


def gain_line(name: str, dense: str, falls: tuple, last: int) -> str:
    catches_up, ends = falls
    up = f"falls as fast as {dense}'s again from B = {catches_up}" if catches_up else \
        f"falls slower than {dense}'s up to B = {last}"
    end = f"; no faster than it from B = {ends}" if ends else (f"; still faster at B = {last}" if catches_up else "")
    return f"{name}: time per token {up}{end}"


def decode_curve(shape: str, accelerator: str, weight_dtype: str, batches: list[int], expert_parallel: int = 1):
    """{B: simulated seconds per decode step} and the cost model, at --context tokens a sequence."""
    from cbjax.experimental import Call, load_cost_model, model_for_simulation

    config = model_for_simulation(shape).config
    cost = load_cost_model(accelerator, config, 2, 1, weight_dtype, None, expert_parallel)
    return {b: cost.seconds(Call("decode", tokens=b, attended=b * FLAGS.context, kv_read=b * FLAGS.context, rows=b))
            for b in batches}, cost


def table(title: str, curves: dict, batches: list[int], extra: dict | None = None) -> list[str]:
    names = list(curves)
    lines = ["", title, f"{'batch':>6}" + "".join(f"{n + ' ms':>20}" for n in names)
             + "".join(f"{n + ' tok/s':>22}" for n in names) + "".join(f"{k:>16}" for k in (extra or {}))]
    for b in batches:
        lines.append(f"{b:>6}" + "".join(f"{1000 * curves[n][b]:>20.2f}" for n in names)
                     + "".join(f"{b / curves[n][b]:>22.0f}" for n in names)
                     + "".join(f"{v[b]:>16.1f}" for v in (extra or {}).values()))
    return lines


def run_policies(shape: str, accelerator: str, weight_dtype: str) -> dict:
    """tokens/s of static and continuous batching at equal KV memory, per output cap (simulated)."""
    from cbjax import LLM
    from cbjax.experimental import ACCELERATORS, DTYPE_BYTES, model_for_simulation, SlotCache, weight_bytes
    from cbjax.experimental import LengthDist, synthetic

    model = model_for_simulation(shape)
    budget = ACCELERATORS[accelerator].kv_budget(weight_bytes(model.config, DTYPE_BYTES[weight_dtype]))
    per_token = SlotCache.bytes_per_slot(model.config, 1, "bfloat16")
    out = {}
    for cap in (int(c) for c in FLAGS.max_gen_lens):
        work = synthetic(FLAGS.num_requests, prompt_len=LengthDist("fixed", value=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=128, cap=cap),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed)
        max_len = FLAGS.prompt_len + cap
        slots = int(max(1, min(256, budget // (per_token * max_len))))
        for policy in ("static", "continuous"):
            llm = LLM(model, simulate=accelerator, weight_dtype=weight_dtype, policy=policy, num_slots=slots,
                      batch_size=slots, max_seq_len=max_len, dtype="bfloat16")
            outs = llm.generate([w.prompt for w in work], [w.sampling for w in work], desc=f"{shape} {policy} {cap}")
            out.setdefault(policy, {})[cap] = sum(len(o.token_ids) for o in outs) / llm.clock()
        out.setdefault("slots", {})[cap] = slots
    return out


def main(argv):
    del argv
    from tqdm import tqdm

    from cbjax.experimental import link_bytes_per_layer

    lines, record = [], {"published": published_line()}
    curves_for_plot = {}
    if "cpu" in FLAGS.sections:
        batches = sorted(int(b) for b in FLAGS.cpu_batches)
        curves = {}
        with tqdm(total=2 * len(batches), desc="cpu", unit="cell") as progress:
            for name, config in moe_models.configs(FLAGS, ("moe", "dense_active")):
                curves[name] = moe_models.seconds_per_step(config, batches, min(FLAGS.prompt_len, 16), FLAGS.steps,
                                                           FLAGS.repeats, progress)
        experts = {b: moe_models.expected_experts(FLAGS.experts, FLAGS.top_k, b) for b in batches}
        lines += table(f"cpu (this machine, engine): {FLAGS.layers} layers of {FLAGS.hidden}, {FLAGS.experts} "
                       f"experts of {FLAGS.expert_width}, top {FLAGS.top_k}", curves, batches,
                       {"experts read": experts})
        falls = per_token_falls(curves["moe"], curves["dense_active"])
        lines.append(gain_line("moe", "dense_active", falls, batches[-1]))
        record["cpu"] = {"seconds_per_step": curves, "catches_up_at": falls[0], "gain_ends_at": falls[1]}
        curves_for_plot["cpu"] = curves
    batches = sorted(int(b) for b in FLAGS.batches)
    if "simulated" in FLAGS.sections:
        record["simulated"] = {}
        for moe, dtype, dense in PAIRS:
            curves, cost = {}, None
            for shape in (moe, *dense):
                curves[shape], made = decode_curve(shape, FLAGS.accelerator, dtype, batches)
                cost = cost or made
            lines += table(f"simulated {FLAGS.accelerator}, {dtype} weights, context {FLAGS.context}: {moe}", curves,
                           batches, {"experts read": {b: cost.experts_read(b) for b in batches}})
            falls = per_token_falls(curves[moe], curves[dense[0]])
            lines.append(gain_line(moe, dense[0], falls, batches[-1]))
            record["simulated"][moe] = {"seconds_per_step": curves, "catches_up_at": falls[0],
                                        "gain_ends_at": falls[1], "dtype": dtype}
            curves_for_plot[f"{moe} ({FLAGS.accelerator})"] = curves
    if "ep" in FLAGS.sections:
        curves, link = {}, {}
        for ep in (1, 2, 4, 8):
            name = f"ep{ep}" + (" (h200)" if ep == 1 else " (h100)")
            curves[name], cost = decode_curve("mixtral-8x7b", "h200" if ep == 1 else "h100", "bfloat16", batches, ep)
            link[f"ep{ep} MB/step"] = {b: 32 * link_bytes_per_layer(b, 2, 4096, ep, 2) / 1e6 for b in batches}
        lines += table(f"simulated Mixtral-8x7B, bf16, expert_parallel 1/2/4/8, context {FLAGS.context}", curves,
                       batches, link)
        record["ep"] = {"seconds_per_step": curves, "link_mb_per_step": link}
        curves_for_plot["mixtral-8x7b by expert_parallel"] = curves
    if "policies" in FLAGS.sections:
        record["policies"] = {}
        lines += ["", f"static vs continuous (simulated, {FLAGS.num_requests} requests, prompts {FLAGS.prompt_len}, "
                      "output budget capped exponential of mean 128), output tokens/s"]
        for shape, accelerator, dtype in (("mixtral-8x7b", "h200", "bfloat16"), ("dense-12.9b", "h200", "bfloat16")):
            result = run_policies(shape, accelerator, dtype)
            record["policies"][shape] = result
            for cap in (int(c) for c in FLAGS.max_gen_lens):
                ratio = result["continuous"][cap] / result["static"][cap]
                lines.append(f"{shape:>14} on {accelerator} gen<={cap:<5} {result['slots'][cap]:>4} slots  static "
                             f"{result['static'][cap]:>9.0f}  continuous {result['continuous'][cap]:>9.0f}  "
                             f"continuous/static {ratio:.2f}x")
    lines += ["", record["published"]]
    text = "\n".join(lines)
    print(text)
    common.write_outputs(FLAGS.output_dir, "moe_batching", text, record,
                         plot=(lambda path: plot(curves_for_plot, path)) if curves_for_plot else None)


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.6 * len(curves), 3.8), squeeze=False)
    for ax, (title, by_model) in zip(axes[0], curves.items()):
        for name, times in by_model.items():
            batches = sorted(times)
            ax.plot(batches, [1000 * times[b] / b for b in batches], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequences decoding")
        ax.set_ylabel("ms per token (step / batch)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    common.savefig(fig, path)


if __name__ == "__main__":
    app.run(main)
