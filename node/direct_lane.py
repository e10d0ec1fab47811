"""A data lane its receiving thread reads itself: point-to-point frames without the event loop.

Send/recv carry a pipeline's activations, and those are latency bound. Read by the event loop, a
frame costs two thread wake-ups (the loop's, then the receiving thread's: about 0.4 ms one way on a
busy 2-core host). For point-to-point keys the peer plane parks each accepted lane connection here
instead, and a receive reads its frame from the socket on its own thread: one wake-up, or none when
the frame came first. Frames wait in the kernel's socket buffers meanwhile; a sender whose frame does
not fit leaves the rest to its loop, so sends never wait for receives.

The plane still learns what the lane says: error frames, a goodbye, a connection that ends without
one (a lost peer), a malformed frame; the reader passes them to ``report``, which runs them on the
loop, and raises the matching error itself. A failure from elsewhere (the key failed, a peer was lost,
shutdown) reaches a reader waiting on the socket through ``fail``, which wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from paramplane.node.errors import PeerLost, PlaneError, TransportError
from paramplane.node.failures import from_failure_message
from paramplane.node.lane import FRAME_LENGTH
from paramplane.protos import peer_pb2

BUFFER_BYTES = 256 << 10


# select() takes descriptors below this only (FD_SETSIZE); a polling wait on others blocks instead.
_SELECTABLE_FDS = 1024
_MAX_POLL_MS = 2**31 - 1  # poll()'s limit; a longer wait polls again until its deadline
_polling = threading.local()


@contextlib.contextmanager
def polling(slice_s: float) -> Iterator[None]:
    """While inside, a read on this thread that waits for its lane waits in slices of ``slice_s`` seconds
    instead of until the lane wakes it: the thread runs its wait loop every slice, so the code that takes
    the frame is not cold when it comes (see ``Pipeline(poll_us=...)``). 0: no change."""
    before = getattr(_polling, "slice_s", 0.0)
    _polling.slice_s = slice_s
    try:
        yield
    finally:
        _polling.slice_s = before


class DirectLane:
    """One accepted lane connection (frames from rank ``src`` on ``key``), read by one thread at a time."""

    def __init__(
        self,
        sock: socket.socket,
        src: int,
        key: str,
        *,
        chunk_bytes: int,
        max_header_bytes: int,
        parse: Callable[[bytes], peer_pb2.FrameHeader],
        report: Callable[[str, Any], None],
    ) -> None:
        self.sock = sock
        self.src = src
        self.key = key
        self._chunk_bytes = chunk_bytes
        self._max_header_bytes = max_header_bytes
        self._parse = parse
        self._report = report
        self._buf = bytearray(BUFFER_BYTES)
        self._start = self._end = 0  # the bytes read but not yet taken
        self._chunks_left = 0
        self._payload_left = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._reading = threading.Lock()
        self.error: PlaneError | None = None
        self._drain = False

    def fail(self, exc: PlaneError, *, drain: bool = False) -> None:
        """Fail the lane (any thread): a reader raises ``exc`` at once or, with ``drain`` (the sender died
        after writing), once it has read everything the sender wrote."""
        if self.error is None:
            self._drain = drain  # first: a reader that sees the error must see how to treat it
            self.error = exc
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already woken (buffer full) or closed

    def next_item(self, timeout: float) -> peer_pb2.FrameHeader | memoryview:
        """The next frame header, or the next payload chunk of the current frame (a view valid until the next
        call), as the loop's reader delivers them; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._reading:
            item = self._next(deadline, None)
        assert not isinstance(item, tuple)
        return item

    def next_message(
        self, timeout: float, head: bytes, tail: bytes, nbytes: int
    ) -> tuple[int, memoryview] | peer_pb2.FrameHeader | memoryview:
        """``next_item``, but a frame that is ``head``, a varint, ``tail`` and ``nbytes`` more bytes (a small
        message of a known kind: ``node/frame_template.py``) comes as (the varint, those bytes), unparsed; the bytes are
        a view valid until the next call."""
        deadline = time.monotonic() + timeout
        with self._reading:
            return self._next(deadline, (head, tail, nbytes))

    def _next(
        self, deadline: float, expected: tuple[bytes, bytes, int] | None
    ) -> tuple[int, memoryview] | peer_pb2.FrameHeader | memoryview:
        if self.error is not None and not self._drain:
            raise self.error
        if self._chunks_left:
            size = min(self._chunk_bytes, self._payload_left)
            view = self._take(size, deadline)
            self._chunks_left -= 1
            self._payload_left -= size
            return view
        (size,) = FRAME_LENGTH.unpack(self._take(FRAME_LENGTH.size, deadline))
        if size > self._max_header_bytes:
            raise self._malformed(f"frame header of {size} bytes, the limit is {self._max_header_bytes}")
        raw = self._take(size, deadline)
        if expected is not None:
            head, tail, nbytes = expected
            if raw[: len(head)] == head:
                i, number, shift = len(head), 0, 0
                while i < size:
                    byte = raw[i]
                    i += 1
                    number |= (byte & 0x7F) << shift
                    if byte < 0x80:
                        break
                    shift += 7
                # A number past int64 is left to the parser, which reads it as protobuf does.
                # An overlong varint (over 10 bytes) is left to the parser too, which refuses it.
                if (
                    size - i - len(tail) == nbytes
                    and raw[i : i + len(tail)] == tail
                    and number < 1 << 63
                    and i - len(head) <= 10
                ):
                    return number, raw[i + len(tail) :]
        try:
            header = self._parse(bytes(raw))
        except Exception as exc:
            raise self._malformed(str(exc)) from None
        if header.end_of_stream:
            self._report("header", header)
            raise self._failed(
                PeerLost(
                    f"rank {self.src} shut down: it sent nothing more for group '{self.key}' before leaving",
                    self.src,
                )
            )
        if header.HasField("failure"):
            self._report("header", header)
            raise self._failed(from_failure_message(header.failure))
        self._chunks_left = header.num_chunks
        self._payload_left = header.nbytes if header.num_chunks else 0
        return header

    def _take(self, n: int, deadline: float) -> memoryview:
        if self._end - self._start < n:
            self._fill(n, deadline)
        view = memoryview(self._buf)[self._start : self._start + n]
        self._start += n
        return view

    def _fill(self, n: int, deadline: float) -> None:
        """Read until ``n`` bytes are buffered (one reader: no lock needed inside ``next_item``)."""
        if len(self._buf) < n:
            self._buf = self._buf[self._start : self._end] + bytearray(n - (self._end - self._start))
            self._end -= self._start
            self._start = 0
        elif self._start + n > len(self._buf):
            kept = self._end - self._start
            self._buf[:kept] = self._buf[self._start : self._end]
            self._start, self._end = 0, kept
        while self._end - self._start < n:
            if self.error is not None and not self._drain:
                raise self.error
            try:
                got = self.sock.recv_into(memoryview(self._buf)[self._end :])
            except BlockingIOError:
                self._wait(deadline)
                continue
            except OSError:
                got = 0  # reset, or closed under us at shutdown
            if got == 0:
                raise self._ended()
            self._end += got

    def _wait(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        slice_s = getattr(_polling, "slice_s", 0.0)
        if slice_s and max(self.sock.fileno(), self._wake_r.fileno()) < _SELECTABLE_FDS:
            ready = select.select([self.sock, self._wake_r], [], [], min(left, slice_s))[0]
            if self._wake_r in ready:
                self._drain_wake()
            return
        for fd, _ in self._poll.poll(min(max(1, int(left * 1000) + 1), _MAX_POLL_MS)):
            if fd == self._wake_r.fileno():
                self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except OSError:
            pass

    def _ended(self) -> PlaneError:
        """The connection ended: after a drain, the failure it was failed with; else the peer is lost."""
        if self.error is not None:
            return self.error
        why = "its data lane ended without a goodbye (process died or network failed)"
        self._report("lost", why)
        return self._failed(PeerLost(f"rank {self.src} was lost: {why}", self.src))

    def _malformed(self, text: str) -> PlaneError:
        exc = TransportError(f"malformed frame from rank {self.src} on its data lane: {text}")
        self._report("malformed", exc)
        return self._failed(exc)

    def _failed(self, exc: PlaneError) -> PlaneError:
        if self.error is None:
            self.error = exc
        return self.error

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


class DirectLanes:
    """The peer plane's parked lanes: which keys are read directly, and each (source, key)'s lane.

    Lanes are parked and failed on the loop; ``get`` is safe from any thread.
    """

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self._lanes: dict[tuple[int, str], DirectLane] = {}
        self._waiters: dict[tuple[int, str], asyncio.Future[DirectLane]] = {}
        self.gone: set[int] = set()  # ranks that left the world: no lane, and nothing more, comes from them

    def get(self, src: int, key: str) -> DirectLane | None:
        return self._lanes.get((src, key))

    async def wait(self, src: int, key: str) -> DirectLane:
        """The lane of (``src``, ``key``) once its sender has connected (failed with the key, or PeerLost once
        ``src`` has left without opening it)."""
        lane = self._lanes.get((src, key))
        if lane is not None:
            return lane
        if src in self.gone:
            raise left_without_sending(src, key)
        fut = self._waiters.get((src, key))
        if fut is None or fut.done():
            fut = self._waiters[(src, key)] = asyncio.get_running_loop().create_future()
        return await asyncio.shield(fut)

    def park(self, lane: DirectLane, failure: PlaneError | None) -> None:
        if failure is not None:
            lane.fail(failure)
        old = self._lanes.get((lane.src, lane.key))
        if old is not None:
            old.fail(TransportError(f"rank {lane.src} opened a second data lane for group '{lane.key}'"))
        self._lanes[(lane.src, lane.key)] = lane
        fut = self._waiters.pop((lane.src, lane.key), None)
        if fut is not None and not fut.done():
            fut.set_result(lane)

    def unpark(self, lane: DirectLane, exc: PlaneError) -> None:
        lane.fail(exc)
        if self._lanes.get((lane.src, lane.key)) is lane:
            del self._lanes[(lane.src, lane.key)]

    def sender_left(self, src: int) -> None:
        """Rank ``src`` left the world and its plane has flushed what it sent: a lane it has not opened by now
        never comes, so whoever waits for one fails (on the loop)."""
        self.gone.add(src)
        for (rank, key), fut in list(self._waiters.items()):
            if rank == src:
                del self._waiters[(rank, key)]
                if not fut.done():
                    fut.set_exception(left_without_sending(src, key))
                    fut.add_done_callback(_retrieve)

    def fail_key(self, key: str, exc: PlaneError, lost: int) -> None:
        for (src, k), lane in self._lanes.items():
            if k == key:
                lane.fail(exc, drain=src == lost)
        for (src, k), fut in list(self._waiters.items()):
            if k == key:
                del self._waiters[(src, k)]
                if not fut.done():
                    fut.set_exception(exc)
                    fut.add_done_callback(_retrieve)


def left_without_sending(src: int, key: str) -> PeerLost:
    """What a receive from ``src`` on ``key`` raises once ``src`` has left and nothing more can come."""
    return PeerLost(
        f"rank {src} left the world without sending anything more on group '{key}' to this rank", src
    )


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
