"""All-reduce across hosts composed of two transports: an intra-host reduce-scatter, an
inter-host all-reduce of each shard, an intra-host all-gather.

Each host's ranks are one ``local`` group; the i-th ranks of every host form one ``cross``
group. Both are any ``Comm`` (today shm inside a host and gRPC across hosts), so the
cross-host bytes shrink by the number of ranks per host. Every other collective of the
group runs on its ``flat`` comm.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paramplane.node.spec import OpSpec
from paramplane.node.transports.base import Bounds, Comm, Splits, Transport


class HierarchicalComm:
    """A ``Comm`` whose all-reduce is hierarchical and whose other ops run on ``flat``."""

    name: Transport = "hier"
    device = False

    def __init__(self, local: Comm, cross: Comm, num_local: int, flat: Comm) -> None:
        self.local = local
        self.cross = cross
        self.num_local = num_local
        self.flat = flat

    def all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str, deadline: float) -> None:
        n = self.num_local
        piece = -(-flat.size // n)
        padded = np.zeros(piece * n, flat.dtype)
        padded[: flat.size] = flat
        bounds = [(i * piece, (i + 1) * piece) for i in range(n)]
        mine = np.empty(piece, flat.dtype)
        self.local.reduce_scatter(spec, padded, bounds, op, mine, deadline)
        # The op's own shape, not the piece's: hosts whose sizes round to one piece must still mismatch.
        cross_spec = OpSpec(
            f"{spec.group}/cross", spec.seq, "all_reduce", spec.dtype, spec.shape, f"{op}|{piece}"
        )
        self.cross.all_reduce(cross_spec, mine, op, deadline)
        self.local.all_gather(spec, mine, padded, deadline)
        flat[...] = padded[: flat.size]

    def broadcast(self, spec: OpSpec, flat: np.ndarray, root: int, deadline: float) -> None:
        self.flat.broadcast(spec, flat, root, deadline)

    def all_gather(self, spec: OpSpec, piece: np.ndarray, out: np.ndarray, deadline: float) -> None:
        self.flat.all_gather(spec, piece, out, deadline)

    def reduce_scatter(
        self, spec: OpSpec, flat: np.ndarray, bounds: Bounds, op: str, out: np.ndarray, deadline: float
    ) -> None:
        self.flat.reduce_scatter(spec, flat, bounds, op, out, deadline)

    def gather(
        self, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None, deadline: float
    ) -> None:
        self.flat.gather(spec, piece, root, out, deadline)

    def scatter(
        self, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray, deadline: float
    ) -> None:
        self.flat.scatter(spec, pieces, root, out, deadline)

    def all_to_all(self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, deadline: float) -> None:
        self.flat.all_to_all(spec, flat, out, deadline)

    def all_to_allv(
        self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, splits: Splits, deadline: float
    ) -> None:
        self.flat.all_to_allv(spec, flat, out, splits, deadline)

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        self.flat.barrier(spec, deadline)

    def abort(self) -> None:
        for comm in (self.local, self.cross, self.flat):
            comm.abort()

    def close(self) -> None:
        for comm in (self.local, self.cross):
            comm.close()
