"""The pipeline's transfer threads on a stand-in group: the mailbox handshake and what a failed step leaves."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from paramplane.node.errors import PeerLost
from paramplane.parallel.pipeline.transfers import Message, Transfers


class _FailingGroup(SimpleNamespace):
    """What Transfers uses of a group; every send fails as a lost peer's would."""

    def __init__(self) -> None:
        super().__init__(timeout=30.0, name="stand-in")

    def send(self, x: Any, dst: int, *, async_op: bool = False) -> Any:
        raise PeerLost(f"rank {dst} was lost: stand-in", dst)


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.name.startswith("paramplane-pp-")]


def _until(condition: Any, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit_s} s: {what}"
        time.sleep(0.001)


def test_a_receiver_waiting_for_its_message_to_be_taken_is_released_when_it_is_dequeued() -> None:
    """The training thread waits for B; F comes first, then B, whose receiver waits to see B taken. Both are
    dequeued without blocking (F into the early ones): B's receiver is released at once, not after its 1 s
    bound (which stalled it, and the next message it had to file, before)."""
    transfers = Transfers(_FailingGroup())  # type: ignore[arg-type]
    box = transfers._box
    f, b = Message(0, "F", 0, 0), Message(1, "B", 2, 0)
    box.awaited = b  # take(b) is waiting
    box.file(f, np.zeros(1))  # not the awaited message: filed without waiting
    released = threading.Event()

    def receiver() -> None:
        box.file(b, np.ones(1))
        released.set()

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    _until(lambda: box.items.qsize() == 2, "B filed")
    box.awaited = None  # the training thread's blocking wait ended (it was woken by F)
    assert transfers.take(b).tolist() == [1.0]
    assert released.wait(0.9), "B's receiver still waits although B was taken"
    assert transfers.take(f).tolist() == [0.0]  # F waited among the early ones
    thread.join(5)


def test_a_failed_step_ends_the_transfer_threads_and_keeps_nothing_alive() -> None:
    """A send fails (its peer is lost): the next take raises that error; abandoning the step ends the sender
    thread, and nothing the threads hold keeps the transfers (and a step's activations) alive."""
    before = set(threading.enumerate())
    transfers = Transfers(_FailingGroup())  # type: ignore[arg-type]
    threads = _new_threads(before)
    assert [t.name for t in threads] == ["paramplane-pp-send"]
    transfers.begin({}, np.empty(0))
    transfers.send(np.ones(4), 1, "F", 0)
    with pytest.raises(PeerLost, match="rank 1 was lost"):
        transfers.take(Message(1, "B", 1, 0))
    transfers.abandon()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), f"{t.name} still runs after the failed step"
    ref = weakref.ref(transfers)
    del transfers
    gc.collect()
    assert ref() is None, gc.get_referrers(ref())


class _QueueGroup(SimpleNamespace):
    """What the receiver threads use of a group: each receive returns (or raises) the next of ``replies``."""

    def __init__(self, replies: list[Any]) -> None:
        super().__init__(timeout=30.0, name="stand-in", replies=replies, filled=[], returned=[])

    def recv_array(self, src: int) -> Any:
        return self._next()

    def recv(self, x: Any, src: int) -> Any:
        self.filled.append(x)
        got = self._next()
        x[...] = got
        return x

    def _next(self) -> Any:
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        self.returned.append(reply)
        return reply


