"""The door of the HTTP server: what every request passes before any route sees it (a pure ASGI middleware,
so streaming responses are untouched).

In this order: the Host header (on a loopback bind only loopback names, so a web page that rebinds its DNS
name to 127.0.0.1 cannot reach the server); the API key (compared in constant time; every path but
``/health``, and ``/metrics`` and the docs unless they are left open); a POST's Content-Type must be JSON (a
web page can send a blind ``text/plain`` POST without a CORS preflight); the body's size (refused from its
Content-Length before a byte is read, else counted as it arrives). Refusals are JSON errors in OpenAI's shape.
Knows nothing about routes' bodies or engines.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
DOC_PATHS = ("/metrics", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def allowed_hosts_for(bind_host: str, extra: Iterable[str] | None) -> frozenset[str] | None:
    """The Host names accepted: loopback names (+ ``extra``) on a loopback bind; ``extra`` alone elsewhere, or
    None (any) when not given."""
    extra = [h.lower() for h in extra or ()]
    if is_loopback(bind_host):
        return frozenset((*LOOPBACK_NAMES, bind_host.lower(), *extra))
    return frozenset(extra) if extra else None


def _error(status: int, message: str, param: str | None, kind: str) -> tuple[int, bytes]:
    return status, msgspec.json.encode({"error": {"message": message, "type": kind, "param": param, "code": status}})


class Guard:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 allowed_hosts: frozenset[str] | None, protect_docs: bool = True) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts
        self.open_paths = {"/health"} | (set() if protect_docs else set(DOC_PATHS))

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.lower(), v)
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            refusal, receive = await self._bounded_body(headers, receive)
        if refusal is not None:
            status, body = refusal
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, bytes] | None:
        if self.allowed_hosts is not None and b"host" in headers:
            name = host_name(headers[b"host"].decode("latin-1"))
            if name not in self.allowed_hosts:
                return _error(400, f"Host: {name[:80]!r} is not a name of this server (it accepts "
                              f"{sorted(self.allowed_hosts)}); connect by one of them, or start the server with "
                              "serve.allowed_hosts=[...]", "Host", "invalid_request_error")
        if self.api_key is not None and scope["path"] not in self.open_paths:
            auth = headers.get(b"authorization", b"")
            if not hmac.compare_digest(auth, b"Bearer " + self.api_key):
                return _error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", None,
                              "authentication_error")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                return _error(415, f"Content-Type: {ctype.decode('latin-1')[:80]!r} is not JSON; send the body as "
                              "JSON with 'Content-Type: application/json'", "Content-Type", "invalid_request_error")
        return None

    async def _bounded_body(self, headers: dict[bytes, bytes], receive):
        """(refusal or None, a receive that replays the body read here); refused before reading when the
        Content-Length says it is too big, else as soon as the bytes that came exceed the cap."""
        cap = self.max_body_bytes
        too_big = _error(413, f"the request body is over this server's limit of {cap} bytes; send less, or start "
                         "the server with serve.limits.max_body_bytes=<more>", None, "invalid_request_error")
        length = headers.get(b"content-length")
        if length is not None:
            if not length.strip().isdigit() or len(length) > 18:
                return _error(400, "Content-Length: is not a byte count", "Content-Length",
                              "invalid_request_error"), receive
            if int(length) > cap:
                return too_big, receive
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return None, _replay([message], receive)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > cap:
                return too_big, receive
            if not message.get("more_body", False):
                break
        return None, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _replay(messages: list[dict], receive):
    async def replayed() -> dict:
        return messages.pop(0) if messages else await receive()
    return replayed
