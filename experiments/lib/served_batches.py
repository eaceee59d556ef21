"""Closed batches through the server, as a user would send them: start `python -m cbjax.serve`
with each engine's knobs, send every request at once as a streamed completion through the
official `openai` client, and read the speculation counters off `/metrics`. TTFT, TPOT and
throughput are on the client's clock."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import urllib.request

from experiments.lib import common

SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "proposed": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens"}


def spec_counters(url: str) -> dict[str, float]:
    """The server's speculation counters, from its Prometheus text."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key, metric in SPEC_COUNTERS.items():
            if name.split("{")[0] == metric:
                values[key] = float(value)
    return {key: values.get(key, 0.0) for key in SPEC_COUNTERS}


async def send_batch(url: str, reqs) -> list[tuple[float, float, float, int]]:
    """Every (prompt ids, SamplingParams) at once; per request (start, first token, end, tokens)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="cbjax", max_retries=0, timeout=3600)

    async def one(prompt, sampling):
        start = time.perf_counter()
        stream = await client.completions.create(
            model="cbjax", prompt=list(prompt), max_tokens=sampling.max_tokens, temperature=sampling.temperature,
            stream=True, extra_body={"ignore_eos": sampling.ignore_eos})
        first, tokens = None, 0
        async for chunk in stream:
            if chunk.choices:
                ids = getattr(chunk.choices[0], "token_ids", None)
                n = len(ids) if ids is not None else int(bool(chunk.choices[0].text))
                if n and first is None:
                    first = time.perf_counter()
                tokens += n
        return start, first if first is not None else time.perf_counter(), time.perf_counter(), tokens

    try:
        return await asyncio.gather(*(one(p, s) for p, s in reqs))
    finally:
        await client.close()


def run_served(url: str, reqs) -> dict:
    """One run of `reqs` through the server at `url`: throughput, median TTFT, mean TPOT."""
    times = asyncio.run(send_batch(url, reqs))
    wall = max(t[2] for t in times) - min(t[0] for t in times)
    tpots = [(end - first) / (n - 1) for _, first, end, n in times if n > 1]
    return {"tok_per_s": sum(t[3] for t in times) / wall,
            "median_ttft_ms": 1000 * statistics.median(t[1] - t[0] for t in times),
            "mean_tpot_ms": 1000 * statistics.mean(tpots) if tpots else None}


def served_batches(model: str, engines: dict[str, list[str]], reqs, repeats: int, log_dir: str, log_prefix: str,
                   startup_timeout_s: float = 600.0) -> dict[str, dict]:
    """`reqs` through a server for each of `engines` (label -> engine flags), all started
    first, then `repeats` turns in which each server runs the batch once (a slow drift of the
    machine touches all alike). Per label: the median run's throughput, TTFT and TPOT, every
    run's throughput, and the speculation counters per run."""
    servers = {}
    try:
        for label, argv in engines.items():
            log = os.path.join(log_dir, f"{log_prefix}_{label.replace(' ', '_')}.log")
            servers[label] = common.start_server(model, ["--served_model_name=cbjax", "--warmup_structured=false",
                                                         *argv], log, startup_timeout_s)[:2]
        before = {label: spec_counters(url) for label, (_, url) in servers.items()}
        runs = {label: [] for label in servers}
        for _ in range(repeats):
            for label, (_, url) in servers.items():
                runs[label].append(run_served(url, reqs))
        after = {label: spec_counters(url) for label, (_, url) in servers.items()}
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    rows = {}
    for label in engines:
        row = sorted(runs[label], key=lambda r: r["tok_per_s"])[len(runs[label]) // 2]
        spent = {key: (after[label][key] - before[label][key]) / repeats for key in SPEC_COUNTERS}
        rows[label] = {**row, "runs_tok_per_s": [r["tok_per_s"] for r in runs[label]], "proposed": spent["proposed"],
                       "accepted": spent["accepted"],
                       "acceptance": spent["accepted"] / spent["proposed"] if spent["proposed"] else None,
                       "tokens_per_verify": 1 + spent["accepted"] / spent["drafts"] if spent["drafts"] else None}
    return rows
