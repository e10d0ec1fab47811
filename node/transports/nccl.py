"""NCCL collectives (``cupy.cuda.nccl``) for GPU ranks of one host.

The group's first rank publishes an NCCL unique id in the coordinator's
epoch-scoped key/value store; every member builds its communicator from it.
Ops are enqueued on the current CUDA stream, so they are ordered with the
caller's kernels; ``abort()`` tears the communicator down after a failure. An NCCL error, raised by a
call or found by the runtime's poll of ``async_error()``, is a DeviceCommError that aborts the world.
NCCL frames carry no header: argument checks happen before the call, and
mismatched shapes across ranks are caught only by the host transports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

from paramplane.node.arrays import dtype_name
from paramplane.node.errors import CollectiveTimeout, DeviceCommError
from paramplane.node.loop import on_daemon_thread
from paramplane.node.spec import OpSpec
from paramplane.node.topology import Topology
from paramplane.node.transports.base import Bounds, Splits, Transport
from paramplane.protos.net import within

log = logging.getLogger(__name__)

_UID_BYTES = 128
_UNSIGNED, _SIGNED, _AS_BYTES = 0, 1, 2


def pack_unique_id(uid: bytes | Sequence[int]) -> bytes:
    """The unique id as one kind byte (how this cupy returned it: bytes, signed or unsigned chars)
    followed by its 128 bytes."""
    if len(uid) != _UID_BYTES:
        raise ValueError(f"an NCCL unique id has {_UID_BYTES} bytes, got {len(uid)}")
    if isinstance(uid, (bytes, bytearray)):
        return bytes([_AS_BYTES]) + bytes(uid)
    kind = _SIGNED if any(v < 0 for v in uid) else _UNSIGNED
    return bytes([kind]) + bytes(v & 0xFF for v in uid)


def unpack_unique_id(raw: bytes) -> bytes | tuple[int, ...]:
    """The inverse of :func:`pack_unique_id`, in the form the publishing rank's cupy used."""
    if len(raw) != _UID_BYTES + 1 or raw[0] not in (_UNSIGNED, _SIGNED, _AS_BYTES):
        raise ValueError(f"malformed NCCL unique id record ({len(raw)} bytes)")
    if raw[0] == _AS_BYTES:
        return raw[1:]
    return struct.unpack(f"{_UID_BYTES}{'b' if raw[0] == _SIGNED else 'B'}", raw[1:])


def share_gpu_env(
    topology: Topology, rank: int, num_devices: int, environ: MutableMapping[str, str] | None = None
) -> bool:
    """Let ranks of one host share GPUs: NCCL refuses two ranks on one device ("Duplicate GPU
    detected"), so when this host runs more ranks than it has devices each rank gets its own
    ``NCCL_HOSTID`` (NCCL then joins them over its socket transport, on ``lo`` when the whole
    world is on one host). Must run before the process's first NCCL call; a value the user set
    wins. Returns whether it changed anything."""
    env = os.environ if environ is None else environ
    me = topology.ranks[rank]
    num_local = sum(1 for r in topology.ranks if r.host_id == me.host_id)
    if num_local <= num_devices or "NCCL_HOSTID" in env:
        return False
    env["NCCL_HOSTID"] = f"{me.host_id}-rank{rank}"
    if topology.same_host(range(topology.world_size)):
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    log.info("%d ranks on %d GPU(s) of host %s: NCCL_HOSTID set per rank", num_local, num_devices, me.host_id)
    return True


def _peer_may_be_lost(exc: BaseException) -> bool:
    """ncclRemoteError (6) or ncclSystemError (2): a peer that died closes its sockets, and NCCL reports
    that before the coordinator's heartbeat timeout names the dead rank."""
    status = getattr(exc, "status", None)
    return status in (2, 6) or any(name in str(exc) for name in ("REMOTE_ERROR", "SYSTEM_ERROR"))


def _nccl() -> Any:
    from cupy.cuda import nccl

    return nccl


NCCL_OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
"""The collectives NCCL runs; the engine stages the others through a host transport."""

_NCCL_DTYPES = {
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
    "uint8": "NCCL_UINT8",
}


def nccl_moves(dtype: Any) -> bool:
    """Whether NCCL moves ``dtype`` natively; the rest (bool, bfloat16) are staged through host memory."""
    return dtype_name(dtype) in _NCCL_DTYPES


def _dtype(x: Any) -> int:
    name = dtype_name(x.dtype)
    if name not in _NCCL_DTYPES:
        raise ValueError(f"the NCCL transport does not move {name}; use one of {', '.join(_NCCL_DTYPES)}")
    return int(getattr(_nccl(), _NCCL_DTYPES[name]))


def _redop(op: str) -> int:
    nccl = _nccl()
    return {
        "sum": nccl.NCCL_SUM,
        "product": nccl.NCCL_PROD,
        "min": nccl.NCCL_MIN,
        "max": nccl.NCCL_MAX,
    }[op]


def capture_stream() -> int:
    """The caller's current CUDA stream; an op issued now runs on it even from another thread."""
    import cupy

    return int(cupy.cuda.get_current_stream().ptr)


@contextlib.contextmanager
def on_stream(x: Any, stream_ptr: int) -> Iterator[None]:
    """Make ``x``'s device and the captured stream current in this (possibly worker) thread."""
    import cupy

    with x.device, cupy.cuda.ExternalStream(stream_ptr):
        yield


