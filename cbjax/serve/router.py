"""Serving across hosts: a router in front of several `python -m cbjax.serve` processes.

    host A:  python -m cbjax.serve --host=0.0.0.0 --port=8000 [--replicas=N ...]
    host B:  python -m cbjax.serve --host=0.0.0.0 --port=8000 [--replicas=N ...]
    front:   python -m cbjax.serve --backends=http://A:8000,http://B:8000 --port=8000

Each backend is a whole server (its own engines on its own devices); the router holds no
model. It forwards each generation request's body unchanged to one backend, the one with the
fewest requests the router has in flight there (ties in turn), and streams the backend's
answer back as it arrives, so SSE streams, status codes and OpenAI error bodies pass through
untouched. A client that goes away closes the backend connection, which aborts the request
there. A backend that cannot be reached gets the request sent to the next one; when none
answers, the client gets a 502. `/health` is 200 while any backend is healthy; `/v1/models`
and `/version` come from the first healthy one; `/metrics` counts the router's own routing.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from cbjax.serve.errors import APIError
from cbjax.serve.info_routes import json_response

FORWARDED_HEADERS = ("Content-Type", "Authorization")
RETURNED_HEADERS = ("Content-Type", "Cache-Control", "Retry-After")


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return json_response(e.body(), e.status)


class Router:
    def __init__(self, backends: list[str], host: str = "127.0.0.1", port: int = 8000):
        if not backends:
            raise ValueError("the router needs at least one backend URL")
        self.backends = [b.rstrip("/") for b in backends]
        self.host, self.port = host, port
        self.in_flight = [0] * len(self.backends)
        self.routed = [0] * len(self.backends)
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json], client_max_size=8 << 20)
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            app.router.add_post(path, self.forward)
        for path in ("/v1/models", "/v1/models/{name}", "/version"):
            app.router.add_get(path, self.forward_first_healthy)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    def order(self) -> list[int]:
        """Backends to try, best first: fewest in flight from here, ties in turn."""
        n = len(self.backends)
        self._turn = (self._turn + 1) % n
        return sorted(range(n), key=lambda i: (self.in_flight[i], (i - self._turn) % n))

    async def _send(self, request: web.Request, i: int, body: bytes) -> web.StreamResponse:
        headers = {k: request.headers[k] for k in FORWARDED_HEADERS if k in request.headers}
        async with self._session.request(request.method, self.backends[i] + request.path_qs, data=body,
                                         headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: upstream.headers[k] for k in RETURNED_HEADERS if k in upstream.headers})
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except aiohttp.ClientError:  # the backend dropped mid-answer: the client sees the answer end
                return response
            await response.write_eof()
            return response

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        last = None
        for i in self.order():
            self.in_flight[i] += 1
            try:
                response = await self._send(request, i, body)
                self.routed[i] += 1
                return response
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if request.transport is None or request.transport.is_closing():
                    raise ConnectionResetError("the client went away") from e
                last = e  # not reached (or it dropped us before answering): the next backend
            finally:
                self.in_flight[i] -= 1
        raise APIError(502, f"no backend answered: {last}")

    async def _healthy(self) -> list[int]:
        async def ok(i: int) -> bool:
            try:
                async with self._session.get(self.backends[i] + "/health",
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False

        flags = await asyncio.gather(*(ok(i) for i in range(len(self.backends))))
        return [i for i, good in enumerate(flags) if good]

    async def health(self, request: web.Request) -> web.Response:
        healthy = await self._healthy()
        if not healthy:
            return json_response(APIError(503, "no backend is healthy").body(), 503)
        return json_response({"status": "ok", "healthy_backends": len(healthy), "backends": len(self.backends)})

    async def forward_first_healthy(self, request: web.Request) -> web.StreamResponse:
        healthy = await self._healthy()
        if not healthy:
            return json_response(APIError(503, "no backend is healthy").body(), 503)
        return await self._send(request, healthy[0], b"")

    async def metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP cbjax_router_requests_total Requests the router sent to each backend.",
                 "# TYPE cbjax_router_requests_total counter"]
        lines += [f'cbjax_router_requests_total{{backend="{b}"}} {n}' for b, n in zip(self.backends, self.routed)]
        lines += ["# HELP cbjax_router_in_flight Requests in flight at each backend, from the router.",
                  "# TYPE cbjax_router_in_flight gauge"]
        lines += [f'cbjax_router_in_flight{{backend="{b}"}} {n}' for b, n in zip(self.backends, self.in_flight)]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def serve(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        runner = web.AppRunner(self.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port).start()
        self.port = runner.addresses[0][1]
        print(f"cbjax routing over {len(self.backends)} backends on http://{self.host}:{self.port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            await self._session.close()

    def run(self) -> None:
        try:
            asyncio.run(self.serve())
        except KeyboardInterrupt:
            pass
