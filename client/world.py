"""``pp.init()`` and the ``World``: this rank's place in the job and its process groups."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import typing
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.hosting import Hosted, find_or_host
from paramplane.node.engine import GroupEngine
from paramplane.node.errors import PlaneError, RendezvousError
from paramplane.node.peer import TlsConfig
from paramplane.node.runtime import ENV_OF, NodeRuntime, RuntimeConfig
from paramplane.placement import Placement, resolve
from paramplane.protos.fields import field_docs
from paramplane.protos.net import check_seconds, is_loopback, parse_address, resolve_token, tls_paths
from paramplane.trace import ChromeTracer

_FILE_VARS = {
    "PARAMPLANE_TOKEN": "job token every RPC carries",
    "PARAMPLANE_TOKEN_FILE": "file holding the job token",
    "PARAMPLANE_COORDINATOR_PORT": "Slurm: the coordinator's port on the job's first node (default: derived)",
    "PARAMPLANE_JOB_DIR": "folder the ranks of a Slurm or single-host MPI job share for the token / address",
    "PARAMPLANE_TRACE": "folder for per-rank Chrome-trace JSON of every collective",
    "PARAMPLANE_TLS_CERT": "PEM certificate this rank's data-plane server presents (with _KEY and _CA)",
    "PARAMPLANE_TLS_KEY": "PEM private key of that certificate",
    "PARAMPLANE_TLS_CA": "PEM root certificate that verifies peers and a TLS coordinator",
    "PARAMPLANE_JOINED_PID": "set by a rank while joined (not by users): a spawned multiprocessing child re-running "
    "the script refuses to join",
}


def _env_vars() -> dict[str, str]:
    docs = field_docs(RuntimeConfig)
    out = {}
    for f in dataclasses.fields(RuntimeConfig):
        if f.name in ENV_OF:
            default = "" if f.default in (dataclasses.MISSING, None) else f" (default {f.default!r})"
            out[ENV_OF[f.name]] = docs[f.name] + default
    return {**out, **_FILE_VARS}


ENV_VARS = _env_vars()
"""Every PARAMPLANE_* variable ``pp.init`` reads, with its doc: RuntimeConfig's field docs and defaults."""


def _parse(name: str, value: str, kind: Any) -> Any:
    """``value`` of variable ``name`` as a field of type ``kind`` (ValueError naming the variable)."""
    if kind is bool:
        if value.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"{name} must be 0 or 1, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    return value


def runtime_config(**overrides: Any) -> RuntimeConfig:
    """RuntimeConfig from the arguments (None: not given), else each field's PARAMPLANE_* variable
    (``ENV_OF``), else the field's default."""
    kinds = typing.get_type_hints(RuntimeConfig)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(RuntimeConfig):
        value = overrides.pop(f.name, None)
        if value is None and f.name in ENV_OF and (raw := _env(ENV_OF[f.name])) is not None:
            value = _parse(ENV_OF[f.name], raw, kinds[f.name])
        if value is not None:
            kwargs[f.name] = value
    assert not overrides, f"not RuntimeConfig fields: {sorted(overrides)}"
    if "coordinator" not in kwargs:
        raise ValueError(
            "no coordinator: pass init(coordinator='HOST:PORT') or set PARAMPLANE_COORDINATOR "
            "(`paramplane launch --standalone` sets it for you)"
        )
    return RuntimeConfig(**kwargs)


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _tls() -> tuple[TlsConfig | None, bytes | None]:
    """Data-plane TLS and the coordinator's root certificate from PARAMPLANE_TLS_*."""
    paths = tls_paths()
    if paths["CERT"] or paths["KEY"]:
        missing = [f"PARAMPLANE_TLS_{n}" for n, v in paths.items() if not v]
        if missing:
            raise ValueError(
                f"data-plane TLS needs PARAMPLANE_TLS_CERT, _KEY and _CA; missing {', '.join(missing)}"
            )
    data = {name: Path(path).read_bytes() for name, path in paths.items() if path}
    tls = TlsConfig(cert=data["CERT"], key=data["KEY"], root_cert=data["CA"]) if "CERT" in data else None
    return tls, data.get("CA")


def _check_timeout(timeout: float | None, default: float) -> float:
    """``timeout`` (``default`` when None); ValueError unless it is positive and at most a year."""
    return default if timeout is None else check_seconds(timeout, "timeout")


