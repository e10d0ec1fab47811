"""paramplane: an asyncio + gRPC parameter plane for distributed training.

``pp.init()`` joins the world; ``world.group`` and ``world.new_group`` give
collectives; ``pp.nn`` / ``pp.optim`` hold the reference modules and optimizers.
"""

from paramplane import nn, optim
from paramplane.group import ProcessGroup
from paramplane.node.errors import (
    AuthError,
    CollectiveMismatch,
    CollectiveTimeout,
    CoordinatorUnavailable,
    PeerLost,
    PlaneClosed,
    PlaneError,
    RendezvousError,
    TransportError,
    WorldAborted,
)
from paramplane.work import Work
from paramplane.world import KVStore, World, init

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CoordinatorUnavailable",
    "KVStore",
    "PeerLost",
    "PlaneClosed",
    "PlaneError",
    "ProcessGroup",
    "RendezvousError",
    "TransportError",
    "Work",
    "World",
    "WorldAborted",
    "init",
    "nn",
    "optim",
]
