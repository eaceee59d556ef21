"""The server under abuse: the kinds of cases an outside tester found (issue 52), on inputs of
our own. Every request here must be answered (an error naming its parameter, a refusal, a
429/503, or a valid answer) within 30 s; the server keeps serving afterwards.

Stream gaps beside adversarial requests are measured by experiments/benchmarks/serve_abuse.py, not here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
import urllib.error
import urllib.request

import pytest

from cbjax import LLM, SamplingParams
from cbjax import grammar as grammar_module
from cbjax.request import StructuredOutput
from cbjax.runtime.compiled.warmup import warm_structured_output
from cbjax.serve import Server
from tests.hf_models import save_chat_model
from tests.tiers import slow
from tests.internals import engine_of

MODEL = "tiny-chat"
ANSWER_WITHIN_S = 30
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_chat_model(str(tmp_path_factory.mktemp("abuse_model")))


@pytest.fixture(scope="module")
def server(model_dir):
    llm = LLM(model_dir, num_slots=8, max_seq_len=128, kv_cache="paged", page_size=8, merge_mode="chunked")
    with Server(llm, MODEL, port=0, max_pending=16, max_pending_tokens=4096, max_logprob_entries=2000,
                max_connections=24, header_timeout_s=2.0, idle_timeout_s=2.0) as s:
        yield s


def post(server, body, path="/v1/completions") -> tuple[int, dict, dict]:
    """(status, body, headers); fails the test if no answer comes within ANSWER_WITHIN_S."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=ANSWER_WITHIN_S) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 8, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0, **fields}


def assert_refused(reply, param: str, status: int = 400):
    code, body, _ = reply
    assert code == status and body["error"]["param"] == param, (param, code, body)


def assert_serving(server):
    code, body, _ = post(server, completion())
    assert code == 200 and body["choices"][0]["token_ids"], body


# -------------------------------------------------------- 1. the hang
@pytest.mark.parametrize("fields", [{"guided_regex": ""}, {"structured_outputs": {"regex": ""}}])
def test_an_empty_regex_is_answered(server, fields):
    code, body, _ = post(server, completion(**fields))
    assert code == 200 and body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "stop", body


def test_an_empty_structured_output_is_refused(server):
    assert_refused(post(server, completion(structured_outputs={})), "structured_outputs")
    assert_refused(post(server, completion(guided_json="")), "guided_json")


# -------------------------------------------------------- 2. the 500s
DEEP = "[" * 2000 + "]" * 2000


@pytest.mark.parametrize("fields,param", [
    ({"guided_json": DEEP}, "guided_json"),
    ({"guided_json": '{"type": "array", "items": ' * 100 + "{}" + "}" * 100}, "guided_json"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        '{"type": "array", "items": ' * 100 + "{}" + "}" * 100)}}}, "response_format.json_schema.schema"),
])
def test_deeply_nested_schemas_get_a_400(server, fields, param):
    code, body, _ = post(server, completion(**fields))
    assert code == 400 and body["error"]["param"].startswith(param), body


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("choice,param", [
    ({"type": "function", "function": "f"}, "tool_choice.function"),
    ([{"type": "function", "function": {"name": "f"}}], "tool_choice"),
    ({"type": "tool", "function": {"name": "f"}}, "tool_choice.type"),
    ({"type": "function", "function": {"name": "g"}}, "tool_choice.function.name"),
    ({"type": "function", "function": {"name": "f", "bogus": 1}}, "tool_choice.function.bogus"),
])
def test_malformed_tool_choice_gets_a_400(server, choice, param):
    assert_refused(post(server, chat(tools=TOOLS, tool_choice=choice), "/v1/chat/completions"), param)


# ----------------------------------------- 3. a constraint that cannot be honoured
def test_a_regex_that_explodes_is_refused_before_generation(server):
    start = time.monotonic()
    reply = post(server, completion(guided_regex="(a{100}){100}{100}"))
    assert_refused(reply, "guided_regex")
    assert "structured output" in reply[1]["error"]["message"]
    assert time.monotonic() - start < ANSWER_WITHIN_S
    assert_serving(server)


