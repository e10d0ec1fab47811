"""The one interface every transport implements, and the names of transports.

A ``Comm`` runs the collectives of one group on flat, contiguous arrays it is handed
(``in``/``out`` explicit, a reduction ``op``, an absolute ``deadline`` on
``time.monotonic()``). It never divides for ``mean``: the engine passes ``"sum"`` and
divides once. Host comms (grpc, shm, hier, local) take numpy arrays; device comms
(nccl) take cupy arrays and enqueue on the current stream. Point-to-point ``send`` /
``recv`` belong to ``PointToPoint`` (the gRPC transport).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from paramplane.node.spec import OpSpec

TransportPolicy = Literal["auto", "grpc", "shm"]
"""What a user configures (``PARAMPLANE_TRANSPORT``): let the engine choose, or force one."""
POLICIES: tuple[TransportPolicy, ...] = ("auto", "grpc", "shm")

Transport = Literal["local", "shm", "nccl", "grpc", "hier"]
"""The transport that ran one op (recorded in the trace)."""

Array = Any
Bounds = list[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Splits:
    """An uneven ``all_to_allv``'s pieces in elements: ``counts[i][j]`` from group index ``i`` to index ``j``
    (every rank holds the whole table, the same on every rank)."""

    counts: tuple[tuple[int, ...], ...]

    def sends(self, i: int) -> tuple[int, ...]:
        """What index ``i`` sends each index: its input's consecutive pieces."""
        return self.counts[i]

    def receives(self, j: int) -> tuple[int, ...]:
        """What index ``j`` receives from each index: its output's consecutive pieces."""
        return tuple(row[j] for row in self.counts)

    @staticmethod
    def starts(sizes: Sequence[int]) -> list[int]:
        """Where each of ``sizes``' consecutive pieces begins."""
        out, at = [], 0
        for size in sizes:
            out.append(at)
            at += size
        return out


class Comm(Protocol):
    """The collectives of one group over one transport (see the module docstring)."""

    name: Transport
    device: bool
    """True when the comm moves device (cupy) arrays itself; host comms get staged numpy copies."""

    def all_reduce(self, spec: OpSpec, flat: Array, op: str, deadline: float) -> None:
        """Reduce ``flat`` in place across the group."""

    def broadcast(self, spec: OpSpec, flat: Array, root: int, deadline: float) -> None:
        """Overwrite ``flat`` with group rank ``root``'s."""

    def all_gather(self, spec: OpSpec, piece: Array, out: Array, deadline: float) -> None:
        """``out`` (size ``n * piece.size``) receives every rank's ``piece`` in rank order."""

    def reduce_scatter(
        self, spec: OpSpec, flat: Array, bounds: Bounds, op: str, out: Array, deadline: float
    ) -> None:
        """``out`` receives the reduction of this rank's piece ``bounds[rank]`` of ``flat`` (unchanged)."""

    def gather(self, spec: OpSpec, piece: Array, root: int, out: Array | None, deadline: float) -> None:
        """On ``root``, ``out`` receives every rank's ``piece`` in rank order."""

    def scatter(
        self, spec: OpSpec, pieces: Sequence[Array] | None, root: int, out: Array, deadline: float
    ) -> None:
        """``out`` receives ``pieces[rank]`` of ``root``."""

    def all_to_allv(self, spec: OpSpec, flat: Array, out: Array, splits: Splits, deadline: float) -> None:
        """``flat`` holds ``n`` consecutive pieces, piece ``j`` (``splits.sends(rank)[j]`` elements) for group index
        ``j``; ``out`` receives index ``j``'s piece for this rank (``splits.receives(rank)[j]`` elements) at
        piece ``j``."""

    def all_to_all(self, spec: OpSpec, flat: Array, out: Array, deadline: float) -> None:
        """``flat`` holds ``n`` equal pieces, piece ``j`` for group index ``j``; ``out`` (the same size) receives
        rank ``j``'s piece for this rank at piece ``j``."""

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        """Return once every rank of the group has entered."""

    def abort(self) -> None:
        """After a failure: release whatever the transport holds queued (idempotent)."""

    def close(self) -> None:
        """Release the transport's resources (idempotent)."""


class PointToPoint(Protocol):
    """Messages between two ranks of a group, paired in issue order per direction; each starts once the ones
    before it in its direction are done, and ``begin(seq)`` (called then, with the message's number in its
    direction) gives its spec."""

    def start_send(
        self, flat: Array, dst: int, begin: Callable[[int], OpSpec]
    ) -> concurrent.futures.Future[None] | None:
        """None: sent already."""

    def start_recv(
        self, flat: Array | None, src: int, begin: Callable[[int], OpSpec]
    ) -> concurrent.futures.Future[Array]: ...


class LocalComm:
    """A group of one: every collective is a copy (or nothing)."""

    name: Transport = "local"
    device = True  # works on numpy and cupy arrays alike

    def all_reduce(self, spec: OpSpec, flat: Array, op: str, deadline: float) -> None:
        return None

    def broadcast(self, spec: OpSpec, flat: Array, root: int, deadline: float) -> None:
        return None

    def all_gather(self, spec: OpSpec, piece: Array, out: Array, deadline: float) -> None:
        out[...] = piece

    def reduce_scatter(
        self, spec: OpSpec, flat: Array, bounds: Bounds, op: str, out: Array, deadline: float
    ) -> None:
        out[...] = flat

    def gather(self, spec: OpSpec, piece: Array, root: int, out: Array | None, deadline: float) -> None:
        assert out is not None
        out[...] = piece

    def scatter(
        self, spec: OpSpec, pieces: Sequence[Array] | None, root: int, out: Array, deadline: float
    ) -> None:
        assert pieces is not None
        out[...] = pieces[0]

    def all_to_all(self, spec: OpSpec, flat: Array, out: Array, deadline: float) -> None:
        out[...] = flat

    def all_to_allv(self, spec: OpSpec, flat: Array, out: Array, splits: Splits, deadline: float) -> None:
        out[...] = flat

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        return None

    def abort(self) -> None:
        return None

    def close(self) -> None:
        return None
