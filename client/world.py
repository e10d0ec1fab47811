"""``pp.init()`` and the ``World``: this rank's place in the job and its process groups."""

from __future__ import annotations

import atexit
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from paramplane.group import ProcessGroup
from paramplane.node.peer import TlsConfig
from paramplane.node.runtime import NodeRuntime, RuntimeConfig
from paramplane.node.transports.base import TransportPolicy
from paramplane.protos.net import resolve_token

ENV_VARS = {
    "PARAMPLANE_COORDINATOR": "host:port of the coordinator (required unless passed to init)",
    "PARAMPLANE_WORLD_SIZE": "expected number of ranks (0 or unset: the coordinator's)",
    "PARAMPLANE_RANK": "rank hint (the launcher sets it)",
    "PARAMPLANE_TOKEN": "job token every RPC carries",
    "PARAMPLANE_TOKEN_FILE": "file holding the job token",
    "PARAMPLANE_HOST_ID": "host identity for rank grouping (default: hostname)",
    "PARAMPLANE_TIMEOUT": "default collective timeout in seconds (default 300)",
    "PARAMPLANE_JOIN_TIMEOUT": "seconds to wait for the world to form (default 300)",
    "PARAMPLANE_TRANSPORT": "auto | grpc | shm (default auto)",
    "PARAMPLANE_BIND": "address the data-plane server binds (default 127.0.0.1)",
    "PARAMPLANE_ADVERTISE": "address peers use to reach this rank (default: the bind address)",
    "PARAMPLANE_SHM_SLOT_MB": "shared-memory slot per rank and bank in MiB (default 1)",
    "PARAMPLANE_TCP_LANE": "1 (default): data frames on raw TCP lanes; 0: on gRPC streams (always under TLS)",
    "PARAMPLANE_TRACE": "folder for per-rank Chrome-trace JSON of every collective",
    "PARAMPLANE_TLS_CERT": "PEM certificate this rank's data-plane server presents (with _KEY and _CA)",
    "PARAMPLANE_TLS_KEY": "PEM private key of that certificate",
    "PARAMPLANE_TLS_CA": "PEM root certificate that verifies peers and a TLS coordinator",
}


def _flag(name: str, *, default: bool) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value.lower() in ("1", "true", "yes")


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _tls() -> tuple[TlsConfig | None, bytes | None]:
    """Data-plane TLS and the coordinator's root certificate from PARAMPLANE_TLS_*."""
    paths = {name: _env(f"PARAMPLANE_TLS_{name}") for name in ("CERT", "KEY", "CA")}
    if paths["CERT"] or paths["KEY"]:
        missing = [f"PARAMPLANE_TLS_{n}" for n, v in paths.items() if not v]
        if missing:
            raise ValueError(
                f"data-plane TLS needs PARAMPLANE_TLS_CERT, _KEY and _CA; missing {', '.join(missing)}"
            )
    data = {name: Path(path).read_bytes() for name, path in paths.items() if path}
    tls = TlsConfig(cert=data["CERT"], key=data["KEY"], root_cert=data["CA"]) if "CERT" in data else None
    return tls, data.get("CA")


@dataclass(frozen=True)
class KVStore:
    """The coordinator's key/value store for this world (values are bytes)."""

    _rt: NodeRuntime

    def set(self, key: str, value: bytes) -> None:
        self._rt.run(self._rt.coord.kv_set(key, value))

    def get(self, key: str, *, wait: bool = False, timeout: float | None = None) -> bytes | None:
        return self._rt.run(self._rt.coord.kv_get(key, wait=wait, timeout_s=timeout))

    def add(self, key: str, delta: int = 1) -> int:
        return self._rt.run(self._rt.coord.kv_add(key, delta))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        return self._rt.run(self._rt.coord.kv_compare_set(key, expected, desired))

    def delete(self, key: str) -> bool:
        return self._rt.run(self._rt.coord.kv_delete(key))


