"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` ({"lora_name", "lora_path"}) and
`POST /v1/unload_lora_adapter` ({"lora_name"}). The load runs on the engine thread between two
rounds (`EngineLoop.call`); once it succeeds, `model` may name the adapter. A refusal is an
OpenAI error body naming the adapter; nothing else is touched."""

from __future__ import annotations

import asyncio

from aiohttp import web

from cbjax.serve.errors import APIError, bad
from cbjax.serve.protocol import get_field, require_object


class LoraRoutes:
    def __init__(self, server):
        self.server = server

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def _body(self, request: web.Request, keys: tuple) -> dict:
        def parse(body):
            body = require_object(body)
            for key in body:
                if key not in keys:
                    raise bad(f"'{key}' is not a field of this route ({', '.join(keys)})", key)
            return {key: get_field(body, key, (str,), allow_none=False) for key in keys}

        return await self.server.off_loop(request, parse)

    async def _on_engine(self, fn) -> None:
        try:
            await asyncio.wrap_future(self.server.engine.call(fn))
        except ValueError as e:
            status = 404 if "is not loaded" in str(e) else 400
            raise APIError(status, str(e), "lora_name",
                           code="lora_not_found" if status == 404 else "lora_refused") from None
        except RuntimeError as e:
            raise APIError(503, str(e)) from None

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request, ("lora_name", "lora_path"))
        name = body["lora_name"]
        if name == self.server.model_name:
            raise bad(f"'{name}' is the base model's name", "lora_name")
        await self._on_engine(lambda llm: llm.load_lora(name, body["lora_path"]))
        self.server.adapters.append(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await self._body(request, ("lora_name",)))["lora_name"]
        await self._on_engine(lambda llm: llm.unload_lora(name))
        self.server.adapters.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
