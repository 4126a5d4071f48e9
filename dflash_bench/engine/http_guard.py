"""Who may talk to the server, and how much it may send: checked before any route reads a byte of body.

`Guard` is plain ASGI middleware in front of the app (engine/server.py). In order, it refuses:
- a `Host` header that is not a name the server is bound to (421), so a web page that rebinds its
  own domain name to 127.0.0.1 (DNS rebinding) cannot read replies from a loopback server;
- a missing or wrong `Authorization: Bearer KEY` when the server has an API key (401, as vLLM and
  llama.cpp answer; GET /health stays open so that readiness probes need no key);
- a POST whose body is not `application/json` (415): a web page can send text/plain, form or
  untyped bodies cross-site without asking the browser first, but not JSON;
- a `Content-Length` over the body limit (413 at once, the body unread, the connection closed).
A body sent without a length is counted as it arrives (`read_body`), and refused the same way.
Every refusal is an OpenAI-shaped error body.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dflash_bench.engine.constants import MIB

BODY_FLOOR = MIB  # every body limit allows at least this much: short chats with long system prompts
BODY_BYTES_PER_TOKEN = 128  # a context token as JSON: a long token's text, escaped (\uXXXX), or an id and its comma
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
API_KEY_ENV = "DFLASH_BENCH_API_KEY"  # serve --api-key's default, and the key the checks send


def default_body_limit(context: int) -> int:
    """Bytes of body a server of `context` tokens takes by default: far more than any prompt that fits."""
    return BODY_FLOOR + BODY_BYTES_PER_TOKEN * context


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Hosts:
    """The names a `Host` header may carry. Any IP literal is allowed when the server listens on every
    interface: rebinding needs a domain name, and such a server is reached by whatever address."""

    names: frozenset[str]
    any_ip: bool = False

    @classmethod
    def bound_to(cls, host: str, extra: tuple[str, ...] = ()) -> Hosts:
        """For a server bound to `host`: the loopback names, the bound name and `extra` (serve
        --allowed-host); on a wildcard address (0.0.0.0, ::) also this machine's names and any IP."""
        names = set(LOOPBACK_NAMES) | {_name(host)} | {_name(h) for h in extra}
        wildcard = host in ("0.0.0.0", "::", "")
        if wildcard:
            names |= {_name(socket.gethostname()), _name(socket.getfqdn())}
        return cls(frozenset(names), any_ip=wildcard)

    def allows(self, header: str) -> bool:
        name = _name(header)
        if name in self.names:
            return True
        if not self.any_ip:
            return False
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


def _name(host: str) -> str:
    """'Example.com.:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


@dataclass(frozen=True)
class Access:
    """What `Guard` enforces. `max_body_bytes` None: sized from the engine's context once loaded."""

    hosts: Hosts = field(default_factory=lambda: Hosts.bound_to("127.0.0.1"))
    api_key: str | None = None
    max_body_bytes: int | None = None


class Refused(Exception):
    """A request refused before (or while) its body is read, with its HTTP status."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.code), self.status, self.headers)


class ClientGone(Exception):
    """The client hung up before its body was whole: nobody is left to answer."""


def error_body(message: str, code: str, param: str | None = None, kind: str = "invalid_request_error",
               **extra: Any) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}


def too_large(limit: int, size: int | None = None) -> Refused:
    said = f"the body is {size} bytes" if size is not None else "the body is longer"
    return Refused(413, f"{said}, over this server's limit of {limit} bytes (serve --max-body-mib)",
                   "request_too_large", {"connection": "close"})  # the rest of the body is never read


class Guard:
    """The ASGI middleware: `limit()` gives the body limit now (it follows the engine once loaded)."""

    def __init__(self, app: ASGIApp, access: Access, limit: Callable[[], int]) -> None:
        self.app, self.access, self.limit = app, access, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self.check(scope)
            except Refused as err:
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if host is not None and not self.access.hosts.allows(host):  # HTTP/1.0 may omit it; no browser does
            raise Refused(421, f"Host {host!r} is not a name this server answers to (serve --allowed-host adds one)",
                          "invalid_host")
        if self.access.api_key is not None and scope["path"] not in OPEN_PATHS:
            scheme, _, key = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.access.api_key.encode()):
                said = "no API key" if not key else "an incorrect API key"
                raise Refused(401, f"{said} given: send the server's --api-key as 'Authorization: Bearer KEY'",
                              "invalid_api_key", {"www-authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                raise Refused(415, f"a POST body must be application/json, got {kind or 'no content type'!r}",
                              "unsupported_media_type")
            length = headers.get("content-length")  # digits only: the HTTP parser (h11) refuses anything else
            if length is not None and int(length) > self.limit():
                raise too_large(self.limit(), int(length))


async def read_body(http: Request, limit: int) -> bytes:
    """The whole body, counted as it arrives (a chunked body has no length for Guard to check)."""
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)