class World:
    """This rank's view of the job; a context manager that shuts the plane down on exit."""

    def __init__(self, runtime: NodeRuntime) -> None:
        self._rt = runtime
        m = runtime.membership
        self.rank = m.rank
        self.world_size = m.world_size
        self.local_rank = m.local_rank
        self.local_world_size = m.local_world_size
        self.node_rank = m.node_rank
        self.num_nodes = m.num_nodes
        self.host_id = m.peers[m.rank].host_id
        self.job_id = m.job_id
        self.kv = KVStore(runtime)
        self.group = ProcessGroup(runtime.group("world", list(range(m.world_size))))
        self._num_barriers = 0

    @property
    def topology(self) -> Any:
        return self._rt.topology

    @property
    def runtime(self) -> NodeRuntime:
        return self._rt

    def use_gpu(self) -> int:
        """Make this rank's GPU (``local_rank`` modulo the visible devices) cupy's current device
        and return its id. Call it before creating cupy arrays, like ``torch.cuda.set_device``.
        Where a host runs more ranks than it has GPUs, ranks share them (see README, GPUs)."""
        from paramplane.node.arrays import cupy_module
        from paramplane.node.transports.nccl import share_gpu_env

        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("use_gpu needs cupy and a CUDA device: pip install 'paramplane[gpu]'")
        num_devices = int(cupy.cuda.runtime.getDeviceCount())
        share_gpu_env(self._rt.topology, self.rank, num_devices)
        device = self.local_rank % num_devices
        cupy.cuda.Device(device).use()
        return device

    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> ProcessGroup | None:
        """A group of global ``ranks``; returns None on ranks that are not members.

        Like torch, every rank may call this for every group. Only the members have to: a group
        is named by its member set, so members that create groups of the same ranks in the same
        order agree on each of them (see ``ProcessGroup.new_subgroup``).
        """
        members = sorted({int(r) for r in ranks})
        if len(members) != len(list(ranks)) or not members:
            raise ValueError(f"new_group needs distinct ranks, got {list(ranks)}")
        if members[0] < 0 or members[-1] >= self.world_size:
            raise ValueError(f"new_group ranks must lie in [0, {self.world_size}), got {list(ranks)}")
        if self.rank not in members:
            return None
        return ProcessGroup(self._rt.new_group(members, timeout))

    def barrier(self, name: str | None = None, *, timeout: float | None = None) -> None:
        """A world barrier through the coordinator (no data plane involved)."""
        self._num_barriers += 1
        label = name or f"world-{self._num_barriers}"
        limit = timeout or self._rt.config.timeout_s
        self._rt.run(self._rt.coord.barrier(label, timeout_s=limit))

    def abort(self, reason: str) -> None:
        """Abort the whole job: every rank's pending and later ops fail with WorldAborted."""
        self._rt.run(self._rt.coord.abort(reason), timeout=30)

    def shutdown(self) -> None:
        """Leave the world and stop the runtime. Idempotent."""
        self._rt.shutdown()

    def __enter__(self) -> World:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<World rank {self.rank}/{self.world_size} node {self.node_rank} local {self.local_rank}>"


def init(
    coordinator: str | None = None,
    *,
    world_size: int | None = None,
    rank: int | None = None,
    token: str | None = None,
    host_id: str | None = None,
    timeout: float | None = None,
    join_timeout: float | None = None,
    transport: str | None = None,
    bind: str | None = None,
    advertise: str | None = None,
) -> World:
    """Join the world; arguments override the PARAMPLANE_* variables (see ``ENV_VARS``)."""
    address = coordinator or _env("PARAMPLANE_COORDINATOR")
    if not address:
        raise ValueError(
            "no coordinator: pass init(coordinator='HOST:PORT') or set PARAMPLANE_COORDINATOR "
            "(`paramplane launch --standalone` sets it for you)"
        )
    tracer = None
    trace_dir = _env("PARAMPLANE_TRACE")
    if trace_dir:
        from paramplane.trace import ChromeTracer

        tracer = ChromeTracer(trace_dir)
    tls, coordinator_ca = _tls()
    config = RuntimeConfig(
        coordinator=address,
        world_size=world_size if world_size is not None else int(_env("PARAMPLANE_WORLD_SIZE", "0") or 0),
        rank_hint=rank if rank is not None else int(_env("PARAMPLANE_RANK", "-1") or -1),
        token=resolve_token(token),
        host_id=host_id or _env("PARAMPLANE_HOST_ID") or socket.gethostname(),
        timeout_s=timeout or float(_env("PARAMPLANE_TIMEOUT", "300") or 300),
        join_timeout_s=join_timeout or float(_env("PARAMPLANE_JOIN_TIMEOUT", "300") or 300),
        # RuntimeConfig checks the value and names PARAMPLANE_TRANSPORT when it is wrong.
        transport=cast(TransportPolicy, transport or _env("PARAMPLANE_TRANSPORT", "auto") or "auto"),
        shm_slot_mb=float(_env("PARAMPLANE_SHM_SLOT_MB", "1") or 1),
        tcp_lane=_flag("PARAMPLANE_TCP_LANE", default=True),
        bind_host=bind or _env("PARAMPLANE_BIND", "127.0.0.1") or "127.0.0.1",
        advertise_host=advertise or _env("PARAMPLANE_ADVERTISE"),
        tracer=tracer,
        tls=tls,
        coordinator_root_cert=coordinator_ca,
    )
    runtime = NodeRuntime(config)
    runtime.start()
    world = World(runtime)
    # A script that forgets shutdown() still says goodbye to its peers (they would see it as lost).
    atexit.register(world.shutdown)
    if tracer is not None:
        tracer.open(world.rank)
    return world