@dataclass(frozen=True)
class KVStore:
    """The coordinator's key/value store for this world (values are bytes)."""

    _rt: NodeRuntime

    def set(self, key: str, value: bytes) -> None:
        self._rt.run(self._rt.coord.kv_set(key, value))

    def get(self, key: str, *, wait: bool = False, timeout: float | None = None) -> bytes | None:
        """The value of ``key`` (None if absent); with ``wait``, block until it is set, at most ``timeout``
        seconds (positive and finite; default the runtime's collective timeout)."""
        if wait:
            timeout = _check_timeout(timeout, self._rt.config.timeout_s)
        return self._rt.run(self._rt.coord.kv_get(key, wait=wait, timeout_s=timeout))

    def add(self, key: str, delta: int = 1) -> int:
        return self._rt.run(self._rt.coord.kv_add(key, delta))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        return self._rt.run(self._rt.coord.kv_compare_set(key, expected, desired))

    def delete(self, key: str) -> bool:
        return self._rt.run(self._rt.coord.kv_delete(key))


class World:
    """This rank's view of the job; a context manager that shuts the plane down on exit."""

    def __init__(self, runtime: NodeRuntime, hosted: Hosted | None = None) -> None:
        self.group = ProcessGroup(self._adopt(runtime))
        self._hosted = hosted  # the coordinator this rank found or hosts (Slurm, MPI, env:// jobs)

    def _adopt(self, runtime: NodeRuntime) -> GroupEngine:
        """Take ``runtime``'s membership as this world's; returns the engine of its world group."""
        self._rt = runtime
        # Unnamed barriers are numbered within an epoch: every rank of a new epoch (survivor or replacement)
        # starts again at world-1.
        self._num_barriers = 0
        m = runtime.membership
        self.rank = m.rank
        self.world_size = m.world_size
        self.local_rank = m.local_rank
        self.local_world_size = m.local_world_size
        self.node_rank = m.node_rank
        self.num_nodes = m.num_nodes
        self.host_id = m.peers[m.rank].host_id
        self.job_id = m.job_id
        self.epoch = m.epoch
        self.kv = KVStore(runtime)
        return runtime.group("world", list(range(m.world_size)))

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
        return self._rt.use_gpu()

    def new_group(self, ranks: Sequence[int], *, timeout: float | None = None) -> ProcessGroup | None:
        """A group of global ``ranks``; returns None on ranks that are not members.

        Like torch, every rank may call this for every group. Only the members have to: a group
        is named by its member set, so members that create groups of the same ranks in the same
        order agree on each of them (see ``ProcessGroup.new_subgroup``).
        """
        ranks = list(ranks)
        members = sorted({int(r) for r in ranks})
        if len(members) != len(ranks) or not members:
            raise ValueError(f"new_group needs distinct ranks, got {list(ranks)}")
        if members[0] < 0 or members[-1] >= self.world_size:
            raise ValueError(f"new_group ranks must lie in [0, {self.world_size}), got {list(ranks)}")
        if self.rank not in members:
            return None
        return ProcessGroup(self._rt.new_group(members, timeout))

    def barrier(self, name: str | None = None, *, timeout: float | None = None) -> None:
        """A world barrier through the coordinator (no data plane involved). ``timeout`` (seconds, default the
        runtime's collective timeout) must be positive and finite; an unnamed barrier is named by its count in
        this epoch, so every rank must call unnamed barriers in the same order."""
        limit = _check_timeout(timeout, self._rt.config.timeout_s)
        self._num_barriers += 1
        label = name or f"world-{self._num_barriers}"
        self._rt.run(self._rt.coord.barrier(label, timeout_s=limit))

    def report(self, *, step: int, loss: float | None = None, tokens: int = 0) -> None:
        """Tell the coordinator's live view how training goes: the ``step`` just done, its ``loss`` and the
        ``tokens`` this rank processed since its last report. Cheap (no RPC: the next heartbeat carries it);
        the page charts the lowest reporting rank's loss and steps/s, and tokens/s summed over every rank."""
        self._rt.counters.report(step, loss, tokens)

    def abort(self, reason: str, *, timeout: float = 30.0) -> None:
        """Abort the whole job: every rank's pending and later ops fail with WorldAborted."""
        self._rt.run(self._rt.coord.abort(reason), timeout=timeout)

    def reform(self, *, timeout: float | None = None) -> World:
        """Re-form the world in this process after a failure (PeerLost, WorldAborted); returns ``self``.

        Ends the broken epoch on the coordinator (if no rank has yet), leaves it, and joins the next
        epoch with the other survivors and any replacement rank (started with ``pp.init(replacement=True)``
        or ``PARAMPLANE_REPLACEMENT=1``), keeping this rank's number where it can. It returns once the
        world has all ``world_size`` ranks again, or raises RendezvousError after ``timeout`` seconds
        (default: the join timeout). ``rank``, ``epoch`` and the rest then describe the new world.

        ``world.group`` stays the same object, now over the new world, so wrappers built on it (``pp.DDP``)
        go on; ``pp.FSDP`` goes on after ``fsdp.reform()``, which makes its groups again. Other groups made
        from the old world (``new_group``, subgroups, a ``Mesh``) fail with PlaneClosed: make them again.
        Survivors keep their state; bring a replacement up to date live with ``pp.checkpoint.sync(...)``, or
        load a checkpoint.
        """
        old = self._rt
        join_timeout = _check_timeout(timeout, old.config.join_timeout_s)
        cause = old.abort_error() if old.aborted.is_set() else None
        reason = f"rank {self.rank} re-forms the world" + (f" after: {cause}" if cause else "")
        # Every survivor ends the epoch (the first call wins); after that, or once another survivor has
        # started the next epoch, the coordinator refuses the call, which is fine: the old world is over.
        with contextlib.suppress(PlaneError, TimeoutError):
            old.run(old.coord.abort(reason), timeout=10)
        old.shutdown()
        tracer = None
        if isinstance(old.tracer, ChromeTracer):
            tracer = ChromeTracer(old.tracer.folder)
        config = dataclasses.replace(
            old.config,
            rank_hint=self.rank,
            world_size=self.world_size,
            join_timeout_s=join_timeout,
            replacement=False,
            tracer=tracer,
        )
        runtime = NodeRuntime(config)
        runtime.start()
        self.group._configure(self._adopt(runtime))
        if tracer is not None:
            tracer.open(self.rank, self.epoch)
        return self

    def shutdown(self) -> None:
        """Leave the world and stop the runtime. Idempotent.

        Called while an exception propagates (from a ``finally`` or ``except`` block), it first aborts the world
        naming that exception (``abort_for``), as leaving ``with pp.init()`` does: a rank that merely left is
        one its peers may still wait for, an aborted world fails them at once with the reason."""
        exc = sys.exc_info()[1]
        if exc is not None:
            self.abort_for(exc)
        self._rt.shutdown()
        if os.environ.get(_JOINED_PID) == str(os.getpid()):
            del os.environ[_JOINED_PID]  # children started from now on may join worlds of their own
        hosted, self._hosted = self._hosted, None
        if hosted is not None:
            hosted.stop()

    def __enter__(self) -> World:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()  # an exception leaving the block is in flight here: shutdown aborts the world with it

    def abort_for(self, exc: BaseException) -> None:
        """The script ends with ``exc``: abort the world with it as the reason, so no peer waits for this rank
        until its timeout (a rank that merely left may still be expected to send). Nothing for a
        ``PlaneError`` (the plane's own failure, which the peers learn by themselves) or ``sys.exit(0)``.
        Called on leaving ``with pp.init()`` by an exception, by ``shutdown`` while one propagates, and for an
        uncaught one (``sys.excepthook``)."""
        if isinstance(exc, PlaneError) or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            return
        if self._rt.closed or self._rt.aborted.is_set():
            return
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        with contextlib.suppress(Exception):
            self.abort(f"rank {self.rank} exited with {what[:_REASON_CHARS]}", timeout=10.0)

    def __repr__(self) -> str:
        return f"<World rank {self.rank}/{self.world_size} node {self.node_rank} local {self.local_rank}>"


