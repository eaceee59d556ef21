"""The Anyscale throughput table: static vs dynamic vs continuous batching at equal KV memory.

Same prompts; output budgets drawn from a capped exponential (mean `output_mean`,
capped at each max generation length, EOS ignored), or a trace's or ShareGPT's lengths
(`--workload`); all requests arrive at once.
`kv_cache_bytes` fixes the KV memory, from which each layout derives how many
sequences it holds; the transformers peers run at that same batch size. Next to
each continuous/static ratio we print the bound the drawn workload allows at
equal slots: the mean over static batches of the longest budget divided by the
mean budget.

Those bounds assume a decode step costs the same at any batch, which holds on a GPU
and not on a CPU, where a step of 34 rows costs several times one of 4. So each column
also prints the bound this machine allows (`--machine_bound`): the same FCFS schedules,
each decode step priced at what a step of that many sequences took on this machine in
the same run (the static row's rounds profiled once more, cbjax/simulator/profile.py). A
continuous row short of that bound lost to its scheduler; a bound near 1x means the
machine, not the scheduler, leaves batching little to win.

    python -m experiments compare_batching                          # CPU, scaled down
    python -m experiments compare_batching --flagfile=configs/compare_batching_gpu.cfg
"""

from __future__ import annotations

import os
import statistics
import time

from absl import app, flags

from experiments.lib import common
from experiments.lib.batching_bounds import engine_roofline, fcfs_bound, machine_bound, roofline_table, static_bound
from experiments.lib.cpu_roofline import define_read_flag
from cbjax.experimental import engine_args
from cbjax import EngineArgs
from cbjax.experimental import KV_DTYPES
from experiments.lib.hf_peers import load_peer

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("prompt_len", 16, "Prompt length in tokens (the study used 512). With --workload=sharegpt or a "
                     "trace: each request's prompt plus output is capped at prompt_len + the column's max "
                     "generation length, its output at the latter.", lower_bound=1)
flags.DEFINE_list("max_gen_lens", ["8", "32", "128"], "Max generation lengths, one table column each "
                  "(the study used 32,128,512,1536).")
flags.DEFINE_float("output_mean", 32.0, "Mean of the capped-exponential output budget (the study used 128).",
                   lower_bound=1.0)
flags.DEFINE_integer("num_requests", 24, "Requests per column (at least; see --waves).", lower_bound=1)
flags.DEFINE_integer("waves", 3, "Requests per column are at least this many times the column's slots, so that "
                     "every policy refills slots several times (a column whose requests fit in one batch cannot "
                     "show what continuous batching does).", lower_bound=1)
flags.DEFINE_integer("kv_cache_bytes", None, "KV memory budget; sets the number of slots per column. "
                     "Default: --num_slots at the largest max generation length.")
flags.DEFINE_integer("num_slots", 8, "Slots at the largest max generation length when --kv_cache_bytes is unset.", lower_bound=1)
flags.DEFINE_list("policies", ["static", "dynamic", "continuous"], "cbjax policies to run on the slot cache.")
flags.DEFINE_list("paged_policies", ["continuous"], "cbjax policies to also run on the paged cache (rows "
                  "'<policy>-paged'), at the same KV memory.")
flags.DEFINE_integer("page_size", 16, "Tokens per page of the paged cache.", lower_bound=1)
flags.DEFINE_integer("paged_max_seqs", None, "Most sequences the paged cache decodes together (its slots). "
                     "Default: the pool's tokens over the mean sequence length (prompt + mean output); the "
                     "decode step computes every slot, so more slots than fit on average only cost time.")
PEERS = ("hf_generate_static", "hf_generate_batch")
flags.DEFINE_list("peers", list(PEERS), "transformers rows (not under --simulate), each timed once per column: "
                  "hf_generate_static (generate over static batches), hf_generate_batch (its continuous batching); "
                  "empty for none.")
flags.DEFINE_enum("paged_attention", "auto", ["auto", "reference", "pallas"],
                  "Attention of the paged rows (auto: the Pallas kernels on a GPU or TPU; pallas: them anywhere; "
                  "under --simulate, the kernels read live pages only, as vLLM's do).")
flags.DEFINE_bool("machine_bound", True, "Also print the continuous/static bound this machine allows: the FCFS "
                  "schedules' decode steps priced at what the static row's steps of as many sequences took here "
                  "(one more untimed run of it; not under --simulate).")
define_read_flag()
common.define_simulate_flag()
common.define_trace_flags(("synthetic",), "'synthetic': --prompt_len prompts of random tokens and capped-"
                          "exponential budgets (--output_mean); ")
