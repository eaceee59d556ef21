"""Poisson load against the OpenAI-compatible server through the official `openai` client,
next to the same workload replayed in process (`LLM.replay`) at the same QPS, and, with
`--peer_url`, next to another OpenAI-compatible server (llama.cpp's `llama-server`, vLLM)
on the same workload.

The server runs as its own process (`python -m cbjax.serve`, started here with the same
engine flags), so client and engine do not share an interpreter; it is stopped before the
in-process replays start, so the two never share the cores. Latencies are measured where
each side sees them: the client's clock for the server (HTTP, JSON, SSE and detokenizing
included), the engine's for the replay. Same metric definitions (cbjax.metrics).

    python -m experiments serve_bench
    python -m experiments serve_bench --qps=1,4 --num_slots=16 --kv_cache=paged
    python -m experiments serve_bench --url=http://localhost:8000 --served_model_name=smollm2-135m --noin_process
    python -m experiments serve_bench --flagfile=configs/serve_bench_cpu.cfg --peer_url=http://localhost:8091 \
        --peer_model_name=smollm2 --repeats=3

With a peer, each rate runs `--repeats` times, cbjax's server and the peer alternating
(ABBA order), and every metric is the median over the repeats: on a shared VM whose memory
bandwidth drifts by 10-20% from one minute to the next, only runs interleaved in the same
window compare. Every (rate, repeat) draws prompts of its own (`--seed` + its index), so no
server is sent a prompt it has seen before: llama-server's prompt cache (on by default)
would otherwise skip the prefill of a prompt one of its slots still holds, and a second
rate run on the same prompts would measure cache hits.
"""

from __future__ import annotations

import asyncio
import os
import time

from absl import app, flags

from experiments.lib import common
from cbjax.experimental import engine_flags
from cbjax.experimental import define_engine_flags, engine_args_from_flags as engine_args, engine_argv, engine_options

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_string("url", None, "Benchmark a server already running here (e.g. http://localhost:8000) instead "
                                 "of starting one; its engine flags are then its own.")
flags.DEFINE_string("served_model_name", None, "The 'model' field to send (default: --model).")
flags.DEFINE_list("qps", ["2", "6"], "Request rates (requests per second), Poisson arrivals.")
flags.DEFINE_string("peer_url", None, "Another OpenAI-compatible server to run the same workload against, "
                    "interleaved with cbjax's (e.g. llama-server at http://localhost:8091).")
flags.DEFINE_string("peer_model_name", None, "The 'model' field to send to --peer_url (default: the same as ours).")
flags.DEFINE_integer("repeats", 1, "Runs per rate and server side (interleaved ABBA with --peer_url); "
                     "metrics are the medians over the runs (the in-process replay runs the first repeat's "
                     "workload once).", lower_bound=1)
flags.DEFINE_bool("in_process", True, "Also replay each workload in process for the side-by-side rows.")
flags.DEFINE_float("startup_timeout_s", 900.0, "How long to wait for the started server's /health.",
                   lower_bound=1.0)
flags.DEFINE_string("output_dir", "results/serve_bench", "Where the JSON, the plot and the server log go.")
define_engine_flags(num_slots=8, max_seq_len=256)
common.define_workload_flags(num_requests=32, output_mean=32.0, output_cap=96)
flags.adopt_module_key_flags(common)
flags.adopt_module_key_flags(engine_flags)
common.validate_list("qps", float, 1e-6, "positive request rates")

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
        "output_throughput")
RATIO_KEYS = ("median_ttft_ms", "median_tpot_ms", "median_e2el_ms", "output_throughput")


def start_server(model_name: str, log_path: str):
    process, url, _ = common.start_server(FLAGS.model, [f"--served_model_name={model_name}", *engine_argv()],
                                          log_path, FLAGS.startup_timeout_s)
    return process, url


async def run_load(url: str, model_name: str, workload, desc: str):
    """Send each request at its arrival offset as a streamed completion; per-request times
    on the client's clock."""
    import openai
    from tqdm.auto import tqdm

    from cbjax.experimental import RequestTimes

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="cbjax", max_retries=0, timeout=3600)
    bar = tqdm(total=len(workload), desc=desc, unit="req")
    start = time.perf_counter()

    async def one(item):
        await asyncio.sleep(max(0.0, start + item.arrival - time.perf_counter()))
        arrival = time.perf_counter()
        stream = await client.completions.create(
            model=model_name, prompt=list(item.prompt), max_tokens=item.sampling.max_tokens,
            temperature=item.sampling.temperature, stream=True,
            extra_body={"ignore_eos": item.sampling.ignore_eos},
            # A connection per request: a kept-alive one that the server closed meanwhile
            # failed a whole run ("Server disconnected without sending a response", llama-server
            # at 3 req/s), and a retry would count in the request's TTFT.
            extra_headers={"Connection": "close"})
        token_times: list[float] = []
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                ids = getattr(chunk.choices[0], "token_ids", None)  # our extension; else a chunk per token
                token_times += [now] * (len(ids) if ids is not None else int(bool(chunk.choices[0].text)))
        bar.update(1)
        return RequestTimes(arrival, token_times[0], time.perf_counter(), token_times, len(item.prompt),
                            len(token_times))

    try:
        return await asyncio.gather(*(one(item) for item in workload))
    finally:
        bar.close()
        await client.close()


