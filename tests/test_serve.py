"""The OpenAI-compatible server, driven by the official `openai` client over loopback.

A tiny random llama with a byte-level tokenizer and a chat template (tests/hf_models.py):
its outputs are gibberish with broken UTF-8, which is what the streaming detokenizer
must survive. Every greedy result is checked against `LLM.generate` on the same engine,
run before the server took it over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cbjax import LLM, SamplingParams
from cbjax.serve import Server, protocol
from cbjax.tokenization import chat_prompt_ids
from tests.hf_models import save_chat_model
from tests.internals import pages_of

MODEL = "tiny-chat"
TEXT_PROMPTS = ["Hello, world!", "Continuous batching", "ünïcödé ✓ 漢字 and more", "The lazy dog"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paged attention?"}]
NUM_STREAMS = 64
MAX_TOKENS = 12


def _greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def _stream_prompts() -> list[list[int]]:
    return [[1 + (7 * i + 3 * j) % 250 for j in range(3 + i % 11)] for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(str(tmp_path_factory.mktemp("chat_model")))


@pytest.fixture(scope="module")
def served(model_dir):
    """(server, references): the references come from LLM.generate before serving."""
    llm = LLM(model_dir, num_slots=8, max_seq_len=96)
    ref = {
        "text": llm.generate(TEXT_PROMPTS, _greedy(), use_tqdm=False),
        "chat": llm.generate([chat_prompt_ids(llm.tokenizer, CHAT[1]["content"], CHAT[0]["content"])],
                             _greedy(20), use_tqdm=False)[0],
        "streams": llm.generate(_stream_prompts(), _greedy(), use_tqdm=False),
        "seeded": llm.generate(TEXT_PROMPTS[:1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9,
                                                                 top_k=50, seed=7), use_tqdm=False)[0],
    }
    llm.warmup()  # as the CLI does: a stream's pace then never includes a compilation
    with Server(llm, MODEL, port=0) as server:
        yield server, ref


def _client(server, cls=openai.OpenAI):
    return cls(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


def _wait_idle(server, timeout=60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 \
                and m["vllm:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"the server never went idle: {m}"
        time.sleep(0.05)


# ---------------------------------------------------------------- results
def test_completion_equals_llm_generate(served):
    server, ref = served
    client = _client(server)
    for prompt, expected in zip(TEXT_PROMPTS, ref["text"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        c = r.choices[0]
        assert c.token_ids == expected.token_ids
        assert c.text == expected.text
        assert c.finish_reason == expected.finish_reason
        assert r.usage.completion_tokens == len(expected.token_ids)
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_completion_equals_llm_generate(served):
    server, ref = served
    client = _client(server)
    for prompt, expected in zip(TEXT_PROMPTS, ref["text"]):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        body = [c for c in chunks if c.choices]
        assert sum((c.choices[0].token_ids for c in body), []) == expected.token_ids
        assert "".join(c.choices[0].text for c in body) == expected.text
        assert [c.choices[0].finish_reason for c in body][-1] == expected.finish_reason
        assert all(c.choices[0].finish_reason is None for c in body[:-1])
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_token_id_prompts_and_batches(served):
    server, ref = served
    client = _client(server)
    prompts = [o.prompt_token_ids for o in ref["text"]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(prompts)))
    assert [c.token_ids for c in r.choices] == [o.token_ids for o in ref["text"]]
    assert r.usage.prompt_tokens == sum(map(len, prompts))


def test_chat_equals_llm_generate(served):
    server, ref = served
    client = _client(server)
    expected = ref["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert r.choices[0].token_ids == expected.token_ids
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert sum((c.choices[0].token_ids for c in chunks), []) == expected.token_ids
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_seeded_sampling_equals_llm_generate(served):
    server, ref = served
    r = _client(server).completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0.9, top_p=0.9, seed=7, extra_body={"top_k": 50})
    assert r.choices[0].token_ids == ref["seeded"].token_ids


def test_stop_strings_cut_the_text(served):
    server, ref = served
    expected = ref["text"][0]
    text = expected.text
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if text.find(text[i:i + 2]) == i
                and "\ufffd" not in text[i:i + 2])
    cut = text[:text.index(stop)]
    client = _client(server)
    before = _wait_idle(server)
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    after = _wait_idle(server)
    # Counted as the client saw them: two stops (the front aborted both in the engine), no abort.
    key = "vllm:request_success_total{{finished_reason={}}}"
    assert after.get(key.format("stop"), 0) - before.get(key.format("stop"), 0) == 2
    assert after.get(key.format("abort"), 0) == before.get(key.format("abort"), 0)


def test_concurrent_streams_lose_nothing(served):
    server, ref = served
    client = _client(server, openai.AsyncOpenAI)

    async def one(prompt):
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True)
        ids, reasons = [], []
        async for chunk in stream:
            ids += chunk.choices[0].token_ids
            reasons.append(chunk.choices[0].finish_reason)
        return ids, reasons[-1]

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in _stream_prompts()))
        finally:
            await client.close()

    before = _metrics(server)
    results = asyncio.run(main())
    assert [ids for ids, _ in results] == [o.token_ids for o in ref["streams"]]
    assert [r for _, r in results] == [o.finish_reason for o in ref["streams"]]
    after = _wait_idle(server)
    finished = sum(v for k, v in after.items() if k.startswith("vllm:request_success_total")) - \
        sum(v for k, v in before.items() if k.startswith("vllm:request_success_total"))
    assert finished == NUM_STREAMS
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        sum(len(o.token_ids) for o in ref["streams"])
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] \
        == NUM_STREAMS


# ------------------------------------------------------------ endpoints
def test_models_health_and_metrics(served):
    server, _ = served
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert json.loads(urllib.request.urlopen(server.url + "/health").read()) == {"status": "ok"}
    m = _metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert name in m, name


# -------------------------------------------------------- bad requests
def _post(server, path: str, body, raw: bytes | None = None, method: str = "POST") -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MALFORMED = {
    "not json": dict(raw=b"{'prompt': "),
    "body not an object": dict(body=["prompt"]),
    "model missing": dict(body={"prompt": "hi"}),
    "unknown model": dict(body={"model": "gpt-4", "prompt": "hi"}, status=404),
    "prompt missing": dict(body={"model": MODEL}),
    "empty prompt": dict(body={"model": MODEL, "prompt": ""}),
    "token id outside the vocabulary": dict(body={"model": MODEL, "prompt": [1, 2, 10 ** 6]}),
    "negative max_tokens": dict(body={"model": MODEL, "prompt": "hi", "max_tokens": -3}),
    "max_tokens as a string": dict(body={"model": MODEL, "prompt": "hi", "max_tokens": "5"}),
    "negative temperature": dict(body={"model": MODEL, "prompt": "hi", "temperature": -1}),
    "top_p zero": dict(body={"model": MODEL, "prompt": "hi", "top_p": 0}),
    "min_p past 1": dict(body={"model": MODEL, "prompt": "hi", "min_p": 1.5}),
    "stream not a bool": dict(body={"model": MODEL, "prompt": "hi", "stream": "yes"}),
    "prompt past the context": dict(body={"model": MODEL, "prompt": [5] * 200}),
    "prompt plus max_tokens past the context": dict(body={"model": MODEL, "prompt": [5] * 90, "max_tokens": 50}),
    "n = 0": dict(body={"model": MODEL, "prompt": "hi", "n": 0}),
    "best_of < n": dict(body={"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}),
    "streamed best_of": dict(body={"model": MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True}),
    "logprobs past max_logprobs": dict(body={"model": MODEL, "prompt": "hi", "logprobs": 50}),
    "negative logprobs": dict(body={"model": MODEL, "prompt": "hi", "logprobs": -1}),
    "streamed echo with logprobs": dict(body={"model": MODEL, "prompt": "hi", "logprobs": 1, "echo": True,
                                              "stream": True}),
    "prompt_logprobs past max_logprobs": dict(body={"model": MODEL, "prompt": "hi", "prompt_logprobs": 50}),
    "top_logprobs without logprobs": dict(path="/v1/chat/completions",
                                          body={"model": MODEL, "messages": CHAT, "top_logprobs": 2}),
    "logit_bias not ids": dict(body={"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}),
    "logit_bias id past vocab": dict(body={"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}),
    "presence_penalty out of range": dict(body={"model": MODEL, "prompt": "hi", "presence_penalty": 5}),
    "repetition_penalty 0": dict(body={"model": MODEL, "prompt": "hi", "repetition_penalty": 0}),
    "stop not strings": dict(body={"model": MODEL, "prompt": "hi", "stop": [1, 2]}),
    "huge seed": dict(body={"model": MODEL, "prompt": "hi", "seed": 2 ** 70}),
    "priority not an integer": dict(body={"model": MODEL, "prompt": "hi", "priority": "high"}),
    "priority past int32": dict(body={"model": MODEL, "prompt": "hi", "priority": 2 ** 40}),
    "chat: no messages": dict(path="/v1/chat/completions", body={"model": MODEL, "messages": []}),
    "chat: unknown role": dict(path="/v1/chat/completions",
                               body={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
    "chat: content not text": dict(path="/v1/chat/completions",
                                   body={"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
    "chat: tools": dict(path="/v1/chat/completions",
                        body={"model": MODEL, "messages": CHAT, "tools": [{"type": "function"}]}),
    "unknown route": dict(path="/v1/embeddings", body={"model": MODEL, "input": "hi"}, status=404),
    "wrong method": dict(path="/v1/completions", method="GET", status=405),
    "body over the size limit": dict(raw=b'{"prompt": "' + b"x" * (9 << 20) + b'"}', status=413),
    "nested past the recursion limit": dict(raw=b"[" * 100_000 + b"]" * 100_000),
    "prompt nested past the recursion limit": dict(
        raw=b'{"model": "' + MODEL.encode() + b'", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "a 10,000-digit max_tokens": dict(raw=b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": '
                                      + b"9" * 10_000 + b"}"),
    "a lone surrogate in the prompt": dict(raw=b'{"model": "' + MODEL.encode() + b'", "prompt": "\\ud800x"}'),
    "a lone surrogate in a batch": dict(raw=b'{"model": "' + MODEL.encode() + b'", "prompt": ["ok", "\\udfffx"]}'),
    "a lone surrogate in a stop string": dict(raw=b'{"model": "' + MODEL.encode()
                                              + b'", "prompt": "hi", "stop": "\\ud800"}'),
    "a lone surrogate in chat": dict(path="/v1/chat/completions", raw=b'{"model": "' + MODEL.encode()
                                     + b'", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    "tokenize: unknown model": dict(path="/tokenize", body={"model": "gpt-4", "prompt": "hi"}, status=404),
    "detokenize: id outside the vocabulary": dict(path="/detokenize", body={"model": MODEL, "tokens": [10 ** 6]}),
    "model card of an unknown model": dict(path="/v1/models/gpt-4", method="GET", status=404),
}


# Fields of the OpenAI and vLLM request schemas this server does not honour, and a typo.
UNHONOURED = ("guided_decoding_backend", "guided_whitespace_pattern", "use_beam_search",
              "length_penalty", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
              "store", "metadata", "service_tier", "modalities", "audio", "prediction", "web_search_options",
              "reasoning_effort", "functions", "function_call", "temprature")


def test_unhonoured_fields_get_a_400_naming_them(served):
    server, _ = served
    for path, base in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2})):
        for name in UNHONOURED:
            status, body = _post(server, path, {**base, name: {"type": "object"} if "json" in name else 1})
            assert status == 400 and body["error"]["param"] == name and name in body["error"]["message"], \
                (path, name, body)
        status, body = _post(server, path, {**base, "user": "someone"})  # accepted, ignored on purpose
        assert status == 200, body
    # min_p = 1 keeps only the likeliest token: sampling becomes greedy.
    greedy = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True})[1]
    cut = _post(server, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 1,
                                            "min_p": 1.0, "seed": 3, "ignore_eos": True})[1]
    assert cut["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(served):
    server, ref = served
    for name, case in MALFORMED.items():
        status, body = _post(server, case.get("path", "/v1/completions"), case.get("body"), raw=case.get("raw"),
                             method=case.get("method", "POST"))
        assert status == case.get("status", 400), (name, status, body)
        assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["message"], name
    with pytest.raises(openai.BadRequestError, match="context length"):
        _client(server).completions.create(model=MODEL, prompt=[5] * 200)
    r = _client(server).completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0)
    assert r.choices[0].token_ids == ref["text"][0].token_ids
    _wait_idle(server)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_huge_prompt_is_refused_off_the_event_loop_and_other_streams_finish(served, monkeypatch):
    """A 7 MB text prompt (under the body limit) is refused before it is tokenized, on the parser
    threads (never the event loop, which other streams need), while those streams run to their end;
    the memory comes back. Pacing is a benchmark's business (serve_bench), not this test's."""
    server, _ = served
    huge = json.dumps({"model": MODEL, "prompt": "lorem ipsum " * (7_000_000 // 12), "max_tokens": 4}).encode()
    stream_body = {"model": MODEL, "prompt": "Hello", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                   "stream": True}
    parsed_on: list[tuple[int, str]] = []
    parse_body = protocol.parse_body

    def spy(raw):
        parsed_on.append((len(raw), threading.current_thread().name))
        return parse_body(raw)

    monkeypatch.setattr(protocol, "parse_body", spy)

    async def read_stream(session):
        tokens = 0
        async with session.post(server.url + "/v1/completions", json=stream_body) as response:
            async for line in response.content:
                line = line.strip()
                if line.startswith(b"data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        return tokens

    async def main(huge_requests: int):
        statuses = []
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.ensure_future(read_stream(session)) for _ in range(4)]
            await asyncio.sleep(0.05)
            for _ in range(huge_requests):
                async with session.post(server.url + "/v1/completions", data=huge,
                                        headers={"Content-Type": "application/json"}) as r:
                    statuses.append((r.status, (await r.json())["error"]["param"]))
            return statuses, await asyncio.gather(*streams)

    _wait_idle(server)
    rss = _rss_bytes()
    statuses, streamed = asyncio.run(main(3))
    assert statuses == [(400, "prompt")] * 3
    assert streamed == [80] * 4
    huge_parses = [name for size, name in parsed_on if size == len(huge)]
    assert len(huge_parses) == 3 and all(name.startswith("cbjax-parse") for name in huge_parses), parsed_on
    _wait_idle(server)
    assert _rss_bytes() - rss < 50 << 20


def test_routes_tokenize_detokenize_version_and_model_card(served):
    server, _ = served
    assert _client(server).models.retrieve(MODEL).id == MODEL
    status, body = _post(server, "/tokenize", {"model": MODEL, "prompt": TEXT_PROMPTS[2]})
    ids = server.llm.tokenizer(TEXT_PROMPTS[2])["input_ids"]
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    status, body = _post(server, "/tokenize", {"model": MODEL, "messages": CHAT[1:]})
    assert status == 200 and body["tokens"] == chat_prompt_ids(server.llm.tokenizer, CHAT[1]["content"])
    status, body = _post(server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert status == 200 and body["prompt"] == server.llm.tokenizer.decode(ids)
    status, body = _post(server, "/version", None, method="GET")
    assert status == 200 and body["version"]


def test_api_key(model_dir):
    llm = LLM(model_dir, num_slots=2, max_seq_len=64)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with Server(llm, MODEL, port=0, api_key="sesame") as server:
        for headers in ({}, {"Authorization": "Bearer sesam"}, {"Authorization": "Bearer sesame-not"},
                        {"Authorization": "sesame"}):
            req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json", **headers})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            assert e.value.code == 401 and json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        assert len(client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].token_ids) == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert json.loads(urllib.request.urlopen(server.url + "/health").read()) == {"status": "ok"}


# ----------------------------------------------------- disconnects, limits
@pytest.fixture(scope="module")
def paged_server(model_dir):
    llm = LLM(model_dir, num_slots=4, max_seq_len=256, kv_cache="paged", page_size=8)
    with Server(llm, MODEL, port=0, max_pending=6, body_timeout_s=1.0) as server:
        yield server


def test_disconnects_free_slots_and_pages(paged_server, caplog, capfd):
    server = paged_server
    caplog.set_level(logging.INFO)
    pages = pages_of(server.llm)

    async def main():
        long = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            streams = []
            for _ in range(4):  # every slot busy, each stream read to its first token then dropped
                response = await session.post(server.url + "/v1/completions", json={**long, "stream": True})
                assert response.status == 200
                await response.content.readline()
                streams.append(response)
            # A fifth request queues behind them; its client gives up once it waits in the engine
            # (a fixed client timeout could expire before a loaded machine had even submitted it).
            queued = asyncio.ensure_future(session.post(server.url + "/v1/completions", json=long))
            # Both gauges in one reading: the engine thread sets them after it delivers a round's
            # tokens, so a loaded machine can show the fourth stream's token while the gauges still
            # say "3 running, 1 waiting" (that stream), and the fifth would be cancelled before it
            # was submitted (CI saw it: 4 aborts, 5 expected).
            deadline = time.monotonic() + 30
            while True:
                waiting = _metrics(server)
                if waiting.get("vllm:num_requests_running") == 4 and waiting.get("vllm:num_requests_waiting", 0) >= 1:
                    break
                assert time.monotonic() < deadline and not queued.done(), "the fifth request never queued"
                await asyncio.sleep(0.05)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            for response in streams:
                response.close()
            return waiting

    before = _metrics(server)
    during = asyncio.run(main())
    assert during["vllm:num_requests_running"] == 4
    after = _wait_idle(server)
    def finished(reason):
        key = f"vllm:request_success_total{{finished_reason={reason}}}"
        return after.get(key, 0) - before.get(key, 0)
    # A stream can reach max_tokens before its client drops it on a slow, loaded machine (CI saw one in
    # 345 tests): it then counts as "length". The queued request and at least one stream must be aborts.
    counts = {k: after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total")}
    assert finished("abort") + finished("length") == 5, counts
    assert finished("abort") >= 2
    assert pages.num_free == pages.num_pages
    assert server.pending == 0
    # A client going away is ordinary: an INFO line, never an error or a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    assert "Traceback" not in capfd.readouterr().err


def test_a_short_body_gets_408_and_its_connection_back(paged_server):
    """Fewer bytes than Content-Length says: the body read times out, the client gets OpenAI's
    error body, and the server goes on serving."""
    import socket

    server = paged_server
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        # No bound on how soon the 408 comes (no timing assertions): the socket's 30 s timeout
        # only keeps a server that never answers from hanging the suite.
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert _client(server).completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].token_ids


def test_queue_limit_gives_429(paged_server):
    server = paged_server
    client = _client(server, openai.AsyncOpenAI)

    async def one():
        try:
            await client.completions.create(model=MODEL, prompt="Hello", max_tokens=60, temperature=0,
                                            extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.response.headers.get("retry-after") == "1"
            return "429"

    async def main():
        try:
            return await asyncio.gather(*(one() for _ in range(10)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results.count("ok") == 6 and results.count("429") == 4
    _wait_idle(server)


# ------------------------------------------------------------ failures
def test_an_engine_failure_fails_requests_cleanly_and_health_says_so(model_dir):
    llm = LLM(model_dir, num_slots=2, max_seq_len=64)
    real_step, calls = llm.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device failure")
        return real_step()

    llm.step = failing_step
    with Server(llm, MODEL, port=0) as server:
        client = _client(server)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        status, body = _post(server, "/health", None, method="GET")
        assert status == 503 and "injected device failure" in body["error"]["message"]
        status, body = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello"})
        assert status == 503 and "internal error" in body["error"]["message"]
        assert server.pending == 0


@contextlib.contextmanager
def _cli_server(*args: str, ready: str = "cbjax serving"):
    """`python -m cbjax.serve` on tiny-llama with `args`: (an openai client, its startup lines)."""
    server = subprocess.Popen([sys.executable, "-m", "cbjax.serve", "--model=tiny-llama", "--port=0",
                               "--max_seq_len=64", "--num_slots=2", "--nowarmup", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url, lines = None, []
        for line in server.stdout:
            lines.append(line)
            if line.startswith(ready):
                url = line.split(" on ")[-1].strip()
                break
        assert url is not None, "the server never said where it listens: " + "".join(lines[-20:])
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120), lines
    finally:
        server.terminate()
        server.wait(60)


def test_cli_serves_and_refuses_bad_flags(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cbjax.serve", "--num_slots=0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "Flags parsing error" in proc.stderr and "num_slots" in proc.stderr
    with _cli_server() as (client, _):
        r = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert len(r.choices[0].token_ids) == 4 and r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="tokenizer"):  # tiny-llama has none
            client.completions.create(model="tiny-llama", prompt="text needs a tokenizer")


def test_cli_tensor_parallel_on_host_devices_answers_generates_tokens():
    """Every EngineArgs knob is a server flag: --tensor_parallel=2 over --host_devices=8 serves
    LLM.generate's greedy tokens, on an engine sharded over 2 devices."""
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    expected = LLM("tiny-llama", max_seq_len=64, num_slots=2).generate(prompts, _greedy(8, ignore_eos=True), use_tqdm=False)
    with _cli_server("--tensor_parallel=2", "--host_devices=8") as (client, lines):
        assert any("tensor_parallel=2 over 2 of 8 devices" in line for line in lines), "".join(lines)
        for prompt, want in zip(prompts, expected):
            r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].token_ids == want.token_ids


