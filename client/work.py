"""``Work``: the handle an ``async_op=True`` collective returns."""

from __future__ import annotations

import concurrent.futures
from typing import Generic, TypeVar

from paramplane.node.errors import CollectiveTimeout

T = TypeVar("T")


class Work(Generic[T]):
    """A collective in flight; ``wait()`` returns its result (the output array) or raises its error."""

    def __init__(self, future: concurrent.futures.Future[T], name: str) -> None:
        self._future = future
        self.name = name

    def wait(self, timeout: float | None = None) -> T:
        """Block until the op finished; CollectiveTimeout if it has not after ``timeout`` seconds (it keeps running)."""
        done, _ = concurrent.futures.wait([self._future], timeout)
        if not done:
            raise CollectiveTimeout(
                f"{self.name} not finished after waiting {timeout} s; it is still running"
            )
        return self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        """The op's error once completed (None while running or after success)."""
        return self._future.exception(0) if self._future.done() else None

    @property
    def future(self) -> concurrent.futures.Future[T]:
        return self._future

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "running"
        return f"<Work {self.name} {state}>"
