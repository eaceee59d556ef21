"""One stream's inter-token gaps alone, then beside adversarial clients: eight concurrent
constrained requests with regexes that explode or crawl, and one maximal `prompt_logprobs`
request (as many prompt tokens x k as the server admits); and, for scale, beside eight plain
requests of the same shape (on a CPU, decoding nine rows costs more than one, adversarial
or not). Each adversary is re-sent as soon as it is answered (after `--refused_backoff_s`
when refused), so the stream runs beside all of them from its first token to its last.

The server runs as its own process (`python -m cbjax.serve`), as a user would run it; the
client's clock measures the gaps between the stream's SSE events. Prints the gap median,
p90 and max per scenario and their ratios to the stream alone, and writes JSON.

    python -m experiments serve_abuse                         # the embedded SmolLM2-135M
    python -m experiments serve_abuse --model=/path/to/hf_dir --stream_tokens=128
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np
from absl import app, flags

from experiments.lib import common
from cbjax.experimental import define_engine_flags, engine_argv, engine_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "smollm2-135m", "Preset, Hugging Face directory, .gguf file or orbax directory.")
flags.DEFINE_integer("stream_tokens", 96, "Tokens the measured stream generates.", lower_bound=8)
flags.DEFINE_integer("repeats", 3, "Streams per scenario; the gaps of all of them are pooled.", lower_bound=1)
flags.DEFINE_integer("adversaries", 8, "Concurrent constrained requests in the constrained scenario.", lower_bound=1)
flags.DEFINE_list("regexes", ["(a{100}){100}{100}", "(a{100}){100}", "([a-z]{1,50}[0-9]{1,50}){1,40}"],
                  "The adversaries' guided_regex values, dealt round-robin.")
flags.DEFINE_integer("max_logprob_entries", 1 << 16, "The server's --max_logprob_entries (the prompt_logprobs "
                     "adversary asks for as much as it admits).", lower_bound=1)
flags.DEFINE_float("refused_backoff_s", 0.1, "Seconds a refused adversary waits before sending again.",
                   lower_bound=0.0)
flags.DEFINE_integer("load_requests", 4000, "Short requests sent after the scenarios (half streamed), to check "
                     "that none is lost and /metrics counts them all (0: skip).", lower_bound=0)
flags.DEFINE_integer("load_concurrency", 64, "Requests in flight at once during the load.", lower_bound=1)
flags.DEFINE_float("startup_timeout_s", 900.0, "How long to wait for the server's /health.", lower_bound=1.0)
flags.DEFINE_string("output_dir", "results/serve_abuse", "Where the JSON and the server log go.")
define_engine_flags(num_slots=16, max_seq_len=512)
flags.adopt_module_key_flags(common)
flags.adopt_module_key_flags(engine_flags)


async def _stream_gaps(session, url: str, model: str, tokens: int) -> list[float]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return list(np.diff(times[1:]))  # from the first token on: the gaps a reader sees


async def _keep_sending(session, url: str, body: dict, stop: asyncio.Event, statuses: list) -> None:
    while not stop.is_set():
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()
            statuses.append(r.status)
        if r.status != 200:  # a refused client retries after a pause (a flood is another benchmark)
            await asyncio.sleep(FLAGS.refused_backoff_s)


def _adversaries(model: str, max_len: int, vocab_hint: int = 200) -> dict[str, list[dict]]:
    plain = [{"model": model, "prompt": "Write:", "max_tokens": 64, "temperature": 1.0}] * FLAGS.adversaries
    constrained = [{**plain[0], "guided_regex": FLAGS.regexes[i % len(FLAGS.regexes)]}
                   for i in range(FLAGS.adversaries)]
    k = 20
    length = max_len - 1
    prompts = max(FLAGS.max_logprob_entries // (length * (1 + k)), 1)
    rows = [[1 + (7 * i + j) % vocab_hint for j in range(length)] for i in range(prompts)]
    logprobs = [{"model": model, "prompt": rows, "max_tokens": 1, "prompt_logprobs": k}]
    return {f"beside {FLAGS.adversaries} plain": plain, f"beside {FLAGS.adversaries} constrained": constrained,
            "beside max prompt_logprobs": logprobs}


async def _scenario(url: str, model: str, bodies: list[dict]) -> tuple[list[float], dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        stop, statuses = asyncio.Event(), []
        senders = [asyncio.create_task(_keep_sending(session, url, b, stop, statuses)) for b in bodies]
        if bodies:
            await asyncio.sleep(0.5)  # the adversaries in flight before the stream starts
        gaps = []
        for _ in range(FLAGS.repeats):
            gaps += await _stream_gaps(session, url, model, FLAGS.stream_tokens)
        stop.set()
        await asyncio.gather(*senders)
    return gaps, {str(s): statuses.count(s) for s in sorted(set(statuses))}


def _metric(url: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def _load(url: str, model: str, pid: int) -> dict:
    """`--load_requests` short requests at `--load_concurrency`: nothing lost, /metrics equal to
    the client's count, the server's RSS after against before."""
    import aiohttp

    queue = asyncio.Queue()
    for i in range(FLAGS.load_requests):
        queue.put_nowait(i)
    statuses: list[int] = []

    async def worker(session):
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "prompt": f"Request {i}: tell me", "max_tokens": 4, "temperature": 0,
                    "stream": i % 2 == 0}
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()
                statuses.append(r.status)

    before_ok = _metric(url, "vllm:request_success_total")
    rss_before = _rss_mb(pid)
    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(FLAGS.load_concurrency)))
    elapsed = time.perf_counter() - start
    answered = statuses.count(200)
    counted = _metric(url, "vllm:request_success_total") - before_ok
    return {"requests": FLAGS.load_requests, "answered_200": answered, "other_statuses": len(statuses) - answered,
            "metrics_success_delta": counted, "rss_mb_before": rss_before, "rss_mb_after": _rss_mb(pid),
            "seconds": elapsed}


def _stats(gaps: list[float]) -> dict:
    g = np.asarray(gaps) * 1e3
    return {"median_gap_ms": float(np.median(g)), "p90_gap_ms": float(np.percentile(g, 90)),
            "max_gap_ms": float(g.max()), "gaps": len(g)}


def main(argv):
    del argv
    os.makedirs(FLAGS.output_dir, exist_ok=True)
    model = "served"
    process, url, _ = common.start_server(
        FLAGS.model, [f"--served_model_name={model}", f"--max_logprob_entries={FLAGS.max_logprob_entries}",
                      *engine_argv()], os.path.join(FLAGS.output_dir, "server.log"), FLAGS.startup_timeout_s)
    results = {}
    try:
        scenarios = {"alone": [], **_adversaries(model, FLAGS.max_seq_len)}
        for name, bodies in scenarios.items():
            gaps, statuses = asyncio.run(_scenario(url, model, bodies))
            results[name] = {**_stats(gaps), "adversary_statuses": statuses}
            print(f"{name}: {results[name]}", flush=True)
        load = asyncio.run(_load(url, model, process.pid)) if FLAGS.load_requests else None
    finally:
        process.terminate()
        process.wait(30)
    alone, plain = results["alone"], results[f"beside {FLAGS.adversaries} plain"]
    print(f"\n{'scenario':28s} {'median ms':>10s} {'p90 ms':>8s} {'max ms':>8s} {'median/alone':>13s} "
          f"{'p90/alone':>10s} {'p90/plain':>10s}  adversaries answered")
    for name, r in results.items():
        r["median_vs_alone"] = r["median_gap_ms"] / alone["median_gap_ms"]
        r["p90_vs_alone"] = r["p90_gap_ms"] / alone["p90_gap_ms"]
        r["p90_vs_plain"] = r["p90_gap_ms"] / plain["p90_gap_ms"]
        print(f"{name:28s} {r['median_gap_ms']:10.1f} {r['p90_gap_ms']:8.1f} {r['max_gap_ms']:8.1f} "
              f"{r['median_vs_alone']:12.2f}x {r['p90_vs_alone']:9.2f}x {r['p90_vs_plain']:9.2f}x  "
              f"{r['adversary_statuses']}")
    if load is not None:
        print(f"\nload after the abuse: {load['answered_200']}/{load['requests']} answered 200 "
              f"({load['other_statuses']} other), /metrics counted {load['metrics_success_delta']:.0f}; server RSS "
              f"{load['rss_mb_before']:.0f} -> {load['rss_mb_after']:.0f} MB; {load['seconds']:.1f}s")
    path = os.path.join(FLAGS.output_dir, "serve_abuse.json")
    with open(path, "w") as f:
        json.dump({"flags": common.script_flags(), "results": results, "load": load}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