def test_cli_replicas_answer_generates_tokens():
    """--replicas=2: two engines behind the router, each answering LLM.generate's greedy tokens."""
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4, 4], [8, 1, 2, 3]]
    expected = LLM("tiny-llama", max_seq_len=64, num_slots=2).generate(prompts, _greedy(8, ignore_eos=True), use_tqdm=False)
    with _cli_server("--replicas=2", "--routing=round_robin", "--host_devices=2") as (client, lines):
        assert any("2 replicas (round_robin), tensor_parallel=1 over 2 of 2 devices" in line for line in lines), \
            "".join(lines)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model="tiny-llama", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}), prompts))
        for r, want in zip(answers, expected):
            assert r.choices[0].token_ids == want.token_ids
        metrics = urllib.request.urlopen(str(client.base_url).replace("/v1/", "/metrics"), timeout=30).read().decode()
        assert 'vllm:request_queue_time_seconds_count{model_name="tiny-llama"} 4.0' in metrics


def test_a_router_over_several_servers_answers_generates_tokens():
    """Serving across hosts, as several processes on this machine: two servers and a router in
    front (--backends); greedy tokens equal LLM.generate's, both backends take requests, bad
    requests keep their 400, and a backend that is gone is passed over."""
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [4, 4], [8, 1, 2, 3], [7, 7, 7], [3, 1]]
    expected = LLM("tiny-llama", max_seq_len=64, num_slots=2).generate(prompts, _greedy(8, ignore_eos=True),
                                                                       use_tqdm=False)
    with _cli_server() as (a, _), _cli_server() as (b, _):
        backends = ",".join(str(c.base_url).removesuffix("/v1/") for c in (a, b))
        with _cli_server(f"--backends={backends},http://127.0.0.1:9", ready="cbjax routing") as (client, _):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(lambda p: client.completions.create(
                    model="tiny-llama", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}),
                    prompts))
            assert [r.choices[0].token_ids for r in answers] == [e.token_ids for e in expected]
            streamed = [c.choices[0].token_ids for c in client.completions.create(
                model="tiny-llama", prompt=prompts[0], max_tokens=8, temperature=0, stream=True,
                extra_body={"ignore_eos": True})]
            assert sum(streamed, []) == expected[0].token_ids
            with pytest.raises(openai.BadRequestError, match="temprature"):
                client.completions.create(model="tiny-llama", prompt=[1], extra_body={"temprature": 1})
            root = str(client.base_url).removesuffix("/v1/")
            metrics = urllib.request.urlopen(root + "/metrics", timeout=30).read().decode()
            counts = [float(line.split()[-1]) for line in metrics.splitlines()
                      if line.startswith("cbjax_router_requests_total")]
            assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0, metrics
            health = json.loads(urllib.request.urlopen(root + "/health", timeout=30).read())
            assert health["healthy_backends"] == 2 and health["backends"] == 3


