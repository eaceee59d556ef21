"""When speculation pays: n-gram speculative decoding against plain decoding, by batch size and load.

For each workload and batch size (closed batches: `num_slots` = the batch, every request
submitted at once), each configuration runs the same requests: no speculation, a fixed
proposal length k for each of --ks, and the adaptive length (SmartSpec's goodput per request,
k up to max(--ks)). Prints throughput (the median of --repeats runs on one warmed engine;
the engines take turns, a run each) and the speedup over no speculation (the median of the
turns' ratios), mean TPOT, the tokens accepted per run and the acceptance; with --served,
the same batches through `python -m cbjax.serve` and the `openai` client, a server per
configuration taking turns likewise (TTFT, TPOT and acceptance from /metrics); then, at
--qps Poisson rates on --num_slots, TPOT and E2E latency. Writes JSON, a markdown table and
a plot of speedup against batch size.

    python -m experiments speculation --flagfile=configs/speculation_cpu.cfg
    python -m experiments speculation --model=tiny-llama --workloads=synthetic --batch_sizes=1,4
    python -m experiments speculation --flagfile=configs/speculation_h100.cfg   # simulated: 8B target, 1B draft

Workloads: `code` (three copies of a file of three one-line Python functions, add/sub/mul,
then `def `, greedy, --code_tokens: the output copies the file once it finds what to copy;
--code_variants gives each request its own functions), `copy` (chat-templated "repeat this text" over ShareGPT replies: the output copies
the prompt, n-gram's best case), `sharegpt` (ShareGPT opening turns, chat-templated, until EOS
or --max_tokens), `synthetic` (random prompts with a repeated motif; for models without a
tokenizer, and for --simulate, where each proposed token is accepted with probability
--simulated_acceptance and a draft's steps are charged at its own roofline).
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

from experiments.lib import common
from experiments.lib.served_batches import served_batches
from cbjax.experimental import engine_args
from cbjax import EngineArgs

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_list("workloads", ["code", "copy", "sharegpt"], "Workloads: code, copy, sharegpt, synthetic.")
flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "Closed batch sizes (num_slots = batch; requests at once).")
flags.DEFINE_list("ks", ["1", "2", "3", "4"], "Fixed proposal lengths to compare; adaptive proposes up to the largest.")
flags.DEFINE_integer("repeats", 3, "Runs of each batch on one warmed engine; throughput is their median.", lower_bound=1)
flags.DEFINE_bool("served", False, "Also run the closed batches through the server (python -m cbjax.serve) and the "
                  "openai client: TTFT, TPOT and acceptance from /metrics.")
flags.DEFINE_integer("code_tokens", 96, "code: tokens each request generates (ignoring EOS).", lower_bound=1)
flags.DEFINE_bool("code_variants", False, "code: every request but the first gets its own three functions (default: "
                  "all the same file, the case issue 86 reported).")
flags.DEFINE_bool("adaptive", True, "Also run the adaptive length.")
flags.DEFINE_integer("requests_per_slot", 2, "Requests per batch slot in the closed-batch runs.", lower_bound=1)
flags.DEFINE_integer("max_tokens", 128, "Most tokens a request generates.", lower_bound=1)
flags.DEFINE_integer("copy_tokens", 160, "copy: the passage's length in tokens (cut at a word).", lower_bound=8)
flags.DEFINE_list("qps", [], "Poisson request rates for the latency part (on --num_slots slots); empty: skip it.")
flags.DEFINE_integer("poisson_requests", 32, "Requests per Poisson run.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Workload seed.")
flags.DEFINE_string("output_dir", "results/speculation", "Where the JSON, the table and the plot go.")
flags.DEFINE_string("draft_model", None, "Also compare a draft model's proposals (the same ks, and adaptive): a "
                    "model with the target's vocabulary (under --simulate, a shape such as llama3.2-1b).")
flags.DEFINE_integer("synthetic_prompt_len", 40, "synthetic: the prompt's length (a repeated motif at its end).",
                     lower_bound=8)
EngineArgs.define_flags(["num_slots", "max_seq_len", "dtype", "speculative_ngram_min", "speculative_ngram_max",
                         "simulated_acceptance"], max_seq_len=1024, num_slots=16)
common.define_simulate_flag()
flags.adopt_module_key_flags(engine_args)
common.validate_list("batch_sizes", int, 1, "positive batch sizes")
common.validate_list("ks", int, 1, "positive proposal lengths")
common.validate_list("qps", float, 1e-6, "positive request rates", allow_empty=True)
common.validate_list("workloads", lambda w: 0 if w in ("code", "copy", "sharegpt", "synthetic") else -1, 0,
                     "workloads among code, copy, sharegpt, synthetic")


def configurations() -> list[tuple[str, dict]]:
    """(label, `LLM` speculation keywords) of every configuration compared."""
    ks = [int(k) for k in FLAGS.ks]
    out = [("none", dict(speculative_method="none"))]
    out += [(f"k={k}", dict(speculative_method="ngram", num_speculative_tokens=k, speculative_length="fixed"))
            for k in ks]
    if FLAGS.adaptive:
        out.append(("adaptive", dict(speculative_method="ngram", num_speculative_tokens=max(ks),
                                     speculative_length="adaptive")))
    if FLAGS.draft_model:
        draft = dict(speculative_method="draft", speculative_model=FLAGS.draft_model)
        out += [(f"draft k={k}", dict(draft, num_speculative_tokens=k, speculative_length="fixed")) for k in ks]
        if FLAGS.adaptive:
            out.append(("draft adaptive", dict(draft, num_speculative_tokens=max(ks), speculative_length="adaptive")))
    return out


def engine_options(options: dict) -> dict:
    """`options` with the flags every engine of the study shares."""
    return dict(max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype, speculative_ngram_min=FLAGS.speculative_ngram_min,
                speculative_ngram_max=FLAGS.speculative_ngram_max, simulated_acceptance=FLAGS.simulated_acceptance,
                **common.llm_options(), **options)


def requests(model, workload: str, n: int) -> list[tuple[list[int], object]]:
    """`n` (prompt ids, SamplingParams) of `workload`."""
    from cbjax import SamplingParams

    rng = np.random.default_rng(FLAGS.seed)
    if workload == "synthetic":
        vocab = model.config.vocab_size
        out = []
        head = FLAGS.synthetic_prompt_len - 32
        for _ in range(n):
            motif = rng.integers(3, vocab, 8).tolist()
            out.append((rng.integers(3, vocab, head).tolist() + motif * 4,
                        SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=bool(FLAGS.simulate))))
        return out
    if model.tokenizer is None:
        raise ValueError(f"the {workload} workload needs a model with a tokenizer (or --workloads=synthetic)")
    if workload == "code":
        return [(model.tokenizer.encode(code_prompt(i, rng), add_special_tokens=False),
                 SamplingParams(max_tokens=FLAGS.code_tokens, ignore_eos=True)) for i in range(n)]
    from cbjax.experimental import chat_prompt_ids, sharegpt_conversations

    tok = model.tokenizer
    pairs = sharegpt_conversations()
    out = []
    for i in rng.permutation(len(pairs)):
        human, reply = pairs[i]
        if workload == "sharegpt":
            prompt = chat_prompt_ids(tok, human)
            budget = FLAGS.max_tokens
        else:
            words = reply.split()
            passage = " ".join(words[:FLAGS.copy_tokens * 3 // 4])  # about copy_tokens tokens of English
            if len(words) < 40:
                continue
            prompt = chat_prompt_ids(tok, "Repeat the following text exactly, word for word:\n\n" + passage)
            budget = min(FLAGS.max_tokens, len(tok.encode(passage, add_special_tokens=False)) + 16)
        if len(prompt) + budget > FLAGS.max_seq_len:
            continue
        out.append((prompt, SamplingParams(max_tokens=budget)))
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} {workload} requests fit max_seq_len={FLAGS.max_seq_len}")


CODE_FUNCTIONS = [("add", "+"), ("sub", "-"), ("mul", "*"), ("div", "/"), ("mod", "%"), ("pow", "**")]


def code_prompt(i: int, rng) -> str:
    """The code workload's prompt `i`: a file of three one-line functions, three times, then
    `def ` (add, sub, mul; with --code_variants, request i > 0 three of six at random)."""
    picks = rng.choice(len(CODE_FUNCTIONS), 3, replace=False).tolist() if FLAGS.code_variants and i else [0, 1, 2]
    source = "".join(f"def {CODE_FUNCTIONS[j][0]}(a, b): return a {CODE_FUNCTIONS[j][1]} b\n" for j in picks)
    return (source + "\n") * 3 + "def "


def run_once(llm, reqs) -> tuple[float, float, float | None]:
    """Generate `reqs` at once: throughput (over the front's clock: simulated time in a
    simulation), wall seconds and mean TPOT."""
    outs = llm.generate([p for p, _ in reqs], [s for _, s in reqs], use_tqdm=False)
    wall = max(o.metrics.finish_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    tpots = [(o.metrics.token_times[-1] - o.metrics.token_times[0]) / (len(o.metrics.token_times) - 1)
             for o in outs if len(o.metrics.token_times) > 1]
    return sum(len(o.token_ids) for o in outs) / wall, wall, float(np.mean(tpots)) if tpots else None


def summarize(runs: list[tuple], before, after) -> dict:
    """The median run's throughput and mean TPOT, and the speculation counters per run."""
    drafts = after.spec_drafts - before.spec_drafts
    proposed = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    rate, wall, tpot = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    return {"tokens": round(rate * wall), "wall_s": wall, "tok_per_s": rate, "runs_tok_per_s": [r[0] for r in runs],
            "mean_tpot_ms": 1000 * tpot if tpot is not None else None,
            "proposed": proposed / len(runs), "accepted": accepted / len(runs),
            "acceptance": accepted / proposed if proposed else None,
            "tokens_per_verify": 1 + accepted / drafts if drafts else None}


