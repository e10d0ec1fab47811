"""``paramplane coordinator``: run one coordinator until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
from paramplane.protos.fields import default_of, field_docs
from paramplane.protos.net import TOKEN_ENV, prefer_control_latency, resolve_token


# Flags that set a CoordinatorConfig field: (flag, field, type). Their help and default come from the field.
def port_or_off(text: str) -> int | None:
    """A port number, or ``off`` (None)."""
    return None if text == "off" else int(text)


FIELD_FLAGS: list[tuple[str, str, Callable[[str], object]]] = [
    ("--host", "host", str),
    ("--port", "port", int),
    ("--join-timeout", "join_timeout_s", float),
    ("--heartbeat-timeout", "heartbeat_timeout_s", float),
    ("--heartbeat-interval", "heartbeat_interval_s", float),
    ("--progress-timeout", "progress_timeout_s", float),
    ("--http-port", "http_port", int),
    ("--http-host", "http_host", str),
    ("--host-lane-port", "host_lane_port", port_or_off),
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paramplane coordinator", description="Run the coordinator of one world."
    )
    docs = field_docs(CoordinatorConfig)
    p.add_argument("--world-size", type=int, required=True, help=docs["world_size"])
    for flag, name, kind in FIELD_FLAGS:
        default = default_of(CoordinatorConfig, name)
        p.add_argument(flag, type=kind, default=default, help=f"{docs[name]} (default {default})")
    p.add_argument(
        "--token-file",
        type=Path,
        help=f"file holding the job token (else $PARAMPLANE_TOKEN_FILE, then ${TOKEN_ENV})",
    )
    p.add_argument("--tls-cert", type=Path, help=docs["tls_cert"] + " (a PEM file, with --tls-key)")
    p.add_argument("--tls-key", type=Path, help=docs["tls_key"] + " (a PEM file, with --tls-cert)")
    p.add_argument("--http-public", action="store_true", help=docs["http_public"])
    p.add_argument("--port-file", type=Path, help="write the bound port to this file once listening")
    p.add_argument(
        "--grace", type=float, default=1.0, help="seconds in-flight calls get on shutdown (default 1)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _config(args: argparse.Namespace) -> CoordinatorConfig:
    token = resolve_token(token_file=args.token_file)
    return CoordinatorConfig(
        world_size=args.world_size,
        token=token,
        tls_cert=args.tls_cert.read_bytes() if args.tls_cert else None,
        tls_key=args.tls_key.read_bytes() if args.tls_key else None,
        http_public=args.http_public,
        **{name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _ in FIELD_FLAGS},
    )


async def _serve(config: CoordinatorConfig, port_file: Path | None, grace: float) -> None:
    server = await CoordinatorServer.start(config)
    try:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if port_file is not None:
            _write_atomically(port_file, f"{server.port}\n")
        print(
            f"paramplane coordinator listening on {server.address} (world size {config.world_size})",
            flush=True,
        )
        if server.http_address is not None:
            print(f"paramplane coordinator live view on http://{server.http_address}/", flush=True)
        await stop.wait()
    finally:
        await server.stop(grace)


def main(argv: list[str] | None = None) -> int:
    """Run a coordinator until SIGTERM/SIGINT; 0 on a clean stop, 2 on bad arguments, 1 if it cannot start."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = _config(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    prefer_control_latency()
    try:
        asyncio.run(_serve(config, args.port_file, args.grace))
    except OSError as e:
        print(f"paramplane coordinator: {e}", file=sys.stderr)
        return 1
    return 0
