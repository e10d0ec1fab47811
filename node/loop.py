"""The runtime's event loop on a thread of its own, for synchronous scripts."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running in a daemon thread; coroutines are submitted from any other thread."""

    def __init__(self, name: str = "paramplane-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future completes with its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.submit called from the loop itself: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., object], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop soon, from any thread; False when the loop has stopped (nothing is
        left there to tell)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout`` seconds)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is left on the loop, stop it and join the thread."""
        if not self.loop.is_running():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


async def on_daemon_thread(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` on a thread of its own that never holds up the interpreter's exit (an executor's would
    be joined there): for blocking calls that may wait long and cannot be cancelled. Cancelling the await
    leaves the call running; its result is then dropped."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return  # the awaiting coroutine was cancelled or timed out
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        result, exc = None, None
        try:
            result = fn(*args)
        except BaseException as e:
            exc = e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop has stopped

    threading.Thread(target=run, name=name, daemon=True).start()
    return await fut