def test_a_matcher_failing_mid_generation_ends_with_an_error(server, model_dir, monkeypatch):
    """The probe skipped (as if the regex only exploded past its first tokens): the answer is an
    error naming the field, never a 200 cut short at the failure, in a stream and out of one."""
    monkeypatch.setattr(grammar_module, "PROBE_TOKENS", 0)
    code, body, _ = post(server, completion(guided_regex="(a{100}){100}{100}b", max_tokens=20))
    assert code == 400 and body["error"]["param"] == "guided_regex", body
    assert body["error"]["code"] == "structured_output_failed"
    req = urllib.request.Request(server.url + "/v1/completions", method="POST",
                                 data=json.dumps(completion(guided_regex="(a{100}){100}{100}c", max_tokens=20,
                                                            stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=ANSWER_WITHIN_S) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "guided_regex", events[-1]
    assert not any(c.get("finish_reason") == "stop" for e in events for c in e.get("choices", []))


def test_the_engine_ends_a_failed_constraint_with_an_error(model_dir, monkeypatch):
    monkeypatch.setattr(grammar_module, "PROBE_TOKENS", 0)
    llm = LLM(model_dir, num_slots=2, max_seq_len=64)
    bad = SamplingParams(max_tokens=20, structured=StructuredOutput(regex="(a{100}){100}{100}d"))
    fine = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out_bad, out_fine = llm.generate(["Hello", "Hello"], [bad, fine], use_tqdm=False)
    assert out_bad.finish_reason == "error" and "structured output" in out_bad.error, out_bad
    assert out_fine.finish_reason == "length" and len(out_fine.token_ids) == 6
    assert not llm.has_unfinished_requests()


# --------------------------------------------- 4. an answer that breaks its schema
@pytest.mark.parametrize("schema,param", [
    ({"type": "integer", "minimum": 1e38, "maximum": 1e38}, "response_format.json_schema.schema.minimum"),
    ({"type": "object", "properties": {"x": {"type": ["integer", "null"], "exclusiveMaximum": -1e30}}},
     "response_format.json_schema.schema.properties.x.exclusiveMaximum"),
])
def test_integer_bounds_past_64_bits_are_refused(server, schema, param):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert_refused(post(server, completion(response_format=fmt)), param)


def test_an_integer_schema_answer_keeps_its_bounds(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 10,
                                                                          "maximum": 99}}}
    code, body, _ = post(server, completion(response_format=fmt, max_tokens=6, ignore_eos=False))
    assert code == 200, body
    choice = body["choices"][0]
    if choice["finish_reason"] == "stop":
        assert 10 <= int(choice["text"]) <= 99, choice


# ------------------------------------------------ 6. admission counts samples
def test_admission_counts_prompts_times_samples(server):
    assert_refused(post(server, completion(prompt=["a", "b", "c", "d", "e"], n=4)), "n")  # 20 > 16
    assert_refused(post(server, completion(prompt=["a", "b"], n=2, best_of=9)), "best_of")  # 18 > 16
    code, body, _ = post(server, completion(prompt=["a", "b"], n=8))  # 16: fits an empty server
    assert code == 200 and len(body["choices"]) == 16, body

    async def busy_then_one():
        loop = asyncio.get_running_loop()
        big = loop.run_in_executor(None, post, server, completion(prompt=["a", "b"], n=8, max_tokens=100,
                                                                  ignore_eos=True))
        while server.pending < 16:
            await asyncio.sleep(0.01)
        small = await loop.run_in_executor(None, post, server, completion())
        return await big, small

    big, small = asyncio.run(busy_then_one())
    assert big[0] == 200 and small[0] == 429 and small[2].get("Retry-After") == "1", (big[0], small)


def test_prompt_tokens_and_prompt_logprobs_are_bounded(server):
    assert_refused(post(server, completion(prompt=[[5] * 100] * 50)), "prompt")  # 5,000 > 4,096 tokens
    assert_refused(post(server, completion(prompt=[[5] * 100] * 4, prompt_logprobs=5)), "prompt_logprobs")
    assert_refused(post(server, completion(prompt=[[5] * 100] * 4, logprobs=5, echo=True)), "echo")
    code, body, _ = post(server, completion(prompt=[[5] * 100], prompt_logprobs=5, max_tokens=1))
    assert code == 200 and len(body["choices"][0]["prompt_logprobs"]) == 100, body


# --------------------------------------------------- 7. connection limits
def _connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=ANSWER_WITHIN_S)


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


def test_slow_headers_and_idle_connections_are_closed(server):
    slow = _connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    start = time.monotonic()
    assert _read_until_closed(slow) == b"" and time.monotonic() - start < server.guard.header_timeout_s + 5
    idle = _connect(server)  # a keep-alive connection after one request
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    start = time.monotonic()
    assert _read_until_closed(idle).startswith(b"HTTP/1.1 200")
    assert time.monotonic() - start < server.idle_timeout_s + 5


def test_connections_past_the_cap_get_503_and_one_log_line(server, caplog):
    caplog.set_level(logging.WARNING, logger="cbjax.serve")
    held = [_connect(server) for _ in range(server.guard.max_connections)]
    try:
        deadline = time.monotonic() + 10
        while server.guard.open < server.guard.max_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = [_connect(server) for _ in range(20)]
        replies = [_read_until_closed(s) for s in refused]
        for s in refused:
            s.close()
    finally:
        for s in held:
            s.close()
    assert all(r.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in r for r in replies), replies[0]
    assert sum("refused connections" in r.message for r in caplog.records) == 1
    deadline = time.monotonic() + 10
    while server.guard.open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_serving(server)


