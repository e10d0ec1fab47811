"""A bounded FIFO of received frames that can be failed, waking its reader and writer at once."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Inbox:
    """Messages of one (source rank, stream key) pair, at most ``maxsize`` buffered.

    The stream handler ``put``s and blocks while the inbox is full, which stops it
    reading the gRPC stream and so lets HTTP/2 flow control hold the sender back:
    memory stays bounded. ``fail(exc)`` makes every pending and later call raise ``exc``.
    """

    def __init__(self, maxsize: int) -> None:
        assert maxsize > 0
        self._maxsize = maxsize
        self._items: deque[Any] = deque()
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[asyncio.Future[None]] = deque()
        self.error: BaseException | None = None

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
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                break
        return item

    async def put(self, item: Any) -> None:
        while len(self._items) >= self._maxsize:
            if self.error is not None:
                raise self.error
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            await fut
        if self.error is not None:
            raise self.error
        self._items.append(item)
        if self._getter is not None and not self._getter.done():
            self._getter.set_result(None)

    def fail(self, exc: BaseException, *, drain: bool = False) -> None:
        """Fail the inbox: waiters and later calls raise ``exc``.

        With ``drain`` (a sender that died after delivering), what it already delivered can
        still be read and ``get`` raises once the inbox is empty; otherwise it is dropped.
        """
        if self.error is None:
            self.error = exc
        if not drain:
            self._items.clear()
        waiters = [*self._putters, *([self._getter] if self._getter else [])]
        self._putters.clear()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
