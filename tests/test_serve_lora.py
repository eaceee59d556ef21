"""LoRA adapters through the OpenAI-compatible server, driven by the official `openai` client:
`model` picks the base model or an adapter, two adapters and the base stream side by side,
adapters load and unload at run time (vLLM's routes), and refusals name the adapter."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from cbjax import LLM, SamplingParams
from cbjax.serve import Server
from tests.hf_models import save_chat_model
from tests.lora_adapters import family_adapters, make_adapter
from tests.test_serve import _metrics, _post

BASE = "tiny-chat"
PROMPTS = ["Hello, world!", "Continuous batching", "The lazy dog", "Adapters side by side"]
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def _post_text(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_two_adapters_and_the_base_stream_side_by_side_and_load_at_run_time(tmp_path):
    model_dir = save_chat_model(str(tmp_path / "chat"))
    _, _, adapters = family_adapters("llama", 2)
    llm = LLM(model_dir, enable_lora=True, num_slots=8, max_seq_len=96, max_loras=2, max_lora_rank=8,
              lora_modules=f"first={adapters[0][0]}")
    llm.load_lora("second", adapters[1][0])
    expected = {name: llm.generate(PROMPTS, GREEDY, lora=None if name == BASE else name, use_tqdm=False)
                for name in (BASE, "first", "second")}
    assert expected["first"][0].token_ids != expected[BASE][0].token_ids
    llm.unload_lora("second")  # the server loads it again through its route
    llm.warmup()
    with Server(llm, BASE, port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [BASE, "first"]
        with pytest.raises(openai.NotFoundError, match="'second' does not exist"):
            client.completions.create(model="second", prompt=PROMPTS[0], max_tokens=4)

        status, text = _post_text(server, "/v1/load_lora_adapter", {"lora_name": "second",
                                                                      "lora_path": adapters[1][0]})
        assert (status, text) == (200, "Success: LoRA adapter 'second' added successfully.")
        assert [m.id for m in client.models.list().data] == [BASE, "first", "second"]
        assert client.models.retrieve("second").id == "second"

        streams = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(model, prompt):
            stream = await streams.completions.create(model=model, prompt=prompt, max_tokens=GREEDY.max_tokens,
                                                      temperature=0, stream=True)
            ids = []
            async for chunk in stream:
                ids += chunk.choices[0].token_ids
            return ids

        async def main():
            try:
                jobs = [(m, i) for i in range(len(PROMPTS)) for m in (BASE, "first", "second")]
                got = await asyncio.gather(*(one(m, PROMPTS[i]) for m, i in jobs))
                return dict(zip(jobs, got))
            finally:
                await streams.close()

        for (model, i), ids in asyncio.run(main()).items():
            assert ids == expected[model][i].token_ids, (model, i)
        metrics = _metrics(server)
        assert metrics["cbjax:lora_loads"] >= 2 and metrics["cbjax:lora_hits"] >= 1

        # Refusals name the adapter; the server goes on serving.
        small = str(tmp_path / "rank16")
        make_adapter("llama", 5, small, ["q_proj"], rank=16)
        status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": small})
        assert status == 400 and "LoRA adapter 'big'" in body["error"]["message"] and "max_lora_rank" in \
            body["error"]["message"]
        status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(tmp_path)})
        assert status == 400 and "LoRA adapter 'gone'" in body["error"]["message"]
        status, body = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never"})
        assert status == 404 and body["error"]["code"] == "lora_not_found"
        status, body = _post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and body["error"]["param"] == "lora_path"

        status, text = _post_text(server, "/v1/unload_lora_adapter", {"lora_name": "first"})
        assert status == 200
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert err.value.body["code"] == "model_not_found"
        r = client.completions.create(model="second", prompt=PROMPTS[0], max_tokens=GREEDY.max_tokens, temperature=0)
        assert r.choices[0].token_ids == expected["second"][0].token_ids
        assert r.model == "second"