def test_messages_are_converted_on_the_receiver_thread_and_its_errors_reach_take() -> None:
    """``begin(..., convert)``: what ``take`` returns is ``convert(kind, array)`` (a view of the array), made on
    the receiver thread (torch stages get their tensors made there while they compute); after the first message
    of a kind and stage, the next one's array and its conversion are made before the receive, which fills that
    very array (a receive posted ahead). A receive's error (a shape mismatch) and a conversion's error come out
    of the ``take`` of that message, typed, not as a hang."""
    from paramplane.node.errors import CollectiveMismatch

    seen: list[tuple[str, str, Any, int]] = []  # kind, thread, array, how many receives had filled one then

    def convert(kind: str, got: Any) -> Any:
        seen.append((kind, threading.current_thread().name, got, len(group.filled)))
        # a message received whole (not an array posted ahead, whose values are not there yet) that is negative
        if any(got is r for r in group.returned) and got.size and got[0] < 0:
            raise ValueError("cannot convert a negative message")
        return ("converted", kind, got)

    def took(message: Message) -> tuple[str, str, list[float]]:
        label, kind, got = transfers.take(message)
        return label, kind, got.tolist()

    f0, f1, b0 = Message(1, "F", 0, 0), Message(1, "F", 0, 1), Message(1, "B", 2, 0)
    one = _announce(-1)  # the first message of each kind and stage says it holds one array
    group = _QueueGroup([one, np.ones(2), np.full(2, 2.0), one, np.full(3, 3.0)])
    transfers = Transfers(group)  # type: ignore[arg-type]
    transfers.begin({1: [f0, f1, b0]}, np.empty(0), convert)
    assert took(b0) == ("converted", "B", [3.0, 3.0, 3.0])  # filed by name, out of order
    assert took(f0) == ("converted", "F", [1.0, 1.0])
    assert took(f1) == ("converted", "F", [2.0, 2.0])
    assert [(kind, thread) for kind, thread, _, _ in seen] == [
        ("F", "paramplane-pp-recv-1"),
        ("F", "paramplane-pp-recv-1"),
        ("B", "paramplane-pp-recv-1"),
    ]
    # f1, the second F of stage 0, was posted ahead: converted first, then received into that same array.
    assert not group.replies and seen[1][3] == 0 and len(group.filled) == 1 and group.filled[0] is seen[1][2]

    # Announced once in the pipeline's life: the next steps' messages come without it.
    group.replies[:] = [np.ones(2), CollectiveMismatch("shape (3,) where (2,) was expected")]
    transfers.begin({1: [f0, f1]}, np.empty(0), convert)
    assert took(f0) == ("converted", "F", [1.0, 1.0])
    with pytest.raises(CollectiveMismatch, match="shape"):
        transfers.take(f1)

    group.replies[:] = [np.full(2, -1.0)]
    transfers.begin({1: [f0]}, np.empty(0), convert)
    with pytest.raises(ValueError, match="negative"):
        transfers.take(f0)
    transfers.abandon()


def _announce(count: int) -> Any:
    return np.array([count], np.int64)


def test_a_tuple_of_arrays_crosses_as_its_parts_and_keeps_its_number() -> None:
    """A stage with several outputs: the sender announces how many arrays its messages hold once (the first
    message of that kind and stage to that rank), then sends each array; the receiver hands ``take`` the
    tuple, each part converted, and posts every part of the next microbatch ahead. A later message with
    another number of arrays is a ValueError on the sender; an announcement that is not one is a
    CollectiveMismatch out of ``take``, not a hang or a wrong tuple."""
    from paramplane.node.errors import CollectiveMismatch

    class _Recording(SimpleNamespace):
        def send(self, x: Any, dst: int, *, async_op: bool = False) -> Any:
            self.sent.append((x.copy(), dst))
            return SimpleNamespace(wait=lambda: None)

    out = _Recording(timeout=30.0, name="stand-in", sent=[])
    sender = Transfers(out)  # type: ignore[arg-type]
    sender.begin({}, np.empty(0))
    sender.send((np.ones(2), np.arange(3)), 1, "F", 0)
    sender.send((np.zeros(2), np.arange(3)), 1, "F", 0)
    sender.send(np.ones(1), 1, "B", 0)  # another kind: announced on its own
    with pytest.raises(ValueError, match="was a tuple of 2 and is one tensor now"):
        sender.send(np.ones(2), 1, "F", 0)
    sender.finish()
    assert [(x.tolist(), dst) for x, dst in out.sent] == [
        ([2], 1),
        ([1.0, 1.0], 1),
        ([0, 1, 2], 1),
        ([0.0, 0.0], 1),
        ([0, 1, 2], 1),
        ([-1], 1),
        ([1.0], 1),
    ]

    f0, f1 = Message(1, "F", 0, 0), Message(1, "F", 0, 1)
    group = _QueueGroup([_announce(2), np.ones(2), np.arange(3), np.zeros(2), np.arange(3) + 1])
    transfers = Transfers(group)  # type: ignore[arg-type]
    transfers.begin({1: [f0, f1]}, np.empty(0), lambda kind, got: ("converted", got))
    first, second = transfers.take(f0), transfers.take(f1)
    assert [(label, got.tolist()) for label, got in first] == [
        ("converted", [1.0, 1.0]),
        ("converted", [0, 1, 2]),
    ]
    assert [got.tolist() for _, got in second] == [[0.0, 0.0], [1, 2, 3]]
    assert [x is got for x, (_, got) in zip(group.filled, second, strict=True)] == [
        True,
        True,
    ]  # posted ahead

    group = _QueueGroup([np.ones(1)])  # a float64 where the announcement should be
    transfers = Transfers(group)  # type: ignore[arg-type]
    transfers.begin({1: [f0]}, np.empty(0))
    with pytest.raises(CollectiveMismatch, match="announce its number of arrays"):
        transfers.take(f0)
    transfers.abandon()
