"""How a failure travels between ranks: as ``Kind[rank]: text`` in gRPC status details (text by nature)
and as a typed ``Failure`` message in error frames."""

from __future__ import annotations

from paramplane.node.errors import CollectiveMismatch, PeerLost, PlaneError, TransportError, WorldAborted
from paramplane.protos import peer_pb2

# The failures that cross the wire by name; any other reads as a TransportError.
KINDS: dict[str, type[PlaneError]] = {
    "CollectiveMismatch": CollectiveMismatch,
    "WorldAborted": WorldAborted,
    "TransportError": TransportError,
    "PeerLost": PeerLost,
}


def _describe(exc: BaseException) -> tuple[str, int]:
    kind = type(exc).__name__ if type(exc).__name__ in KINDS else "TransportError"
    rank = getattr(exc, "rank", None)
    return kind, rank if isinstance(rank, int) and rank >= 0 else -1


def _make(kind: str, rank: int, text: str, default: type[PlaneError] = TransportError) -> PlaneError:
    cls = KINDS.get(kind, default)
    if cls is PeerLost:
        return PeerLost(text, rank)
    if cls is WorldAborted:
        return WorldAborted(text, rank)
    return cls(text)


def encode_failure(exc: BaseException) -> str:
    """``Kind: message``, or ``Kind[rank]: message`` for errors that name a rank."""
    kind, rank = _describe(exc)
    return f"{kind}[{rank}]: {exc}" if rank >= 0 else f"{kind}: {exc}"


def decode_failure(text: str, default: type[PlaneError] = TransportError) -> PlaneError:
    head, _, message = text.partition(": ")
    kind, _, rank = head.partition("[")
    number = int(rank.rstrip("]")) if rank.rstrip("]").isdigit() else -1
    return _make(kind, number, message or text, default)


def failure_message(exc: BaseException) -> peer_pb2.Failure:
    """The typed failure an error frame carries."""
    kind, rank = _describe(exc)
    return peer_pb2.Failure(kind=kind, rank=rank, text=str(exc))


def from_failure_message(msg: peer_pb2.Failure) -> PlaneError:
    return _make(msg.kind, msg.rank, msg.text)
