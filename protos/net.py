"""Addresses, the loopback policy and the job token, written once for the coordinator, the node
runtime and the CLIs (kept beside the protos for the same reason as ``auth.py``)."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

CONTROL_SWITCH_INTERVAL_S = 0.0002
"""Python's GIL switch interval in a process serving the control plane (Python's default: 5 ms)."""

TOKEN_ENV = "PARAMPLANE_TOKEN"
TOKEN_FILE_ENV = "PARAMPLANE_TOKEN_FILE"


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too) and check the port; ``ValueError`` naming ``what`` if malformed."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} must be HOST:PORT with a port in 1..65535, got {address!r}")
    return host, int(port)


def host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (an IP literal, or "localhost"): serving there needs no token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: str | os.PathLike[str], source: str = "--token-file") -> str:
    """The token in the file ``path``; ``ValueError`` (naming ``source``) if unreadable or empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"cannot read {source} {path}: {error.strerror}") from None
    if not token:
        raise ValueError(f"{source} {path} is empty")
    return token


def resolve_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None) -> str | None:
    """The job token: ``token``, else the file ``token_file``, else the file ``$PARAMPLANE_TOKEN_FILE``,
    else ``$PARAMPLANE_TOKEN``, else None."""
    if token:
        return token
    if token_file:
        return read_token(token_file)
    env_file = os.environ.get(TOKEN_FILE_ENV)
    if env_file:
        return read_token(env_file, TOKEN_FILE_ENV)
    return os.environ.get(TOKEN_ENV) or None


MAX_TIMEOUT_S = 365 * 24 * 3600.0
"""The longest timeout any setting may ask for (a year): every wait hands it to the OS, so it must be finite."""


def check_seconds(
    value: float, what: str, *, allow_zero: bool = False, upper: float | None = MAX_TIMEOUT_S
) -> float:
    """``value`` as a float; ValueError naming ``what`` unless it is finite, > 0 (>= 0 with ``allow_zero``, 0
    meaning off) and at most ``upper`` seconds (None: no bound but finiteness). NaN fails every comparison."""
    low = value >= 0 if allow_zero else value > 0
    if not (low and math.isfinite(value) and (upper is None or value <= upper)):
        bound = ">= 0 (0 = off)" if allow_zero else "> 0"
        most = f", at most {upper:.0f} (a year)" if upper is not None else ""
        raise ValueError(f"{what} must be a finite number of seconds {bound}{most}, got {value}")
    return float(value)


TLS_ENV = {"CERT": "PARAMPLANE_TLS_CERT", "KEY": "PARAMPLANE_TLS_KEY", "CA": "PARAMPLANE_TLS_CA"}
"""The TLS settings, read in one place (``tls_paths``) by the ranks and the CLI's coordinator channel."""


def tls_paths() -> dict[str, str | None]:
    """``{"CERT", "KEY", "CA"}``: the PEM files the PARAMPLANE_TLS_* variables name (None where unset or empty)."""
    return {name: os.environ.get(var) or None for name, var in TLS_ENV.items()}


def prefer_control_latency() -> None:
    """For a process that serves the control plane (the coordinator; a launcher with its host agent): gRPC's
    completion-queue thread hands each finished call to the event loop's thread, and needs the GIL for it;
    while the loop is busy answering other calls it would wait up to the switch interval. Lowered (never
    raised) to ``CONTROL_SWITCH_INTERVAL_S`` (``benchmarks/control_plane.py``: the agents' barrier).
    Not for rank processes: their threads are the user's."""
    sys.setswitchinterval(min(sys.getswitchinterval(), CONTROL_SWITCH_INTERVAL_S))


async def within(aw: Awaitable[T], seconds: float | None) -> T:
    """``await aw``, raising TimeoutError after ``seconds`` (None: no limit); use it, not ``asyncio.wait_for``.

    On Python 3.11 ``wait_for`` swallows a cancellation that arrives as ``aw`` finishes (CPython gh-86296,
    fixed in 3.12, where ``wait_for`` became this): the cancelled task runs on, and whoever waits for it to
    end (a server's shutdown cancelling its connection tasks) waits forever. ``asyncio.timeout`` raises the
    cancellation at the task's next await instead."""
    async with asyncio.timeout(seconds):
        return await aw


async def best_effort(aw: Awaitable[T], seconds: float | None) -> T | None:
    """``await aw`` (within ``seconds``) for something optional: a goodbye, an error frame to a peer, a failed
    call's status, a task just cancelled. Its result, or None when it fails, times out or is cancelled under
    us (grpc.aio raises ``CancelledError`` from a call cancelled elsewhere; so does a task we cancelled). A
    cancellation of the awaiting task itself propagates: ``except BaseException: pass`` around such an await
    swallowed it, and a shutdown told to stop went on to its next peer. (Counted from the call: a task that
    caught an earlier cancellation to clean up keeps its best efforts.)"""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        return await within(aw, seconds)
    except (Exception, asyncio.CancelledError):
        if task is not None and task.cancelling() > before:
            raise
        return None
