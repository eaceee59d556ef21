"""Structured output (cbjax/grammar.py) and function calling (cbjax/serve/tools.py).

A tiny random model emits gibberish, so whatever valid structure comes out is the grammar's
doing: every constrained answer must parse and match its schema, and the unconstrained
requests beside them must keep the greedy tokens they have with no grammar traffic at all.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import jsonschema
import openai
import pytest

from cbjax import LLM, SamplingParams, StructuredOutput
from cbjax import grammar as grammar_module
from cbjax.serve import Server
from cbjax.serve.tools import Tools, parse_output
from cbjax.workload import random_json_schema
from tests.hf_models import save_chat_model
from tests.tiers import slow

MODEL = "tiny-chat"
USER = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A byte-level tokenizer spends a token per character: the tools' system prompt is ~850.
    return save_chat_model(str(tmp_path_factory.mktemp("chat_model")), max_position_embeddings=1024)


def _plain(max_tokens=12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("engine", [dict(decode_steps=4), dict(kv_cache="paged", page_size=8, merge_mode="chunked",
                                                                  max_num_batched_tokens=16)])
def test_constrained_rows_match_and_their_neighbours_keep_their_tokens(model_dir, engine):
    """Constrained and free requests in one batch, prefill_first with multi-step decodes and
    run-ahead (the default overlap), and chunked prefill over pages."""
    llm = LLM(model_dir, num_slots=4, max_seq_len=256, **engine)
    prompts = ["hello there", "the cat sat", "a b c d", "tell me more", "one", "two three"]
    alone = llm.generate(prompts, _plain(), use_tqdm=False)
    schema = random_json_schema(random.Random(1))
    constraints = [StructuredOutput(json=schema), None, StructuredOutput(choice=("yes", "no way")), None,
                   StructuredOutput(regex=r"[a-c]{2,4}-\d{2}"), None]
    mixed = llm.generate(prompts, [_plain() if c is None else SamplingParams(max_tokens=120, structured=c)
                                   for c in constraints], use_tqdm=False)
    for c, out, ref in zip(constraints, mixed, alone):
        if c is None:
            assert out.token_ids == ref.token_ids
        else:
            assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(mixed[0].text), schema)
    assert mixed[2].text in ("yes", "no way")
    assert mixed[4].text[:-3].strip("abc") == "" and mixed[4].text[-3] == "-" and mixed[4].text[-2:].isdigit()
    # n > 1: each sample follows its own matcher.
    out = llm.generate(["pick"], SamplingParams(max_tokens=20, n=3, temperature=1.0, seed=5,
                                                structured=StructuredOutput(choice=("alpha", "beta", "gamma"))),
                       use_tqdm=False)[0]
    assert all(s.text in ("alpha", "beta", "gamma") for s in out.samples)


def test_a_grammar_llguidance_refuses_is_a_clear_error(model_dir):
    llm = LLM(model_dir, num_slots=2, max_seq_len=64)
    for bad in (dict(json="{not json"), dict(regex="(unclosed"), dict(grammar="start: undefined_rule")):
        with pytest.raises(ValueError, match="structured output"):
            llm.add_request("hi", SamplingParams(structured=StructuredOutput(**bad)))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    assert not llm.has_unfinished_requests()


# ------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def served(model_dir):
    llm = LLM(model_dir, num_slots=8, max_seq_len=1024)
    prompts = [[1 + (5 * i + 3 * j) % 250 for j in range(4 + i % 5)] for i in range(8)]
    ref = llm.generate(prompts, _plain(16), use_tqdm=False)
    llm.warmup()
    # The constraint probe's wall-clock budget (0.5 s) guards the server against costly grammars
    # (test_serve_abuse); here 32 streams and a parallel test worker share 2 cores, where it
    # refused an ordinary schema once: these tests are about what the constraints produce.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar_module, "PROBE_BUDGET_S", 60.0)
        with Server(llm, MODEL, port=0) as server:
            yield server, prompts, ref


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def _streamed_chat(client, **kw) -> tuple[str, str]:
    text, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, stream=True, temperature=0, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


@slow
def test_random_json_schemas_over_32_concurrent_streams_all_validate(served):
    server, prompts, ref = served
    client = _client(server)
    schemas = [random_json_schema(random.Random(seed)) for seed in range(24)]

    def constrained(schema):
        return _streamed_chat(client, max_tokens=200, response_format={
            "type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})

    def plain(i):
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = [pool.submit(constrained, s) for s in schemas]
        plains = [pool.submit(plain, i) for i in range(len(prompts))]
        for schema, future in zip(schemas, answers):
            text, reason = future.result()
            assert reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
        for r, expected in zip(plains, ref):
            assert r.result().choices[0].token_ids == expected.token_ids


def test_guided_fields_and_json_object(served):
    server, _, _ = served
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[A-Z]{3}\d"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:3].isupper()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client.completions.create(model=MODEL, prompt="N:", max_tokens=30, temperature=0,
                                  extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.completions.create(model=MODEL, prompt="G:", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'root ::= "ab" | "cd"'})  # GBNF, as for vLLM
    assert r.choices[0].text in ("ab", "cd")


@pytest.mark.parametrize("field,value", [
    ("guided_regex", "(unclosed"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}),
    ("response_format", {"type": "xml"}),
    ("guided_choice", []),
    ("guided_json", "{not json"),
    ("structured_outputs", {"yaml": "a: b"}),
])
def test_a_bad_constraint_is_a_400_naming_its_field(served, field, value):
    server, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={field: value})
    param = e.value.body["param"]  # the field, or the JSON path of its bad part
    assert param == field or param.startswith(field + "."), e.value.body


def test_a_refused_grammar_names_the_field_that_set_it_beside_a_text_response_format(served):
    server, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={
            "response_format": {"type": "text"}, "structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs", e.value.body


def test_two_constraints_at_once_are_refused(served):
    server, _, _ = served
    with pytest.raises(openai.BadRequestError, match="at most one"):
        _client(server).completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={"guided_regex": "a", "guided_choice": ["b"]})


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"],
        "additionalProperties": False}}}]


def test_tool_call_round_trip_with_the_openai_client(served):
    server, _, _ = served
    client = _client(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, max_tokens=64,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER[0]["function"]["parameters"])
    # The call and its result go back; under "auto" the model answers (or calls again).
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, tool_choice="auto",
                                           max_tokens=16, temperature=0)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    # "required": at least one call, each to a listed function with arguments that match it.
    required = client.chat.completions.create(model=MODEL, messages=messages[:1], tools=WEATHER, max_tokens=150,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    spec = {f["function"]["name"]: f["function"]["parameters"] for f in WEATHER}
    jsonschema.validate(json.loads(calls[0].function.arguments), spec[calls[0].function.name])
    # Streamed, the call arrives whole in one delta.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=WEATHER, max_tokens=64, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    streamed = [t for c in chunks for ch in c.choices for t in (ch.delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.arguments == call.function.arguments


def test_auto_tool_calls_are_parsed_from_hermes_blocks():
    tools = Tools(tuple(f["function"] for f in WEATHER), "auto")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n' \
           '</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
    content, calls = parse_output(tools, text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert content.startswith("Let me check.") and "get_weather" not in content
    assert parse_output(tools, "just text") == ("just text", [])


def test_a_template_that_handles_tools_gets_them_as_transformers_passes_them(model_dir):
    """A chat template that names tools renders the tools and the calls itself: the arguments of
    a call sent back reach it as an object (not JSON text to be encoded twice)."""
    import transformers

    from cbjax.serve import protocol

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "<tool_call>{{ c.function.arguments.city }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "c"})}}
    body = {"model": MODEL, "max_tokens": 4, "tools": WEATHER, "messages": [
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]}
    job = protocol.parse_chat(body, MODEL, tokenizer, 1024)
    text = tokenizer.decode(job.prompts[0])
    assert "get_weather;get_time;" in text and "<tool_call>Oslo</tool_call>" in text and "tool\n21" in text
    assert job.tools.choice == "auto" and job.sampling.structured is None