def closed_batches(model, workload: str) -> dict:
    """Every configuration's engine at each batch size, warmed, then --repeats rounds in which
    each runs the batch once in turn: a slow drift of the machine touches all alike, and the
    speedup is the median of the rounds' ratios to no speculation."""
    from tqdm.auto import tqdm

    from cbjax import LLM

    sizes = [int(b) for b in FLAGS.batch_sizes]
    pool = requests(model, workload, max(sizes) * FLAGS.requests_per_slot)
    rows = {}
    for batch in sizes:
        reqs = pool[:batch * FLAGS.requests_per_slot]
        engines = {}
        for label, options in configurations():
            engines[label] = LLM(model, num_slots=batch, **engine_options(options))
            engines[label].warmup()
        before = {label: llm.load() for label, llm in engines.items()}
        runs = {label: [] for label in engines}
        for _ in tqdm(range(FLAGS.repeats), desc=f"{workload} batch {batch}: turns"):
            for label, llm in engines.items():
                runs[label].append(run_once(llm, reqs))
        for label, llm in engines.items():
            row = summarize(runs[label], before[label], llm.load())
            row["speedup"] = float(np.median([a[0] / b[0] for a, b in zip(runs[label], runs["none"])]))
            add_row(rows, workload, batch, label, "in-process", row)
        del engines, llm
        common.release_programs()
        if FLAGS.served:
            engines = {label: server_argv(dict(engine_options(options), num_slots=batch))
                       for label, options in configurations()}
            served = served_batches(FLAGS.model, engines, reqs, FLAGS.repeats, FLAGS.output_dir,
                                    f"server_{workload}_{batch}")
            for label, row in served.items():
                row["speedup"] = float(np.median([a / b for a, b in zip(row["runs_tok_per_s"],
                                                                         served["none"]["runs_tok_per_s"])]))
                add_row(rows, workload, batch, label, "served", row)
    return rows