flags.DEFINE_float("window_ms", 50.0, "Dynamic batching window.", lower_bound=0.0)
ENGINE_KNOBS = EngineArgs.define_flags(["decode_steps", "max_step_tokens"])  # every row's engine
CONTINUOUS_KNOBS = EngineArgs.define_flags(["refill_interval", "merge_mode", "max_num_batched_tokens"])  # its rows
flags.adopt_module_key_flags(engine_args)  # the EngineArgs knobs, in --help
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter and KV-cache dtype.")
flags.DEFINE_list("kv_cache_dtypes", ["auto"], "KV-cache storages (EngineArgs.kv_cache_dtype) to run every row with "
                  "at the same KV memory, each its own slots; rows of a dtype past the first are suffixed "
                  "-<dtype>kv and compared with the static row of their dtype.")
flags.DEFINE_integer("seed", 0, "Workload seed.", lower_bound=0)
flags.DEFINE_integer("repeats", 3, "Timed runs per cell, the policies interleaved (run 1 of each, then run 2 of "
                     "each, ...): each ratio is taken within a round and the table prints its median and range "
                     "(shared CPUs drift by 30% over minutes).", lower_bound=1)
flags.DEFINE_string("output_dir", "results/compare_batching", "Where the JSON and the plot go.")


common.validate_list("max_gen_lens", int, 1, "positive integers")
common.validate_list("kv_cache_dtypes", lambda d: 0 if d in KV_DTYPES else -1, 0, ", ".join(KV_DTYPES))
common.validate_list("peers", lambda p: 0 if p in PEERS else -1, 0, "transformers rows among " + ", ".join(PEERS),
                     allow_empty=True)
common.validate_list("policies", lambda p: 0 if p in ("static", "dynamic", "continuous") else -1, 0,
                     "policies among static, dynamic, continuous")
flags.register_validator("paged_policies", lambda v: all(p in ("static", "dynamic", "continuous") for p in v),
                         message="--paged_policies must be policies among static, dynamic, continuous")
flags.register_validator("kv_cache_bytes", lambda v: v is None or v >= 1, message="--kv_cache_bytes must be >= 1")
flags.register_validator("paged_max_seqs", lambda v: v is None or v >= 1, message="--paged_max_seqs must be >= 1")