def median_runs(runs: list[dict]) -> dict:
    """Each numeric metric's median over repeated runs; the E2E CDF of the median-E2E run."""
    import numpy as np

    out = {k: float(np.median([r[k] for r in runs])) for k, v in runs[0].items() if isinstance(v, (int, float))}
    middle = sorted(runs, key=lambda r: r["median_e2el_ms"])[len(runs) // 2]
    return {**out, "e2el_s": middle["e2el_s"], "runs": len(runs),
            "requests": [r["requests"] for r in runs if "requests" in r]}


def load_runs(sides: list[tuple[str, str, str]], workloads: list, qps: float) -> dict[str, dict]:
    """Repeat r runs `workloads[r]` on each `(side, url, model name)`, in ABBA order."""
    from cbjax.experimental import summarize

    runs: dict[str, list[dict]] = {side: [] for side, _, _ in sides}
    for r, workload in enumerate(workloads):
        for side, url, name in (sides if r % 2 == 0 else sides[::-1]):
            times = asyncio.run(run_load(url, name, workload, f"{side}@{qps:g}"))
            metrics = summarize(times)
            metrics["e2el_s"] = sorted(t.e2el for t in times)
            # Each request, in workload order, to see which ones a difference comes from: arrival
            # (s after the run's start), prompt and output tokens, TTFT and TPOT (ms).
            start = min(t.arrival for t in times)
            metrics["requests"] = [[round(t.arrival - start, 4), t.num_prompt_tokens, t.num_output_tokens,
                                    round(1000 * t.ttft, 2), None if t.tpot is None else round(1000 * t.tpot, 2)]
                                   for t in times]
            runs[side].append(metrics)
    return {side: {"side": side, "qps": qps, **median_runs(rs)} for side, rs in runs.items()}


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.experimental import load_model, write_json

    start = time.perf_counter()
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    model_name = FLAGS.served_model_name or FLAGS.model
    model = load_model(FLAGS.model, dtype=FLAGS.dtype, with_tokenizer=common.wants_tokenizer())
    qps_list = [float(q) for q in FLAGS.qps]
    workloads = {qps: [common.make_workload(model, "poisson", qps, seed=FLAGS.seed + i * FLAGS.repeats + r)
                       for r in range(FLAGS.repeats)] for i, qps in enumerate(qps_list)}

    results = {}
    process, url = (None, FLAGS.url) if FLAGS.url else start_server(
        model_name, os.path.join(FLAGS.output_dir, "server.log"))
    try:
        sides = [("server", url, model_name)]
        if FLAGS.peer_url:
            sides.append(("peer", FLAGS.peer_url.rstrip("/"), FLAGS.peer_model_name or model_name))
        for qps in qps_list:
            for side, metrics in load_runs(sides, workloads[qps], qps).items():
                results[f"{side}@{qps:g}"] = metrics
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    if FLAGS.in_process:
        llm = LLM(model, engine_args())
        for qps in qps_list:
            results[f"in-process@{qps:g}"] = {"side": "in-process", "qps": qps,
                                              **common.run_replay(llm, workloads[qps][0], desc=f"in-process@{qps:g}")}

    header = f"{'side @ qps':<18}" + "".join(f"{k:>20}" for k in KEYS)
    lines = [header, "-" * len(header)]
    for name, m in results.items():
        lines.append(f"{name:<18}" + "".join(f"{m[k]:>20.1f}" for k in KEYS))
    ratios = {"in-process": {}, "peer": {}}  # server / other, per rate
    for other, by_rate in ratios.items():
        for qps in qps_list:
            served, base = results.get(f"server@{qps:g}"), results.get(f"{other}@{qps:g}")
            if served and base:
                by_rate[f"{qps:g}"] = {k: served[k] / base[k] for k in RATIO_KEYS if base[k] > 0}
                lines.append(f"server / {other} @ {qps:g} req/s: " + ", ".join(
                    f"{k} {v:.2f}x" for k, v in by_rate[f"{qps:g}"].items()))
    table = "\n".join(lines)
    print("\n" + table)

    common.plot_e2e_cdfs(results, qps_list, ("server", "in-process", "peer"), model_name,
                         os.path.join(FLAGS.output_dir, "serve_vs_replay_cdf.png"))
    write_json(os.path.join(FLAGS.output_dir, "serve_bench.json"),
               {"flags": common.script_flags(), "engine": engine_options(), "url": FLAGS.url,
                "results": results, "ratios": ratios["in-process"],
                "peer_url": FLAGS.peer_url, "peer_ratios": ratios["peer"], "table": table, "wall_s": time.perf_counter() - start})
    print(f"\nwrote {FLAGS.output_dir}/serve_bench.json and serve_vs_replay_cdf.png "
          f"in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    app.run(main)