def add_row(rows: dict, workload: str, batch: int, label: str, path: str, row: dict) -> None:
    none = rows.get(f"{workload}/b{batch}/none/{path}")
    if "speedup" not in row:
        row["speedup"] = row["tok_per_s"] / none["tok_per_s"] if none is not None else 1.0
    rows[f"{workload}/b{batch}/{label}/{path}"] = {"workload": workload, "batch": batch, "config": label, "path": path,
                                                   **row}
    print(f"{workload:>9} batch {batch:>3} {label:>9} {path:>10}: {row['tok_per_s']:8.1f} tok/s  "
          f"x{row['speedup']:.2f}  accepted {row['accepted'] or 0:.0f}", flush=True)


def server_argv(options: dict) -> list[str]:
    """An engine's `LLM` keywords as the server's flags."""
    return [f"--{'' if v else 'no'}{k}" if isinstance(v, bool) else f"--{k}={v}"
            for k, v in options.items() if v is not None]


def poisson(model, workload: str) -> dict:
    from cbjax import LLM
    from cbjax.experimental import WorkloadRequest, arrival_times

    reqs = requests(model, workload, FLAGS.poisson_requests)
    rows = {}
    for qps in (float(q) for q in FLAGS.qps):
        times = arrival_times("poisson", len(reqs), np.random.default_rng(FLAGS.seed), qps, 1.0)
        work = [WorkloadRequest(float(t), p, s) for t, (p, s) in zip(times, reqs)]
        for label, options in configurations():
            llm = LLM(model, num_slots=FLAGS.num_slots, **engine_options(options))
            m = common.run_replay(llm, work, desc=f"{label}@{qps:g}")
            load = llm.load()
            rows[f"{workload}/{qps:g}/{label}"] = {
                "workload": workload, "qps": qps, "config": label, "mean_running": m["mean_running"],
                **{k: m[k] for k in ("mean_tpot_ms", "median_tpot_ms", "median_e2el_ms", "p99_e2el_ms",
                                     "output_throughput")},
                "acceptance": load.spec_accepted_tokens / load.spec_draft_tokens if load.spec_draft_tokens else None}
            del llm
            common.release_programs()
    return rows