def _hf_log_softmax(model_dir, ids):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()


def test_logprobs_through_the_openai_client(served, model_dir):
    """Greedy logprobs equal transformers' log-softmax of the same logits (the first token's,
    whose logits need no earlier sample), streamed and not; top_logprobs ordered."""
    server, ref = served
    client = _client(server)
    prompt_ids = ref["text"][0].prompt_token_ids
    expected = _hf_log_softmax(model_dir, prompt_ids)
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=4)
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == ref["text"][0].token_ids and len(lp.token_logprobs) == MAX_TOKENS
    assert abs(lp.token_logprobs[0] - expected[ref["text"][0].token_ids[0]]) < 1e-4
    # Completions key top_logprobs by token text: byte-level fragments that decode alike ("\ufffd")
    # share a key, as in OpenAI's and vLLM's format. Chat's lists (below) carry every one, in order.
    top4 = np.sort(expected)[::-1][:4]
    assert all(np.abs(top4 - v).min() < 1e-4 for v in lp.top_logprobs[0].values())
    streamed = []
    for event in client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=2, stream=True):
        if event.choices and event.choices[0].logprobs:
            streamed += event.choices[0].logprobs.token_logprobs
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-5)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == len(chat.choices[0].token_ids)
    chat_ids = ref["chat"].prompt_token_ids
    assert abs(content[0].logprob - _hf_log_softmax(model_dir, chat_ids)[ref["chat"].token_ids[0]]) < 1e-4
    assert all([t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
               and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    np.testing.assert_allclose(streamed, [e.logprob for e in content], atol=1e-5)
    _wait_idle(server)


def _hf_prompt_log_softmax(model_dir, ids):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].double(), -1).numpy()
    return logp[np.arange(len(ids) - 1), ids[1:]], logp


