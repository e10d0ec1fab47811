"""Runs one group's operations strictly in issue order.

A synchronous op issued while nothing is queued runs inline in the caller's
thread (no thread hop on the latency path); everything else goes through a
FIFO served by one worker thread. Issue order is fixed under one lock, and
the executing lock is taken in that order, so ops never overtake each other.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class OpActor:
    """A FIFO executor for one group; ``submit`` returns a future (async) or the result (sync)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._submit_lock = threading.Lock()
        self._exec_lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._num_pending = 0
        self._thread: threading.Thread | None = None
        self.issued = 0
        self.completed = 0

    def submit(self, fn: Callable[[int], T], *, async_op: bool) -> concurrent.futures.Future[T]:
        """Issue ``fn(seq)``; sync ops have finished (result or exception set) when this returns."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._submit_lock:
            self.issued += 1
            seq = self.issued
            inline = not async_op and self._num_pending == 0
            self._num_pending += 1
            if inline:
                self._exec_lock.acquire()
            else:
                self._queue.put((functools.partial(fn, seq), fut))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._serve, name=f"paramplane-{self.name}", daemon=True
                    )
                    self._thread.start()
        if inline:  # the future is nobody else's yet: it cannot be cancelled, so it is not marked running
            try:
                fut.set_result(fn(seq))
            except BaseException as exc:
                fut.set_exception(exc)
            finally:
                self._exec_lock.release()
                self._done()
        elif not async_op:
            concurrent.futures.wait([fut])
        return fut

    @staticmethod
    def _run(call: Callable[[], Any], fut: concurrent.futures.Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(call())
        except BaseException as exc:
            fut.set_exception(exc)

    def _done(self) -> None:
        with self._submit_lock:
            self._num_pending -= 1
            self.completed += 1

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, fut = item
            with self._exec_lock:
                self._run(call, fut)
            # The next get() may block for long: hold none of this op's arrays meanwhile (FSDP frees a
            # unit's flat gradient the moment its reduce-scatter is done).
            del item, call, fut
            self._done()

    def close(self) -> None:
        """Stop the worker after what is queued."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None
