"""A pipeline's activations and gradients on threads of its own, off the training thread.

Right after a stage computes, whatever the training thread does before its next compute is idle
time of the pipeline, and a point-to-point send or receive through the group costs over a hundred
microseconds there (the interpreter runs on caches the stage's compute just filled). So the
training thread only hands each send to a sender thread, and takes each message it needs from
what receiver threads (one per sending rank) received while it computed: each receives its
sender's messages of the step in the order that rank sends them and files them by name, so a
stage may take them in another order than they were sent; for torch stages on the host a receiver also makes
each message's tensor (``begin``'s ``convert``), so that work is done while the stage computes and a stage
that waited for the message does not do it after waking. Once a step's first message of a kind and stage
has given the shape, the receiver makes the next one's array and tensor before that message comes (a
receive posted ahead), so the message's arrival costs only reading it into them.

A message is one array, or a tuple of arrays (a torch stage that returns several tensors, and their
gradients): each array goes as one of the group's messages, in order. The first message of a kind and stage
to a rank in the pipeline's life is preceded by one int64 (how many arrays its messages hold; -1: one array,
not a tuple), so each later step costs nothing for it; the number may not change from then on.

Every thread uses the group's own ``send`` and ``recv``: headers, ordering and failures are the group's. The threads hold no
reference to the pipeline and end when it is garbage collected; between transfers they hold no message
either, and they are not woken at interpreter exit (a torch tensor released by one of them while the
interpreter tears down aborts the process in torch's C++ deleter).

With ``poll_s`` the sender and receiver threads wait in slices of that length while a step runs (between
``begin`` and ``finish``) instead of sleeping until woken: on a shared host, code that has not run for a few
milliseconds runs many times slower than code that just ran (README: Pipeline bubble), and each dependent
transfer on the schedule's critical path pays that once per thread it crosses.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array
from paramplane.node.arrays import array_module, device_of, is_device, to_host
from paramplane.node.direct_lane import polling
from paramplane.node.errors import CollectiveMismatch, CollectiveTimeout
from paramplane.work import Work

_STOP = object()  # ends a thread
_END = object()  # ends a step's sends
_NOTHING = object()
BARE = -1
"""The count announced for messages of one array (not a tuple)."""
Payload = Array | tuple[Array, ...]


class Message(NamedTuple):
    """One message of a step: from group rank ``src``, ``kind`` ``"F"`` (an activation) or ``"B"`` (a gradient)
    of ``microbatch``, sent by stage ``stage``."""

    src: int
    kind: str
    stage: int
    microbatch: int


class _Failed(NamedTuple):
    exc: BaseException


class _Mailbox:
    """Where receiver threads file messages for the training thread.

    While the training thread waits for a message, the receiver that files it then waits until it was
    taken: otherwise that receiver would go straight on to its next receive, holding the interpreter's
    lock while the training thread, just woken, needs it to go on with the pipeline. Each such message
    carries its own lock, released whenever the training thread takes it out of the queue (into its hands or
    among the early ones), so no receiver waits for a message already dequeued and no wait outlives its
    message."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.awaited: Message | None = None

    def file(self, message: Message, value: Array) -> None:
        """(A receiver thread.) Hand ``value`` over; if the training thread waits for it, until it took it."""
        if self.awaited != message:
            self.items.put((message, value, None))
            return
        taken = threading.Lock()  # released by the training thread when it dequeues the message
        taken.acquire()
        self.items.put((message, value, taken))
        taken.acquire(timeout=1.0)  # bounded: the training thread may have taken another path (an error)

    def clear(self) -> None:
        """Drop what is filed (a failed step), releasing any receiver that waits for its message's taking."""
        while True:
            try:
                item = self.items.get(block=False)
            except queue.Empty:
                return
            if type(item) is not _Failed and item[2] is not None:
                item[2].release()