def test_prompt_logprobs_and_echo_with_logprobs(served, model_dir):
    """Each prompt token's log-probability equals transformers' log-softmax at the position
    before it: as vLLM's prompt_logprobs (with ranks) and as the completions API's echo +
    logprobs (the prompt's tokens first, the first one null)."""
    server, ref = served
    client = _client(server)
    ids = ref["text"][1].prompt_token_ids
    chosen, logp = _hf_prompt_log_softmax(model_dir, ids)
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(TEXT_PROMPTS[1]) and lp.token_logprobs[0] is None
    assert len(lp.token_logprobs) == len(ids) + 4 and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], chosen, atol=1e-4)
    assert r.choices[0].token_ids == ref["text"][1].token_ids[:4]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    chat_ids = ref["chat"].prompt_token_ids
    chat_chosen, chat_logp = _hf_prompt_log_softmax(model_dir, chat_ids)
    positions = r.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(chat_ids)
    for i, (token, entry) in enumerate(zip(chat_ids[1:], positions[1:])):
        mine = entry[str(token)]
        assert abs(mine["logprob"] - chat_chosen[i]) < 1e-4
        assert mine["rank"] == 1 + int((chat_logp[i] > chat_chosen[i] + 1e-6).sum())
        best = sorted(((v["rank"], int(t)) for t, v in entry.items() if v["rank"] <= 3))
        assert best[0][0] == 1 and int(np.argmax(chat_logp[i])) in [t for _, t in best]
    with pytest.raises(openai.BadRequestError, match="streaming"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_n_best_of_penalties_and_echo_through_the_client(served):
    server, ref = served
    client = _client(server)
    r = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[:2], max_tokens=6, temperature=0.9, seed=4, n=3)
    assert sorted(c.index for c in r.choices) == list(range(6))
    single = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[1], max_tokens=6, temperature=0.9, seed=5)
    assert r.choices[4].token_ids == single.choices[0].token_ids  # prompt 1, sample 1: seed 4 + 1
    best = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=6, temperature=1.0, seed=2,
                                     n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    echoed = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == TEXT_PROMPTS[0] + ref["text"][0].text
    biased = client.completions.create(model=MODEL, prompt=TEXT_PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={"65": 100})
    assert biased.choices[0].token_ids == [65] * 4
    penalized = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                               presence_penalty=1.0, frequency_penalty=1.0,
                                               extra_body={"repetition_penalty": 1.3, "min_tokens": 20})
    assert len(penalized.choices[0].token_ids) == 20
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=9, n=2,
                                          stream=True)
    by_choice: dict[int, list] = {}
    for c in chat:
        for choice in c.choices:
            by_choice.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(by_choice) == [0, 1] and all(v[-1] in ("stop", "length") for v in by_choice.values())
    _wait_idle(server)