_REASON_CHARS = 400  # of an exception's text in an abort reason
_LIVE: weakref.WeakSet[World] = weakref.WeakSet()
_previous_excepthook = sys.excepthook


def _abort_on_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    for world in list(_LIVE):
        world.abort_for(exc)
    _previous_excepthook(exc_type, exc, tb)


def _hook_uncaught() -> None:
    global _previous_excepthook
    if sys.excepthook is not _abort_on_uncaught:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught


_JOINED_PID = "PARAMPLANE_JOINED_PID"  # set by a rank once joined: its children inherit it


def _refuse_in_a_child_of_a_rank() -> None:
    """A multiprocessing child that a joined rank started with the "spawn" start method (torch's DataLoader
    workers with ``multiprocessing_context="spawn"``, a spawn process pool) runs the script's top level again as
    ``__mp_main__``: its ``pp.init()`` would try to join as its parent's rank. Refused, naming the fix."""
    joined = os.environ.get(_JOINED_PID)
    # multiprocessing runs the parent's main script under the module name "__mp_main__" in its children
    if joined and joined == str(os.getppid()) and "__mp_main__" in sys.modules:
        raise RendezvousError(
            f"pp.init() in a child process (pid {os.getpid()}) of a rank that has already joined (pid {joined}): "
            "a multiprocessing child started with 'spawn' (a DataLoader worker, a process pool) runs the "
            "script's top level again. Put the script's training code under "
            '`if __name__ == "__main__":`, as multiprocessing requires.'
        )


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
    replacement: bool | None = None,
) -> World:
    """Join the world; arguments override the environment: the PARAMPLANE_* variables (see ``ENV_VARS``), then
    what Slurm, MPI, Kubernetes or torch's env:// names say (``paramplane.placement``; ``paramplane env``)."""
    _refuse_in_a_child_of_a_rank()
    tracer = None
    token = resolve_token(token)
    hosted = None
    placement = resolve(os.environ, coordinator)
    rank = _pick(rank, placement, "rank")
    world_size = _pick(world_size, placement, "world_size")
    host_id = host_id if host_id is not None else _pick(None, placement, "node")
    if placement.coordinator is not None and "PARAMPLANE_COORDINATOR" not in placement.coordinator.source:
        hosted = _find_or_host(placement, token, join_timeout)
        coordinator, token = hosted.address, hosted.token
    address = coordinator or _env("PARAMPLANE_COORDINATOR")
    if bind is None and _env("PARAMPLANE_BIND") is None and _multi_node(placement, address):
        bind = "0.0.0.0"  # peers on other nodes dial this rank at its node's name
        advertise = advertise or _env("PARAMPLANE_ADVERTISE") or (host_id if host_id else None)
    trace_dir = _env("PARAMPLANE_TRACE")
    if trace_dir:
        tracer = ChromeTracer(trace_dir)
    tls, coordinator_ca = _tls()
    config = runtime_config(
        coordinator=coordinator,
        world_size=world_size,
        rank_hint=rank,
        token=token,
        host_id=host_id,
        timeout_s=timeout,
        join_timeout_s=join_timeout,
        replacement=replacement,
        transport=transport,
        bind_host=bind,
        advertise_host=advertise,
        tracer=tracer,
        tls=tls,
        coordinator_root_cert=coordinator_ca,
    )
    runtime = NodeRuntime(config)
    try:
        runtime.start()
    except BaseException:
        if hosted is not None:
            hosted.stop(wait_s=0)
        raise
    world = World(runtime, hosted)
    os.environ[_JOINED_PID] = str(os.getpid())
    # A script that forgets shutdown() still says goodbye to its peers (they would see it as lost); one that
    # dies of an uncaught exception aborts the world first (World.abort_for).
    atexit.register(world.shutdown)
    _LIVE.add(world)
    _hook_uncaught()
    if tracer is not None:
        tracer.open(world.rank, world.epoch)
    return world