def run_column(model, max_gen: int, peer) -> dict:
    from tqdm.auto import tqdm

    from cbjax import LLM
    from cbjax.experimental import Engine, kv_storage_dtype, LengthDist, SlotCache, synthetic

    max_seq_len = FLAGS.prompt_len + max_gen
    dtype = FLAGS.dtype
    budget = FLAGS.kv_cache_bytes
    if budget is None:
        largest = FLAGS.prompt_len + max(int(x) for x in FLAGS.max_gen_lens)
        budget = FLAGS.num_slots * SlotCache.bytes_per_slot(model.config, largest, dtype)
    storage = {d: kv_storage_dtype(d, dtype) for d in FLAGS.kv_cache_dtypes}
    slots_of = {d: max(1, budget // SlotCache.bytes_per_slot(model.config, max_seq_len, storage[d])) for d in storage}
    slots = slots_of[FLAGS.kv_cache_dtypes[0]]
    num_requests = max(FLAGS.num_requests, FLAGS.waves * int(max(slots_of.values())))
    if FLAGS.workload == "synthetic":
        work = synthetic(num_requests, prompt_len=LengthDist("fixed", value=FLAGS.prompt_len),
                         output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=max_gen),
                         vocab_size=model.config.vocab_size, seed=FLAGS.seed)
        mean_seq = FLAGS.prompt_len + FLAGS.output_mean
    else:  # a trace's (or ShareGPT's) lengths, all arriving at once
        work = common.recorded_workload(model, num_requests, max_len=max_seq_len, max_output_len=max_gen,
                                        arrival="all_at_once")
        mean_seq = common.mean_sequence_len(work)
    prompts = [w.prompt for w in work]
    budgets = [w.sampling.max_tokens for w in work]
    column = {"max_gen_len": max_gen, "slots": int(slots), "kv_cache_bytes": int(budget), "num_requests": len(work),
              "mean_budget": sum(budgets) / len(budgets), "bound_continuous_over_static": static_bound(budgets, slots),
              "fcfs_bound_continuous_over_static": fcfs_bound(budgets, slots),
              "slots_by_kv_dtype": {d: int(n) for d, n in slots_of.items()}, "rows": {}}
    runs = [(p, layout, d) for d in FLAGS.kv_cache_dtypes
            for p, layout in [(p, "slots") for p in FLAGS.policies] + [(p, "paged") for p in FLAGS.paged_policies]]
    engines = {}
    for policy, layout, kv_dtype in runs:
        suffix = "" if kv_dtype == FLAGS.kv_cache_dtypes[0] else f"-{kv_dtype}kv"
        layout_options = dict(num_slots=slots_of[kv_dtype], batch_size=slots_of[kv_dtype])
        if layout == "paged":
            page = FLAGS.page_size
            seq_len = -(-max_seq_len // page) * page
            pool_tokens = budget // SlotCache.bytes_per_slot(model.config, 1, storage[kv_dtype])
            fit = int(pool_tokens // mean_seq)
            paged_slots = min(FLAGS.paged_max_seqs or max(slots_of[kv_dtype], fit), len(work))
            layout_options = dict(kv_cache="paged", kv_cache_bytes=int(budget), page_size=page,
                                  num_slots=paged_slots, batch_size=paged_slots, attention=FLAGS.paged_attention)
        else:
            seq_len = max_seq_len
        knobs = {k: FLAGS[k].value for k in ENGINE_KNOBS + (CONTINUOUS_KNOBS if policy == "continuous" else [])}
        llm = LLM(model, policy=policy, max_seq_len=seq_len, window_ms=FLAGS.window_ms, dtype=dtype, **knobs,
                  **layout_options, kv_cache_dtype=kv_dtype, **common.llm_options())
        llm.warmup()
        engines[(policy if layout == "slots" else f"{policy}-paged") + suffix] = llm
    compiled = Engine.num_backend_compilations()
    seconds = {row: [] for row in engines}
    for repeat in range(FLAGS.repeats):
        for row, llm in engines.items():  # interleaved: a drift of the machine hits every row of a round alike
            llm.reset_stats()
            t0 = llm.clock()  # the wall clock, or simulated time under --simulate
            outs = llm.generate(prompts, [w.sampling for w in work], use_tqdm=True,
                                desc=f"{row} gen<={max_gen} run {repeat + 1}/{FLAGS.repeats}")
            seconds[row].append(llm.clock() - t0)
            assert sum(len(o.token_ids) for o in outs) == sum(budgets), "EOS is ignored: every request makes its budget"
    if Engine.num_backend_compilations() != compiled:
        print(f"warning: gen<={max_gen} compiled during the timed runs; their times include compilation")
    tokens = sum(budgets)
    for row, llm in engines.items():
        rates = [tokens / t for t in seconds[row]]
        column["rows"][row] = {"tokens_per_s": statistics.median(rates), "seconds": seconds[row],
                               "tokens_per_s_runs": rates, "mean_running": llm.stats.mean_running,
                               "decode_steps": llm.stats.decode_steps, "preemptions": llm.load().num_preemptions,
                               "slots": llm.engine_info.num_slots, "kv_cache_dtype": llm.args.kv_cache_dtype}
        if llm.load().num_pages:
            column["rows"][row]["num_pages"] = llm.load().num_pages
    if "static" in seconds:  # each round's ratio, then their median and range
        for row in engines:  # against the static row of the row's KV dtype
            static = seconds.get("static" + kv_suffix(row), seconds["static"])
            ratios = [a / b for a, b in zip(static, seconds[row])]  # in round order
            column["rows"][row]["over_static"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                  "max": max(ratios), "runs": ratios}
    if FLAGS.machine_bound and not FLAGS.simulate and {"static", "continuous"} <= set(engines):
        column.update(machine_bound(engines["static"], prompts, [w.sampling for w in work], budgets, int(slots),
                                    max_gen, engine_roofline(engines["static"], FLAGS.roofline_read_mb << 20)))
    if peer is not None:
        from experiments.lib.hf_peers import continuous_generate_batch, static_generate

        peers = {"hf_generate_static": static_generate, "hf_generate_batch": continuous_generate_batch}
        for name, fn in ((n, peers[n]) for n in FLAGS.peers):
            with tqdm(total=len(prompts), desc=f"{name} gen<={max_gen}") as bar:
                tokens, elapsed = fn(peer, prompts, budgets, slots, progress=bar.update)
            column["rows"][name] = {"tokens_per_s": tokens / elapsed, "seconds": elapsed}
    return column


def kv_suffix(row: str) -> str:
    """A row's KV-storage suffix ("-int8kv"), or "" for the first --kv_cache_dtypes storage."""
    return row[row.rfind("-"):] if row.endswith("kv") else ""


def over_static(row: dict, static: dict) -> str:
    """A row's throughput over static's: the median of the rounds' ratios and their range
    (one run, or a transformers peer timed once: the ratio of the medians)."""
    ratio = row.get("over_static")
    if ratio is None or len(ratio["runs"]) == 1:
        return f"{row['tokens_per_s'] / static['tokens_per_s']:.2f}x"
    return f"{ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]"


def print_table(columns: list[dict]) -> str:
    rows = list(columns[0]["rows"])
    labeled: list[tuple[str, list[str]]] = [("slots (equal KV mem)", [str(c["slots"]) for c in columns])]
    labeled += [(f"slots, {d} KV", [str(c["slots_by_kv_dtype"][d]) for c in columns])
                for d in list(columns[0].get("slots_by_kv_dtype", {}))[1:]]
    labeled.append(("requests", [str(c.get("num_requests", "")) for c in columns]))
    labeled += [(f"{r} tok/s", [f"{c['rows'][r]['tokens_per_s']:.1f}" for c in columns]) for r in rows]
    if "static" in rows:
        labeled += [(f"{r} / static{kv_suffix(r)}",
                     [over_static(c["rows"][r], c["rows"].get("static" + kv_suffix(r), c["rows"]["static"]))
                      for c in columns])
                    for r in rows if r != "static" + kv_suffix(r)]
        labeled.append(("bound cont./static, FCFS", [f"{c['fcfs_bound_continuous_over_static']:.2f}x" for c in columns]))
        labeled.append(("bound, no slot idle", [f"{c['bound_continuous_over_static']:.2f}x" for c in columns]))
        if all("machine_bound_continuous_over_static" in c for c in columns) and "continuous" in rows:
            labeled.append(("bound, this machine", [f"{c['machine_bound_continuous_over_static']:.2f}x"
                                                    for c in columns]))
            labeled.append(("continuous of that bound", [
                f"{100 * c['rows']['continuous']['over_static']['median'] / c['machine_bound_continuous_over_static']:.0f}%"
                if "over_static" in c["rows"]["continuous"] else "-" for c in columns]))
    labeled += [(f"{r} mean running", [f"{c['rows'][r]['mean_running']:.2f}" for c in columns])
                for r in rows if "mean_running" in columns[0]["rows"][r]]
    width = max(len("policy"), *(len(label) for label, _ in labeled)) + 2
    cells = [f"gen<={c['max_gen_len']}" for c in columns]
    cell = max(12, *(len(x) for x in cells), *(len(v) for _, vals in labeled for v in vals)) + 2
    head = f"{'policy':<{width}}" + "".join(f"{x:>{cell}}" for x in cells)
    lines = [head, "-" * len(head)]
    lines += [f"{label:<{width}}" + "".join(f"{v:>{cell}}" for v in vals) for label, vals in labeled]
    return "\n".join(lines)


def plot(columns: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [c["max_gen_len"] for c in columns]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in columns[0]["rows"]:
        ax.plot(xs, [c["rows"][r]["tokens_per_s"] for c in columns], marker="o", label=r)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max generation length (tokens)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{FLAGS.model}: throughput at equal KV memory")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    del argv
    from cbjax.experimental import write_json

    start = time.perf_counter()
    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=common.wants_tokenizer())
    peers = bool(FLAGS.peers) and not FLAGS.simulate
    peer = load_peer(FLAGS.model) if peers else None  # transformers' twin of the same checkpoint
    peer_settings = {}
    if peer is not None:
        from experiments.lib.hf_peers import configure_torch

        peer_settings = configure_torch()
        print(f"transformers peers: {peer_settings}, generate_batch KV cache sized to the batch (16-token pages)")
    if peers and peer is None:
        print(f"no transformers twin for {FLAGS.model}: peers skipped")
    columns = []
    for g in FLAGS.max_gen_lens:  # each column's engines have their own shapes
        columns.append(run_column(model, int(g), peer))
        common.release_programs()
    table = print_table(columns) + roofline_table(columns)
    print("\n" + table)
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    write_json(os.path.join(FLAGS.output_dir, "compare_batching.json"),
               {"flags": common.script_flags(), "peer_settings": peer_settings,
                "columns": columns, "table": table, "wall_s": time.perf_counter() - start})
    plot(columns, os.path.join(FLAGS.output_dir, "compare_batching.png"))
    print(f"\nwrote {FLAGS.output_dir}/compare_batching.json and .png in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