# ---------------------------------------------------- 8. the right param
@pytest.mark.parametrize("fields,param", [
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": 1025}, "logprobs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"top_k": -5}, "top_k"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_errors_name_their_parameter(server, fields, param):
    assert_refused(post(server, completion(**fields)), param)


def test_chat_errors_name_their_parameter(server):
    path = "/v1/chat/completions"
    assert_refused(post(server, chat(logprobs=True, top_logprobs=21), path), "top_logprobs")
    assert_refused(post(server, chat(messages=[USER[0], {"role": "user", "content": 5}]), path),
                   "messages[1].content")
    assert_refused(post(server, chat(messages=[{"role": "wizard", "content": "hi"}]), path), "messages[0].role")


# ------------------------------------------------ 9. strict at every level
@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
     "stream_options.bogus"),
    ("/v1/completions", {"response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}},
     "response_format.json_schema.bogus"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "messages[0].bogus"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                          "bogus": 1}]}]},
     "messages[0].content[0].bogus"),
    ("/v1/chat/completions", {"tools": [{**TOOLS[0], "bogus": 1}]}, "tools[0].bogus"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]},
     "tools[0].function.bogus"),
    ("/v1/chat/completions", {"messages": [USER[0], {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}", "bogus": 1}}]}]},
     "messages[1].tool_calls[0].function.bogus"),
])
def test_unknown_nested_fields_get_a_400_naming_their_path(server, path, fields, param):
    base = chat() if path.endswith("chat/completions") else completion()
    reply = post(server, {**base, **fields}, path)
    assert_refused(reply, param)
    assert re.search(re.escape(param.rsplit(".", 1)[-1]), reply[1]["error"]["message"])


def test_the_server_is_idle_and_serving_after_the_abuse(server):
    deadline = time.monotonic() + ANSWER_WITHIN_S
    while server.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.pending == 0 and server.admission.prompt_tokens == 0
    assert_serving(server)


# ----------------------------------------- 5. nothing compiles mid-stream
@slow
def test_warmed_structured_output_programs_leave_nothing_to_compile(model_dir):
    """The CLI's warm-up covers what a constrained request runs: its first one compiles
    nothing on the engine thread (a compile there stalls every stream for seconds)."""
    llm = LLM(model_dir, num_slots=4, max_seq_len=64, merge_mode="chunked")
    llm.warmup()
    assert warm_structured_output(engine_of(llm)) > 0
    before = engine_of(llm).num_compilations()
    outs = llm.generate(["Hello", "Hi there", "A"], [
        SamplingParams(max_tokens=6, structured=StructuredOutput(regex="[a-z]{2,5}")),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, structured=StructuredOutput(choice=("yes", "no")))], use_tqdm=False)
    assert re.fullmatch("[a-z]{2,5}", outs[0].text) and outs[2].text in ("yes", "no"), outs
    assert engine_of(llm).num_compilations() == before


def test_structured_output_programs_compiled_in_the_background_serve_the_same(model_dir):
    """The server's default: the masked programs compile on a background thread (start-up does
    not wait); a constrained request that comes before they are ready waits for its own program,
    which is compiled once, and its output is what the warmed engine gives."""
    sampling = [SamplingParams(max_tokens=6, structured=StructuredOutput(regex="[a-z]{2,5}")),
                SamplingParams(max_tokens=6, structured=StructuredOutput(choice=("yes", "no")))]
    warmed = LLM(model_dir, num_slots=4, max_seq_len=64)
    warmed.warmup()
    warm_structured_output(engine_of(warmed))
    expected = [o.token_ids for o in warmed.generate(["Hello", "A"], sampling, use_tqdm=False)]
    llm = LLM(model_dir, num_slots=4, max_seq_len=64)
    llm.warmup()
    programs = len(engine_of(llm).compiled.keys())
    assert warm_structured_output(engine_of(llm), background=True) > 0
    outs = llm.generate(["Hello", "A"], sampling, use_tqdm=False)  # may come before the compiles end
    assert llm.wait_for_compiles() == warm_structured_output(engine_of(llm), background=True)
    assert [o.token_ids for o in outs] == expected
    masked = [k for k in engine_of(llm).compiled.keys() if len(k[0]) == 4]  # flat, ints, floats, masks
    assert len(masked) == len(engine_of(llm).compiled.keys()) - programs == len(
        [p for p in engine_of(llm).programs() if p[2] == 1])