class NcclComm:
    """One group's NCCL communicator: the ``Comm`` for cupy arrays of one host's ranks.

    all_reduce, broadcast, all_gather and reduce_scatter run on NCCL; the engine stages gather,
    scatter, barrier and the dtypes NCCL lacks through a host transport instead.
    """

    name: Transport = "nccl"
    device = True

    def __init__(self, comm: Any, size: int) -> None:
        self.comm = comm
        self.size = size
        # abort() may run on an actor or the abort thread while the runtime's heartbeat polls async_error()
        # on the loop: the poll must never touch a communicator being (or already) torn down.
        self._lock = threading.Lock()
        self._aborted = False

    @classmethod
    async def create(
        cls, kv: Any, name: str, ranks: Sequence[int], index: int, device: int, timeout_s: float = 300.0
    ) -> NcclComm:
        nccl = _nccl()
        key = f"nccl/{name}"
        if index == 0:
            uid = nccl.get_unique_id()
            await kv.kv_set(key, pack_unique_id(uid))
        else:
            raw = await kv.kv_get(key, wait=True, timeout_s=timeout_s)
            assert raw is not None
            uid = unpack_unique_id(raw)

        def build() -> Any:
            import cupy

            with cupy.cuda.Device(device):
                return nccl.NcclCommunicator(len(ranks), uid, index)

        # NCCL's init blocks until every member joins and cannot be cancelled: a daemon thread keeps a
        # member that never comes from holding this process open at exit.
        try:
            comm = await within(on_daemon_thread(build, name=f"nccl-init-{name}"), timeout_s)
        except TimeoutError:
            raise CollectiveTimeout(
                f"NCCL communicator for group {name!r} not formed within {timeout_s:.0f} s: "
                f"a member of ranks {list(ranks)} never joined"
            ) from None
        return cls(comm, len(ranks))

    @staticmethod
    def _stream() -> int:
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)

    def _call(self, spec: OpSpec, method: str, *args: Any) -> None:
        """``comm.<method>(*args, stream)``; an NcclError becomes a DeviceCommError (the group fails)."""
        try:
            getattr(self.comm, method)(*args, self._stream())
        except _nccl().NcclError as exc:
            raise DeviceCommError(
                f"NCCL {method} failed in op {spec.seq} of group {spec.group!r}: {exc}"
            ) from None

    def async_error(self) -> DeviceCommError | None:
        """The communicator's asynchronous error (``ncclCommGetAsyncError``), if it has one."""
        check = getattr(self.comm, "check_async_error", None)
        if check is None or not self._lock.acquire(blocking=False):  # an abort is under way
            return None
        try:
            if not self._aborted:
                check()
        except _nccl().NcclError as exc:
            return DeviceCommError(f"NCCL communicator error: {exc}", peer_may_be_lost=_peer_may_be_lost(exc))
        finally:
            self._lock.release()
        return None

    def all_reduce(self, spec: OpSpec, flat: Any, op: str, deadline: float) -> None:
        self._call(spec, "allReduce", flat.data.ptr, flat.data.ptr, flat.size, _dtype(flat), _redop(op))

    def broadcast(self, spec: OpSpec, flat: Any, root: int, deadline: float) -> None:
        self._call(spec, "broadcast", flat.data.ptr, flat.data.ptr, flat.size, _dtype(flat), root)

    def all_gather(self, spec: OpSpec, piece: Any, out: Any, deadline: float) -> None:
        self._call(spec, "allGather", piece.data.ptr, out.data.ptr, piece.size, _dtype(piece))

    def reduce_scatter(
        self, spec: OpSpec, flat: Any, bounds: Bounds, op: str, out: Any, deadline: float
    ) -> None:
        """``out`` receives this rank's piece ``bounds[rank]`` of the reduction; pads uneven pieces."""
        import cupy

        piece = max(b - a for a, b in bounds)
        padded = cupy.zeros(piece * self.size, flat.dtype)
        for i, (a, b) in enumerate(bounds):
            padded[i * piece : i * piece + (b - a)] = flat[a:b]
        mine = cupy.empty(piece, flat.dtype)
        self._call(spec, "reduceScatter", padded.data.ptr, mine.data.ptr, piece, _dtype(flat), _redop(op))
        a, b = bounds[self.comm.rank_id()]
        out[...] = mine[: b - a]

    def _unsupported(self, op: str) -> None:
        raise AssertionError(f"the engine routes {op} of device arrays to a host transport")

    def gather(self, spec: OpSpec, piece: Any, root: int, out: Any, deadline: float) -> None:
        self._unsupported("gather")

    def scatter(
        self, spec: OpSpec, pieces: Sequence[Any] | None, root: int, out: Any, deadline: float
    ) -> None:
        self._unsupported("scatter")

    def all_to_all(self, spec: OpSpec, flat: Any, out: Any, deadline: float) -> None:
        self._unsupported("all_to_all")

    def all_to_allv(self, spec: OpSpec, flat: Any, out: Any, splits: Splits, deadline: float) -> None:
        self._unsupported("all_to_all")

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        self._unsupported("barrier")

    def abort(self) -> None:
        """Tear the communicator down (once; later calls and polls do nothing)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            try:
                self.comm.abort()
            except Exception:
                pass

    def close(self) -> None:
        self.abort()
