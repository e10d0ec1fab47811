"""FSDP's options (the sharding strategy, mixed precision, CPU offload) and its measured memory accounting."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, dtype_name, is_floating
from paramplane.parallel.mesh import Mesh

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
MEMORY_KINDS = ("params_sharded", "params_gathered", "grads", "optim_state")


@dataclass(frozen=True)
class ShardingStrategy:
    """A strategy over a group of N ranks: a ``("replicate", "shard")`` mesh with shards of size S.

    full_shard and shard_grad_op use S = N; no_shard uses S = 1 (DDP-like); hybrid_shard and
    hybrid_shard_zero2 use S = ``intra_size`` (default: ranks per host). full_shard and hybrid_shard
    reshard a unit after its forward (unless ``reshard_after_forward`` says otherwise).
    """

    name: str
    shard_size: int
    reshard_after_forward: bool

    @classmethod
    def resolve(
        cls, name: str, group: ProcessGroup, intra_size: int | None, reshard_after_forward: bool | None
    ) -> ShardingStrategy:
        """The strategy ``name`` (one of ``STRATEGIES``) over ``group``; ValueError for a bad ``intra_size``."""
        reshard = (
            reshard_after_forward
            if reshard_after_forward is not None
            else name in ("full_shard", "hybrid_shard")
        )
        return cls(name, _shard_size(name, group, intra_size), reshard)

    def groups(self, group: ProcessGroup) -> tuple[Mesh, ProcessGroup, ProcessGroup]:
        """The mesh over ``group`` and its shard and replicate groups (made collectively)."""
        mesh = Mesh(group, dims=[("replicate", group.size // self.shard_size), ("shard", self.shard_size)])
        return mesh, mesh.group("shard"), mesh.group("replicate")


def _shard_size(strategy: str, group: ProcessGroup, intra_size: int | None) -> int:
    n = group.size
    if not strategy.startswith("hybrid"):
        if intra_size is not None:
            raise ValueError(f"intra_size applies to the hybrid strategies only, not {strategy!r}")
        return 1 if strategy == "no_shard" else n
    hosts = group.hosts()
    size = intra_size if intra_size is not None else len(hosts[0])
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
        raise ValueError(f"intra_size={size!r} must be a positive divisor of the group size {n}")
    for start in range(0, n, size):
        if not any(set(range(start, start + size)) <= set(h) for h in hosts):
            raise ValueError(
                f"intra_size={size} does not match the hosts: group ranks {start}..{start + size - 1} "
                f"do not share one host (ranks per host: {[len(h) for h in hosts]}); hybrid strategies "
                "shard inside a host and replicate across hosts"
            )
    return size


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for FSDP's communication and compute; the optimizer always steps the master shards.

    On CPU, ``"bfloat16"`` and ``"float16"`` are numpy dtypes (bfloat16 from ml_dtypes: numpy
    matmuls on it compute through float32, so it saves memory and bytes on the wire, not
    time). On cupy use ``"float16"`` (cupy has no bfloat16). torch dtypes are taken by name
    (``torch.bfloat16``), and ``FSDP(mixed_precision=...)`` also takes torch's own policies (FSDP2's
    ``MixedPrecisionPolicy``, FSDP1's ``MixedPrecision``: see :meth:`of`).
    """

    param_dtype: Any = None
    """Dtype of the gathered parameters and of the compute; None keeps the model's dtype."""
    reduce_dtype: Any = None
    """Dtype gradients are reduced in; None uses ``param_dtype``."""
    output_dtype: Any = None
    """Dtype the forward output is cast to; None leaves it as computed."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is None:
                continue
            if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
                value = str(value).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
            try:
                dt = DTYPES[value] if isinstance(value, str) and value in DTYPES else np.dtype(value)
                dtype_name(dt)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"MixedPrecision.{name}={value!r} is not a dtype the plane moves ({exc})"
                ) from None
            if not is_floating(dt):
                raise ValueError(f"MixedPrecision.{name} must be a floating dtype, got {dt}")
            object.__setattr__(self, name, dt)  # a numpy dtype from here on (bfloat16: ml_dtypes')

    @classmethod
    def of(cls, policy: Any) -> MixedPrecision:
        """``policy`` as a ``MixedPrecision``: itself, or torch's FSDP2 ``MixedPrecisionPolicy`` / FSDP1
        ``MixedPrecision`` read by their dtype fields (floating-point inputs are always cast to ``param_dtype``,
        FSDP2's ``cast_forward_inputs=True``; FSDP1's ``buffer_dtype`` is refused: buffers keep their dtype)."""
        if isinstance(policy, cls):
            return policy
        fields = ("param_dtype", "reduce_dtype")
        if not all(hasattr(policy, f) for f in fields):
            raise ValueError(
                f"mixed_precision must be a pp.MixedPrecision or torch's MixedPrecisionPolicy, got {policy!r}"
            )
        if getattr(policy, "buffer_dtype", None) is not None:
            raise ValueError("mixed_precision: buffer_dtype is not supported (buffers keep their dtype)")
        # FSDP1 casts the root's inputs by default (cast_root_forward_inputs), FSDP2 every module's
        if getattr(policy, "cast_root_forward_inputs", getattr(policy, "cast_forward_inputs", True)) is False:
            raise ValueError("mixed_precision: not casting the forward's inputs is not supported")
        return cls(policy.param_dtype, policy.reduce_dtype, getattr(policy, "output_dtype", None))


@dataclass(frozen=True)
class CPUOffload:
    """Keep shards, gradients and optimizer state in host memory (numpy, page-locked); compute on the device.

    For cupy models each unit's shard is copied to the GPU for its all-gather, gradients are
    reduce-scattered on the GPU and copied back, and the optimizer steps the numpy shards (like
    torch's ``CPUOffload(offload_params=True)``). numpy models already live in host memory, so it
    changes nothing for them.
    """

    params: bool = False
    """Offload the sharded parameters (and with them gradients and optimizer state)."""


class MemoryTracker:
    """Bytes FSDP holds per kind, current and peak (peaks since ``reset_peak``).

    Transient buffers (gathered parameters, flat gradients in flight) are counted as they are
    allocated and dropped; lasting ones (shards, their gradients, optimizer state) are measured
    from the live arrays by ``measure`` at every such event, so nothing drifts when a caller drops
    gradients or an optimizer creates state.
    """

    def __init__(self, measure: Callable[[], dict[str, int]]) -> None:
        self._measure = measure
        self._lock = threading.Lock()  # completion callbacks release transient bytes from other threads
        self.transient: dict[str, int] = dict.fromkeys(MEMORY_KINDS, 0)
        self.current: dict[str, int] = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak: dict[str, int] = dict.fromkeys(MEMORY_KINDS, 0)
        self.peak_total = 0

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.transient[kind] += int(nbytes)
            assert self.transient[kind] >= 0, (kind, self.transient[kind])
        self.update()

    def hold(self, kind: str, nbytes: int) -> Callable[[], None]:
        """Count ``nbytes`` of ``kind`` now; the returned callable uncounts them, once, from any thread.

        For a buffer a collective frees when it completes: its completion callback releases the count
        then, not when the training thread next looks (the peak would count it too long).
        """
        self.add(kind, nbytes)
        held = [int(nbytes)]

        def release() -> None:
            with self._lock:
                n, held[0] = held[0], 0
                self.transient[kind] -= n

        return release

    def update(self) -> None:
        lasting = self._measure()
        with self._lock:
            transient = dict(self.transient)
        for kind in MEMORY_KINDS:
            self.current[kind] = transient[kind] + lasting.get(kind, 0)
            self.peak[kind] = max(self.peak[kind], self.current[kind])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    def reset_peak(self) -> None:
        self.update()
        self.peak = dict(self.current)
        self.peak_total = sum(self.current.values())

    def snapshot(self) -> dict[str, Any]:
        self.update()
        out: dict[str, Any] = {k: {"current": self.current[k], "peak": self.peak[k]} for k in MEMORY_KINDS}
        out["total"] = {"current": sum(self.current.values()), "peak": self.peak_total}
        return out