def table(closed: dict, arrivals: dict) -> str:
    lines = ["| workload | batch | config | path | tok/s | speedup | median TTFT ms | mean TPOT ms | accepted / run "
             "| acceptance | tokens / verify |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in closed.values():
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        per = "" if r["tokens_per_verify"] is None else f"{r['tokens_per_verify']:.2f}"
        tpot = "" if r["mean_tpot_ms"] is None else f"{r['mean_tpot_ms']:.1f}"
        ttft = f"{r['median_ttft_ms']:.0f}" if r.get("median_ttft_ms") is not None else ""
        lines.append(f"| {r['workload']} | {r['batch']} | {r['config']} | {r['path']} | {r['tok_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {ttft} | {tpot} | {r['accepted'] or 0:.0f} | {acc} | {per} |")
    if arrivals:
        lines += ["", "| workload | Poisson req/s | config | mean running | mean TPOT ms | median E2E ms | "
                  "p99 E2E ms | tok/s | acceptance |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in arrivals.values():
            acc = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            lines.append(f"| {r['workload']} | {r['qps']:g} | {r['config']} | {r['mean_running']:.1f} | "
                         f"{r['mean_tpot_ms']:.1f} | {r['median_e2el_ms']:.0f} | {r['p99_e2el_ms']:.0f} | "
                         f"{r['output_throughput']:.1f} | {acc} |")
    return "\n".join(lines)


def plot(closed: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in closed.values()))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in closed.values() if r["workload"] == workload and r["path"] == "in-process"]
        for label in dict.fromkeys(r["config"] for r in rows):
            mine = [r for r in rows if r["config"] == label]
            ax.plot([r["batch"] for r in mine], [r["speedup"] for r in mine], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (requests decoding together)")
        ax.set_ylabel("throughput / no speculation")
        ax.set_title(f"{FLAGS.model}: {workload}" + (f" (simulated {FLAGS.simulate})" if FLAGS.simulate else ""))
        ax.grid(alpha=0.3)
        ax.legend()
    common.savefig(fig, path)


def main(argv):
    del argv
    start = time.perf_counter()
    text = any(w != "synthetic" for w in FLAGS.workloads)
    if FLAGS.simulate and text:
        raise app.UsageError("--simulate has no tokens to propose from: use --workloads=synthetic")
    if FLAGS.simulate and FLAGS.served:
        raise app.UsageError("--served runs the server on this machine's devices: not with --simulate")
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    model = common.load_model(FLAGS.model, FLAGS.dtype, with_tokenizer=text)
    closed, arrivals = {}, {}
    for workload in FLAGS.workloads:
        closed.update(closed_batches(model, workload))
        if FLAGS.qps:
            arrivals.update(poisson(model, workload))
    result = table(closed, arrivals)
    print("\n" + result)
    common.write_outputs(FLAGS.output_dir, "speculation", result,
                         {"closed_batches": closed, "poisson": arrivals, "wall_s": time.perf_counter() - start},
                         lambda path: plot(closed, path), text_suffix=".md")


if __name__ == "__main__":
    app.run(main)
