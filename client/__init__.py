"""paramplane: an asyncio + gRPC parameter plane for distributed training.

``pp.init()`` joins the world; ``world.group`` and ``world.new_group`` give
collectives; ``pp.nn`` / ``pp.optim`` hold the reference modules and optimizers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from paramplane.node.errors import (
    AuthError,
    CollectiveMismatch,
    CollectiveTimeout,
    CoordinatorUnavailable,
    DeviceCommError,
    PeerLost,
    PlaneClosed,
    PlaneError,
    RendezvousError,
    TransportError,
    WorldAborted,
)

if TYPE_CHECKING:
    from paramplane import checkpoint, nn, optim
    from paramplane.group import ProcessGroup
    from paramplane.parallel.ddp import DDP, shard_range
    from paramplane.parallel.diloco import DiLoCo
    from paramplane.parallel.fsdp import FSDP, CPUOffload, MixedPrecision, units_by_class
    from paramplane.parallel.mesh import Mesh
    from paramplane.parallel.pipeline import Pipeline
    from paramplane.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    from paramplane.work import Work
    from paramplane.world import KVStore, World, init

# Heavy parts (grpc, numpy, the runtime) load on first use, so the CLI starts fast.
_LAZY = {
    "DDP": "paramplane.parallel.ddp",
    "DiLoCo": "paramplane.parallel.diloco",
    "shard_range": "paramplane.parallel.ddp",
    "Mesh": "paramplane.parallel.mesh",
    "FSDP": "paramplane.parallel.fsdp",
    "units_by_class": "paramplane.parallel.fsdp",
    "ColumnParallelLinear": "paramplane.parallel.tensor",
    "Pipeline": "paramplane.parallel.pipeline",
    "RowParallelLinear": "paramplane.parallel.tensor",
    "MixedPrecision": "paramplane.parallel.fsdp",
    "CPUOffload": "paramplane.parallel.fsdp",
    "nn": "paramplane.nn",
    "checkpoint": "paramplane.checkpoint",
    "optim": "paramplane.optim",
    "ProcessGroup": "paramplane.group",
    "Work": "paramplane.work",
    "KVStore": "paramplane.world",
    "World": "paramplane.world",
    "init": "paramplane.world",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'paramplane' has no attribute {name!r}")
    value = (
        importlib.import_module(module)
        if module.endswith(f".{name}")
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "DDP",
    "FSDP",
    "AuthError",
    "CPUOffload",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "ColumnParallelLinear",
    "CoordinatorUnavailable",
    "DeviceCommError",
    "DiLoCo",
    "KVStore",
    "Mesh",
    "MixedPrecision",
    "PeerLost",
    "Pipeline",
    "PlaneClosed",
    "PlaneError",
    "ProcessGroup",
    "RendezvousError",
    "RowParallelLinear",
    "TransportError",
    "Work",
    "World",
    "WorldAborted",
    "checkpoint",
    "init",
    "nn",
    "optim",
    "shard_range",
    "units_by_class",
]
