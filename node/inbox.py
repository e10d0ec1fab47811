"""A bounded FIFO of received frames that can be failed, waking its reader and writer at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any


class Inbox:
    """Messages of one (source rank, stream key) pair, at most ``maxsize`` buffered.

    The stream handler ``put``s and blocks while the inbox is full, which stops it
    reading the gRPC stream and so lets HTTP/2 flow control hold the sender back:
    memory stays bounded. ``fail(exc)`` makes every pending and later call raise ``exc``.
    The reader is a coroutine on the loop (``get``) or, while none is reading, another thread
    (``get_blocking``), which the loop wakes itself (one thread wake-up per message, not two).
    """

    def __init__(self, maxsize: int) -> None:
        assert maxsize > 0
        self._maxsize = maxsize
        self._items: deque[Any] = deque()
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread_waiting = False
        self._putter_loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._items)

    async def get(self) -> Any:
        while not self._items:
            if self.error is not None:
                raise self.error
            assert self._getter is None, "one reader per inbox"
            self._getter = asyncio.get_running_loop().create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        item = self._items.popleft()
        self._wake_putter()
        return item

    def get_blocking(self, timeout: float) -> Any:
        """``get`` from a thread other than the loop's, waiting at most ``timeout`` seconds (TimeoutError)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            # Raised before looking at the items: a ``put`` that misses the flag appended before that look.
            self._thread_waiting = True
            try:
                while not self._items:
                    if self.error is not None:
                        raise self.error
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self._cond.wait(left)
                item = self._items.popleft()
                putter_loop = self._putter_loop if self._putters else None
            finally:
                self._thread_waiting = False
        if putter_loop is not None:
            putter_loop.call_soon_threadsafe(self._wake_putter)
        return item

    def _wake_putter(self) -> None:
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                break

    def _wake_thread(self) -> None:
        if self._thread_waiting:
            with self._cond:
                self._cond.notify()

    async def put(self, item: Any) -> None:
        while len(self._items) >= self._maxsize:
            if self.error is not None:
                raise self.error
            fut = asyncio.get_running_loop().create_future()
            with self._cond:  # a thread reader pops and looks for putters under it
                if len(self._items) < self._maxsize:
                    break
                self._putter_loop = fut.get_loop()
                self._putters.append(fut)
            await fut
        if self.error is not None:
            raise self.error
        self._items.append(item)
        if self._getter is not None and not self._getter.done():
            self._getter.set_result(None)
        self._wake_thread()

    def fail(self, exc: BaseException, *, drain: bool = False) -> None:
        """Fail the inbox: waiters and later calls raise ``exc``.

        With ``drain`` (a sender that died after delivering), what it already delivered can
        still be read and ``get`` raises once the inbox is empty; otherwise it is dropped.
        """
        with self._cond:  # not between a thread reader's look at the items and its pop
            if self.error is None:
                self.error = exc
            if not drain:
                self._items.clear()
        waiters = [*self._putters, *([self._getter] if self._getter else [])]
        self._putters.clear()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        self._wake_thread()
