"""The coordinator's read-only HTTP view: ``/`` (a live page), ``/metrics`` (Prometheus), ``/api/status`` (JSON).

A minimal HTTP/1.1 server on the coordinator's own asyncio loop (no web framework): GET and HEAD only, one
request per connection, request heads bounded in size and time. Every path needs the job token (an
``Authorization: Bearer`` header or ``?token=``) unless the view is public.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from google.protobuf.json_format import MessageToDict

from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.net import host_port, within

log = logging.getLogger("paramplane.coordinator")

MAX_HEAD_BYTES = 16 * 1024
"""Largest request line plus headers; a longer head is answered 431 and the connection closed."""
HEAD_TIMEOUT_S = 10.0
"""How long a client may take to send its request head."""
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}
_PAGE_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'self'"
)
_LOGIN = (
    "<!doctype html><html><head><meta charset='utf-8'><title>paramplane: token needed</title></head><body>"
    "<p>This coordinator's page needs the job token.</p><form method='get' action='/'>"
    "<input type='password' name='token' placeholder='job token' autofocus> <button>open</button></form>"
    "</body></html>"
)


def status_dict(message: pb.StatusResponse) -> dict[str, Any]:
    """A status message as ``paramplane status --json`` prints it."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _page(status: dict[str, Any]) -> bytes:
    template = resources.files("paramplane.coordinator").joinpath("page.html").read_text()
    # The snapshot sits in a <script> element: "<" escaped so that no value can close it.
    initial = json.dumps(status).replace("<", "\\u003c")
    return template.replace("__INITIAL_STATUS__", initial).encode()


class HttpView:
    """Serves the live view of ``status()`` (the coordinator's StatusResponse) on ``host:port``."""

    def __init__(self, status: Callable[[], pb.StatusResponse], *, token: str | None, public: bool) -> None:
        self._status = status
        self._token = None if public else token
        self._server: asyncio.Server | None = None
        self._host = ""
        self._port = 0

    async def start(self, host: str, port: int) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
        except OSError as e:
            raise OSError(f"cannot bind the coordinator's HTTP view to {host_port(host, port)}: {e}") from e
        self._host = host
        self._port = self._server.sockets[0].getsockname()[1]

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return host_port(self._host, self._port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, headers, body, head_only = await self._answer(reader)
            reply = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Length: {len(body)}"]
            reply += [f"{k}: {v}" for k, v in headers.items()]
            reply += ["Connection: close", "Cache-Control: no-store", "X-Content-Type-Options: nosniff"]
            writer.write(("\r\n".join(reply) + "\r\n\r\n").encode() + (b"" if head_only else body))
            await within(writer.drain(), HEAD_TIMEOUT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await within(writer.wait_closed(), 1.0)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes, bool]:
        """(status, headers, body, HEAD?) for the request on ``reader``."""
        try:
            head = await within(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            return _text(431, "request head too large\n")
        except asyncio.IncompleteReadError:
            return _text(400, "incomplete request\n")
        except asyncio.TimeoutError:
            return _text(408, "request head not received in time\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _text(400, "malformed request line\n")
        method, target = parts[0], parts[1]
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name.strip():
                return _text(400, "malformed header line\n")
            headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            status, extra, body, _ = _text(405, "this view is read-only: GET or HEAD\n")
            return status, {**extra, "Allow": "GET, HEAD"}, body, method == "HEAD"
        url = urlsplit(target)
        answer = self._route(url.path, parse_qs(url.query), headers)
        return (*answer[:3], method == "HEAD")

    def _authorized(self, query: dict[str, list[str]], headers: dict[str, str]) -> bool:
        if self._token is None:
            return True
        scheme, _, given = headers.get("authorization", "").partition(" ")
        offered = given.strip() if scheme.lower() == "bearer" else (query.get("token") or [""])[0]
        return hmac.compare_digest(offered.encode(), self._token.encode())

    def _route(
        self, path: str, query: dict[str, list[str]], headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes, bool]:
        if path not in ("/", "/metrics", "/api/status"):
            return _text(404, f"no such page: {path[:200]}; try /, /metrics or /api/status\n")
        if not self._authorized(query, headers):
            if path == "/":
                return 401, _html_headers(bearer=True), _LOGIN.encode(), False
            status, extra, body, _ = _text(401, "the job token is missing or wrong\n")
            return status, {**extra, "WWW-Authenticate": 'Bearer realm="paramplane"'}, body, False
        try:
            message = self._status()
            if path == "/metrics":
                # prometheus_client only where /metrics is scraped (a venv made before it was a dependency still
                # runs coordinators).
                from paramplane.coordinator.metrics import metrics_text

                return (
                    200,
                    {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
                    metrics_text(message),
                    False,
                )
            if path == "/api/status":
                body = json.dumps(status_dict(message)).encode()
                return 200, {"Content-Type": "application/json"}, body, False
            return 200, _html_headers(bearer=False), _page(status_dict(message)), False
        except Exception:
            log.exception("the HTTP view failed to answer %s", path)
            return _text(500, "internal error (see the coordinator's log)\n")


def _text(status: int, text: str) -> tuple[int, dict[str, str], bytes, bool]:
    return status, {"Content-Type": "text/plain; charset=utf-8"}, text.encode(), False


def _html_headers(*, bearer: bool) -> dict[str, str]:
    headers = {"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": _PAGE_CSP}
    if bearer:
        headers["WWW-Authenticate"] = 'Bearer realm="paramplane"'
    return headers