class Transfers:
    """The sender thread and the receiver threads of one pipeline over ``group``; ``poll_s`` > 0: they wait in
    slices of that many seconds while a step runs (see the module docstring)."""

    def __init__(self, group: ProcessGroup, poll_s: float = 0.0) -> None:
        self.group = group
        self._poll_s = poll_s
        self._stepping = threading.Event()  # between ``begin`` and ``finish``: the sender polls when asked to
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sent: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._box = _Mailbox()
        self._plans: dict[int, queue.SimpleQueue[Any]] = {}  # per sending rank, its receiver's work
        self._early: dict[Message, Payload] = {}  # received before the stage asked for them
        self._announced: dict[tuple[int, str, int], int] = {}  # (dst, kind, stage): arrays per message
        self._like: Any = None
        # Each receive waits at most the group's timeout, so a receiver files something within that.
        self._bound = group.timeout + 5.0
        _start(_send_loop, "send", group, self._outbox, self._sent, self._box, poll_s, self._stepping)
        # Not at interpreter exit: the threads (daemons, holding nothing) stay asleep while it tears down.
        weakref.finalize(self, _stop, self._outbox, self._plans).atexit = False

    def begin(
        self,
        incoming: Mapping[int, Sequence[Message]],
        like: Any,
        convert: Callable[[str, Array], Any] | None = None,
    ) -> None:
        """Start receiving a step's messages: ``incoming`` lists them per sending rank, in the order it sends
        them. The first message of each (kind, stage) takes the dtype and shape its header carries, later ones
        must match it (CollectiveMismatch otherwise). Messages arrive as host arrays and are taken on the
        device of ``like``; on the host, ``convert(kind, array)`` (if given) makes what ``take`` returns, on the
        receiver thread (off the training thread while it computes). It must be a view of ``array``: after the
        first message of a (kind, stage) in a step the receiver makes each next message's array and its
        ``convert`` before the message comes (a receive posted ahead), and the receive fills that array."""
        self._like = like if is_device(like) else None
        convert = convert if self._like is None else None
        self._early.clear()
        self._stepping.set()
        for src, plan in incoming.items():
            if not plan:
                continue
            if src not in self._plans:
                self._plans[src] = queue.SimpleQueue()
                _start(_receive_loop, f"recv-{src}", self.group, self._plans[src], self._box, self._poll_s)
            self._plans[src].put((plan, convert))

    def send(self, x: Payload, dst: int, kind: str, stage: int) -> None:
        """Send ``x`` (an array or a tuple of arrays, not touched again by the caller), ``kind`` ``"F"`` or ``"B"``
        of stage ``stage``, to group rank ``dst`` after every earlier send. A ValueError when a message of that
        kind and stage to ``dst`` held another number of arrays before (the receiver expects that many)."""
        count = len(x) if type(x) is tuple else BARE
        key = (dst, kind, stage)
        known = self._announced.get(key)
        if known is None:
            self._announced[key] = count
            self._outbox.put((np.array([count], np.int64), dst))
        elif known != count:
            what = "output" if kind == "F" else "input's gradient"
            raise ValueError(
                f"pipeline stage {stage}'s {what} was {_arrays(known)} and is {_arrays(count)} now: what a "
                "stage sends to the next keeps its number of tensors for the pipeline's life"
            )
        for part in x if type(x) is tuple else (x,):
            if type(part) is not np.ndarray and is_device(part):
                part = to_host(part)  # on the caller's stream, after the compute that made it
            self._outbox.put((part, dst))

    def take(self, message: Message) -> Payload:
        """``message`` (one of ``begin``'s) once it has come; raises a receive's (or a failed send's) error."""
        got = self._early.pop(message, None)
        box = self._box
        while got is None:
            try:
                item = box.items.get(block=False)
            except queue.Empty:
                box.awaited = message
                try:
                    item = box.items.get(timeout=self._bound)
                except queue.Empty:
                    raise CollectiveTimeout(
                        f"pipeline receive of {message} on group '{self.group.name}' not done after "
                        f"{self._bound:.0f} s"
                    ) from None
                finally:
                    box.awaited = None
            if type(item) is _Failed:
                raise item.exc
            if item[2] is not None:
                item[2].release()  # its receiver waits for this (see _Mailbox)
            if item[0] == message:
                got = item[1]
            else:
                self._early[item[0]] = item[1]
        if self._like is not None:
            with device_of(self._like):  # the stages' GPU, whichever is current on this thread
                xp = array_module(self._like)
                return tuple(xp.asarray(g) for g in got) if type(got) is tuple else xp.asarray(got)
        return got

    def abandon(self) -> None:
        """The step failed (the pipeline refuses further steps): its threads end once their current transfer
        has (each is bounded by the group's timeout) and drop what they hold, so neither they nor a failure
        they keep outlive the pipeline."""
        self._stepping.clear()
        _stop(self._outbox, self._plans)
        self._box.clear()
        self._early.clear()

    def finish(self) -> None:
        """Wait until every send of the step is done; raises the first send's error."""
        self._stepping.clear()
        self._outbox.put(_END)
        try:
            works = self._sent.get(timeout=self._bound)
        except queue.Empty:
            raise CollectiveTimeout(
                f"pipeline sends on group '{self.group.name}' not handed over after {self._bound:.0f} s"
            ) from None
        if type(works) is _Failed:
            raise works.exc
        for work in works:
            work.wait()


def _start(target: Any, what: str, *args: Any) -> None:
    threading.Thread(target=target, args=args, name=f"paramplane-pp-{what}", daemon=True).start()


