"""``paramplane health HOST:PORT``: exit 0 when the coordinator's gRPC health service says SERVING.

Meant for container health checks (docker compose ``healthcheck``) and scripts. The job token
(and ``PARAMPLANE_TLS_CA`` for a TLS coordinator) comes from ``--token-file``, ``PARAMPLANE_TOKEN_FILE`` or ``PARAMPLANE_TOKEN``
(health checks themselves need none: the coordinator exempts them); every call has a deadline.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from paramplane.node.errors import PlaneError
from paramplane.protos.net import resolve_token, tls_paths


def channel(address: str) -> Any:
    """A blocking channel to the coordinator (TLS when ``PARAMPLANE_TLS_CA`` names its root certificate)."""
    import grpc

    ca = tls_paths()["CA"]
    if ca:  # a TLS coordinator, verified like the ranks verify it
        with open(ca, "rb") as f:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    return grpc.insecure_channel(address)


def cli_token(token_file: str | None) -> str | None:
    """The job token from ``--token-file``, else PARAMPLANE_TOKEN_FILE / PARAMPLANE_TOKEN."""
    return resolve_token(token_file=token_file)


T = TypeVar("T")


def ask(prog: str, address: str, token_file: str | None, timeout_s: float, call: Callable[..., T]) -> T | int:
    """``call(address, token, timeout_s)`` for the CLI ``paramplane prog``: its answer, or the exit code after
    one line on stderr (2: the token cannot be read; 1: the coordinator did not answer well)."""
    import grpc

    try:
        token = cli_token(token_file)
    except ValueError as error:
        print(f"paramplane {prog}: error: {error}", file=sys.stderr)
        return 2
    try:
        return call(address, token, timeout_s)
    except grpc.RpcError as exc:
        print(f"paramplane {prog}: {address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except PlaneError as exc:  # the typed coordinator client's errors
        print(f"paramplane {prog}: {address}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def check(address: str, token: str | None, timeout_s: float) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``, ...) of the coordinator at ``address``."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from paramplane.protos.auth import token_metadata

    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, metadata=token_metadata(token)
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paramplane health", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="deadline of the check in seconds (default 3)"
    )
    parser.add_argument("--token-file", default=None, help="file holding the job token")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    status = ask("health", args.address, args.token_file, args.timeout, check)
    if isinstance(status, int):
        return status
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
