"""torch ``Work`` objects over paramplane ops' futures, for paramplane's torch.distributed backend
(``torch_distributed.py``). The class subclasses torch's, so it is built on first use (importing this module does
not import torch)."""

from __future__ import annotations

import concurrent.futures
import threading
from datetime import timedelta
from typing import Any

_lock = threading.Lock()
DONE: concurrent.futures.Future[Any] = concurrent.futures.Future()
"""The future of an op already done."""
DONE.set_result(None)


def plane_work(future: concurrent.futures.Future[Any], result: Any) -> Any:
    """A torch ``Work`` over one plane op's future; its torch future holds ``result`` (the op's tensors)."""
    with _lock:
        if not _work_class:
            _work_class.append(_build_work())
    return _work_class[0](future, result)


_work_class: list[type] = []


def _build_work() -> type:
    import torch
    import torch.distributed as dist

    work_base: Any = dist.Work

    class PlaneWork(work_base):
        def __init__(self, future: concurrent.futures.Future[Any], result: Any) -> None:
            super().__init__()
            self._future, self._result = future, result
            self._torch_future: torch.futures.Future[Any] | None = None  # made on the first get_future()

        def wait(self, timeout: timedelta | None = None) -> bool:
            self._future.result(None if not timeout else timeout.total_seconds())
            return True

        def is_completed(self) -> bool:
            return self._future.done()

        def is_success(self) -> bool:
            return self._future.done() and self._future.exception() is None

        def exception(self) -> BaseException | None:
            return self._future.exception() if self._future.done() else None

        def get_future(self) -> torch.futures.Future[Any]:
            if self._torch_future is None:
                made: torch.futures.Future[Any] = torch.futures.Future()
                self._torch_future = made
                result = self._result

                def done(f: concurrent.futures.Future[Any]) -> None:
                    exc = f.exception()
                    if exc is not None:
                        made.set_exception(exc)
                    else:
                        made.set_result(result)

                self._future.add_done_callback(done)
            return self._torch_future

    return PlaneWork


def future_of(work: Any) -> concurrent.futures.Future[Any]:
    """The future of a paramplane ``Work`` (an op issued with ``async_op=True``)."""
    return work.future


def all_done(works: list[Any]) -> concurrent.futures.Future[Any]:
    """A future done when every one of ``works`` is (the first error, if any)."""
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()
    futures = [future_of(w) for w in works]
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: concurrent.futures.Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        error = next((f.exception() for f in futures if f.exception() is not None), None)
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(done)
    return out