def _stop(outbox: queue.SimpleQueue[Any], plans: dict[int, queue.SimpleQueue[Any]]) -> None:
    outbox.put(_STOP)
    for plan in plans.values():
        plan.put(_STOP)


def _send_loop(
    group: ProcessGroup,
    outbox: queue.SimpleQueue[Any],
    sent: queue.SimpleQueue[Any],
    box: _Mailbox,
    poll_s: float,
    stepping: threading.Event,
) -> None:
    works: list[Work[Any]] = []
    failure: _Failed | None = None
    while True:
        item: Any = _NOTHING
        while poll_s and item is _NOTHING and stepping.is_set():
            try:
                item = outbox.get(timeout=poll_s)
            except queue.Empty:
                pass
        if item is _NOTHING:
            item = outbox.get()
        if item is _STOP:
            return
        if item is _END:
            sent.put(failure or works)
            works, failure = [], None
        elif failure is None:
            try:
                works.append(_send(group, item))
            except BaseException as exc:  # raised by the training thread's next take, or at the step's end
                failure = _Failed(exc)
                box.items.put(failure)
        item = None  # hold no message while waiting (see _send)


def _send(group: ProcessGroup, item: tuple[Array, int]) -> Work[Any]:
    """Start sending ``item``'s array; no reference to it stays on this thread (its frame ends here). A torch
    tensor seen through DLPack held by a thread blocked here would be released by this thread at interpreter
    exit, when torch's C++ deleter cannot take the interpreter's lock: the process aborted ("terminate called
    without an active exception")."""
    x = item[0] if item[0].flags.c_contiguous else np.ascontiguousarray(item[0])
    return group.send(x, item[1], async_op=True)


def _receive_loop(group: ProcessGroup, plans: queue.SimpleQueue[Any], box: _Mailbox, poll_s: float) -> None:
    with polling(poll_s):  # it receives only while a step runs
        _receive_plans(group, plans, box)


def _receive_plans(group: ProcessGroup, plans: queue.SimpleQueue[Any], box: _Mailbox) -> None:
    counts: dict[tuple[str, int], int] = {}  # per (kind, stage): arrays per message, once announced
    while True:
        item = plans.get()
        if item is _STOP:
            return
        plan, convert = item
        got: Any = None
        shapes: dict[tuple[str, int, int], tuple[Any, tuple[int, ...]]] = {}
        for message in plan:
            try:
                count = counts.get((message.kind, message.stage))
                if count is None:
                    count = counts[(message.kind, message.stage)] = _count(
                        group.recv_array(message.src), message
                    )
                if count == BARE:
                    got = _receive(group, message, 0, shapes, convert)
                else:
                    got = tuple(_receive(group, message, i, shapes, convert) for i in range(count))
            except BaseException as exc:
                got = None
                box.items.put(_Failed(exc))
                break  # the group has failed: no later receive of this step can succeed
            box.file(message, got)
            got = item = None  # hold no message while waiting for the next plan (see _send)


def _receive(
    group: ProcessGroup,
    message: Message,
    part: int,
    shapes: dict[tuple[str, int, int], tuple[Any, tuple[int, ...]]],
    convert: Callable[[str, Array], Any] | None,
) -> Any:
    """Array ``part`` of ``message`` (converted): the first of its kind, stage and part in a step takes the
    dtype and shape of its header, the next ones are posted ahead."""
    got: Any = None
    buffer: Any = None
    try:
        known = shapes.get((message.kind, message.stage, part))
        if known is None:
            got = group.recv_array(message.src)
            shapes[(message.kind, message.stage, part)] = (got.dtype, got.shape)
            return convert(message.kind, got) if convert is not None else got
        # Posted before the message comes: its array (and what ``convert`` makes of it, a view) is made while
        # this thread waits, and the receive only fills it.
        buffer = np.empty(known[1], known[0])
        got = convert(message.kind, buffer) if convert is not None else buffer
        group.recv(buffer, message.src)
        return got
    except BaseException:
        got = buffer = None  # a tensor posted ahead is not kept past its failed receive (see _send)
        raise


def _count(announced: Array, message: Message) -> int:
    """The number of arrays per message of ``message``'s kind and stage, from the int64 its sender announced."""
    if announced.dtype != np.int64 or announced.shape != (1,) or int(announced[0]) < BARE:
        raise CollectiveMismatch(
            f"pipeline: the first message of kind {message.kind} from stage {message.stage} (group rank "
            f"{message.src}) should announce its number of arrays, got {announced.dtype} {announced.shape}: "
            "the ranks run different versions of the pipeline"
        )
    return int(announced[0])


def _arrays(count: int) -> str:
    return "one tensor" if count == BARE else f"a tuple of {count}"
