"""The error classes of the plane; every one is a ``paramplane.PlaneError``.

Messages say what happened and what to do next. Errors that name a rank keep
it in an attribute so that callers can act on it without parsing text.
"""

from __future__ import annotations


class PlaneError(Exception):
    """Base class of every error raised by paramplane."""


class RendezvousError(PlaneError):
    """The world could not be formed (join timeout, duplicate or extra joiner, bad config)."""


class AuthError(PlaneError):
    """A call carried no job token or the wrong one."""


class CoordinatorUnavailable(PlaneError):
    """The coordinator cannot be reached or stopped answering."""


class CollectiveTimeout(PlaneError, TimeoutError):
    """A collective or control call passed its deadline."""


class PeerLost(PlaneError):
    """A peer rank died or stopped making progress; ``rank`` names it (-1 if unknown)."""

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveMismatch(PlaneError):
    """Ranks issued different collectives (op, dtype, shape or argument) at the same sequence number."""


class WorldAborted(PlaneError):
    """The world was aborted (by the coordinator or another rank); ``rank`` names the culprit (-1 if none)."""

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank


class TransportError(PlaneError):
    """A data-plane stream failed for a reason other than a lost peer (malformed or oversized message)."""


class DeviceCommError(TransportError):
    """NCCL reported an error: a call failed, or a communicator hit an asynchronous error (a peer's
    failure, a network error). The group is failed and the world aborted, so every rank learns it.
    ``peer_may_be_lost``: NCCL's remote or system error, what a peer's death looks like from here."""

    def __init__(self, message: str, *, peer_may_be_lost: bool = False) -> None:
        super().__init__(message)
        self.peer_may_be_lost = peer_may_be_lost


class PlaneClosed(PlaneError):
    """The plane was shut down; no further operations are possible."""