def _pick(given: Any, placement: Placement, name: str) -> Any:
    """``given``, else the placement's value of ``name`` (None when nothing names it)."""
    if given is not None:
        return given
    found = getattr(placement, name)
    return None if found is None else found.value


def _multi_node(placement: Placement, coordinator: str | None) -> bool:
    """The job spans nodes (and this world is not one host's, as under ``launch --standalone`` in an srun step)."""
    if coordinator is not None and is_loopback(parse_address(coordinator)[0]):
        return False
    return placement.num_nodes is not None and int(placement.num_nodes.value) > 1


def _find_or_host(placement: Placement, token: str | None, join_timeout: float | None) -> Hosted:
    """The coordinator a scheduler's environment points at (started here on rank 0), within the join timeout."""
    raw = _env(ENV_OF["join_timeout_s"])
    limit = (
        join_timeout
        if join_timeout is not None
        else (_parse("PARAMPLANE_JOIN_TIMEOUT", raw, float) if raw else None)
    )
    limit = _check_timeout(limit, RuntimeConfig.join_timeout_s)
    try:
        return find_or_host(placement, token, limit, os.environ)
    except TimeoutError as error:
        raise RendezvousError(
            f"{error} ({placement.launcher} job, rank {_pick(None, placement, 'rank')})"
        ) from None
