"""Connection limits in front of aiohttp: a cap on open connections, a deadline for a request's
headers, and one log line per burst of trouble rather than one per socket.

A client that opens sockets and never finishes a request costs a file descriptor each: tens
of thousands of them exhaust the process's descriptors, after which every accept fails (and
asyncio logs a traceback per failure). So each accepted connection goes through a
`ConnectionGuard` before aiohttp sees it: past `max_connections` it gets a 503 with Retry-After
and is closed at once; one whose headers have not arrived within `header_timeout_s` is
closed. An idle keep-alive connection is closed by aiohttp's own keep-alive timeout (the
runner's `keepalive_timeout`), a slow body by the server's `body_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time

from aiohttp import web
from typing_extensions import override

log = logging.getLogger("cbjax.serve")

_REFUSAL_BODY = json.dumps({"error": {"message": "too many open connections; retry later",
                                      "type": "service_unavailable", "param": None,
                                      "code": "too_many_connections"}}).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY)


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def default_max_connections() -> int:
    """A cap below the descriptor limit, leaving room for the model's files and the engine's."""
    return max(min(raise_descriptor_limit() - 256, 16384), 64)


class BurstLog:
    """Log an event's first occurrence, then at most one summary line per `window_s`."""

    def __init__(self, what: str, window_s: float = 10.0):
        self.what, self.window_s = what, window_s
        self.count, self.since = 0, None

    def note(self, detail: str = "") -> None:
        now = time.monotonic()
        if self.since is None or now - self.since >= self.window_s:
            if self.count:
                log.warning("%s: %d more in the last %.0f s", self.what, self.count, now - self.since)
            else:
                log.warning("%s%s", self.what, f" ({detail})" if detail else "")
            self.count, self.since = 0, now
        else:
            self.count += 1


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.refused = 0  # connections answered 503 at accept, in all
        self.timed_out = 0  # connections closed before their headers arrived, in all
        self._refusals = BurstLog("refused connections over the cap")
        self._timeouts = BurstLog("closed connections whose headers did not arrive in time")

    def protocol(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        return _Guarded(self, inner)


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection behind the guard's checks (a proxy: aiohttp's
    `RequestHandler` has slots, so it cannot be patched in place)."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.transport = None
        self.head_seen = False
        self._tail = b""
        self._deadline = None

    @override
    def connection_made(self, transport) -> None:
        guard = self.guard
        if guard.open >= guard.max_connections:
            guard.refused += 1
            guard._refusals.note(f"cap {guard.max_connections}")
            transport.write(REFUSAL)
            transport.close()
            self.inner = None
            return
        guard.open += 1
        self.transport = transport
        self._deadline = asyncio.get_running_loop().call_later(guard.header_timeout_s, self._headers_late)
        self.inner.connection_made(transport)

    def _headers_late(self) -> None:
        if not self.head_seen and self.transport is not None and not self.transport.is_closing():
            self.guard.timed_out += 1
            self.guard._timeouts.note(f"{self.guard.header_timeout_s:g} s")
            self.transport.abort()

    @override
    def data_received(self, data: bytes) -> None:
        if not self.head_seen:
            seen = self._tail + data[:65536]
            self.head_seen = b"\r\n\r\n" in seen
            self._tail = seen[-3:]
            if self.head_seen and self._deadline is not None:
                self._deadline.cancel()
        if self.inner is not None:
            self.inner.data_received(data)

    @override
    def eof_received(self):
        return self.inner.eof_received() if self.inner is not None else None

    @override
    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self.inner is not None:
            self.guard.open -= 1
            self.inner.connection_lost(exc)
            self.inner = None

    @override
    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    @override
    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections pass through a `ConnectionGuard`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard):
        super().__init__(runner)
        self._host, self._port, self.guard = host, port, guard

    @property
    @override
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    @override
    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self.guard.protocol(server()), self._host, self._port, reuse_address=True)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs a traceback each time accept() fails for want of descriptors (every socket
    of a flood): one line per burst instead."""
    burst = BurstLog("accept() failed for want of file descriptors")
    default = loop.get_exception_handler()

    def handle(loop, context):
        if "out of system resource" in str(context.get("message", "")):
            burst.note(str(context.get("exception", "")))
        elif default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
