"""paramplane: an asyncio + gRPC parameter plane for distributed training."""

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

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CoordinatorUnavailable",
    "PeerLost",
    "PlaneClosed",
    "PlaneError",
    "RendezvousError",
    "TransportError",
    "WorldAborted",
]
