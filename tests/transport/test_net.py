"""Addresses, loopback policy and the job token: one implementation for every entry point."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from paramplane.protos.net import best_effort, host_port, is_loopback, parse_address, resolve_token, within


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:29500", ("127.0.0.1", 29500)), ("[::1]:7", ("::1", 7)), ("node-a:1", ("node-a", 1))],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected
    assert parse_address(host_port(*expected)) == expected


@pytest.mark.parametrize("address", ["", "host", ":80", "host:", "host:0", "host:65536", "host:x1", "[::1]"])
def test_parse_address_refuses_malformed(address: str) -> None:
    with pytest.raises(ValueError, match="coordinator must be HOST:PORT"):
        parse_address(address, "coordinator")


def test_loopback_policy() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "node-a", "::"))


def test_token_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARAMPLANE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("PARAMPLANE_TOKEN", raising=False)
    assert resolve_token() is None
    monkeypatch.setenv("PARAMPLANE_TOKEN", "from-env")
    assert resolve_token() == "from-env"
    env_file = tmp_path / "env-token"
    env_file.write_text("from-env-file\n")
    monkeypatch.setenv("PARAMPLANE_TOKEN_FILE", str(env_file))
    assert resolve_token() == "from-env-file"
    arg_file = tmp_path / "arg-token"
    arg_file.write_text("from-arg-file")
    assert resolve_token(token_file=arg_file) == "from-arg-file"
    assert resolve_token("explicit", token_file=arg_file) == "explicit"


def test_empty_or_missing_token_file_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_token(token_file=empty)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_token(token_file=tmp_path / "missing")


async def test_within_keeps_a_cancellation_that_arrives_as_the_awaited_finishes() -> None:
    """A task cancelled in the loop iteration where what it awaits finishes must end cancelled: on Python 3.11
    ``asyncio.wait_for`` returned the result instead and the task ran on, so a lane server's close, waiting for
    its cancelled connection tasks, hung (test_lane's numpy-header test, about one run in twenty)."""
    done = asyncio.get_running_loop().create_future()
    ran_on = asyncio.Event()

    async def connection() -> None:
        await within(done, 10.0)
        ran_on.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(connection())
    await asyncio.sleep(0)  # it now waits for ``done``
    done.set_result(None)
    task.cancel()
    finished, _ = await asyncio.wait([task], timeout=10.0)
    assert finished and task.cancelled() and not ran_on.is_set()


async def test_within_times_out_and_passes_results_and_errors() -> None:
    assert await within(asyncio.sleep(0, "x"), 1.0) == "x"
    assert await within(asyncio.sleep(0, "y"), None) == "y"
    with pytest.raises(TimeoutError):
        await within(asyncio.Event().wait(), 0.01)
    with pytest.raises(KeyError):
        await within(_raise(KeyError("k")), 1.0)


async def test_best_effort_swallows_what_it_awaits_failing_but_not_its_own_cancellation() -> None:
    """What an optional await (a goodbye, an error frame) may meet ends in None: an error, a timeout, a
    future or task cancelled by someone else (grpc.aio raises CancelledError from a call cancelled
    elsewhere). The awaiting task cancelled itself (a shutdown told to stop) ends cancelled, at once: with
    ``except BaseException: pass`` it went on to its next peer."""
    assert await best_effort(asyncio.sleep(0, "x"), 1.0) == "x"
    assert await best_effort(_raise(KeyError("k")), 1.0) is None
    assert await best_effort(asyncio.Event().wait(), 0.01) is None
    foreign = asyncio.get_running_loop().create_future()
    foreign.cancel()
    assert await best_effort(foreign, 1.0) is None
    other = asyncio.ensure_future(asyncio.Event().wait())
    await asyncio.sleep(0)
    other.cancel()
    assert await best_effort(other, None) is None

    went_on = asyncio.Event()

    async def shutdown() -> None:
        await best_effort(asyncio.Event().wait(), 10.0)  # a goodbye to a peer that does not answer
        went_on.set()  # the next peer's goodbye
        await asyncio.Event().wait()

    task = asyncio.ensure_future(shutdown())
    await asyncio.sleep(0)
    task.cancel()
    finished, _ = await asyncio.wait([task], timeout=10.0)
    assert finished and task.cancelled() and not went_on.is_set()

    async def cleanup_after_a_cancellation() -> list[object]:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # caught on purpose, to clean up: the best efforts still run
            return [
                await best_effort(asyncio.Event().wait(), 0.01),
                await best_effort(_raise(KeyError()), 1.0),
            ]
        raise AssertionError("not cancelled")

    cleaner = asyncio.ensure_future(cleanup_after_a_cancellation())
    await asyncio.sleep(0)
    cleaner.cancel()
    assert await within(cleaner, 10.0) == [None, None]


async def _raise(exc: BaseException) -> None:
    raise exc
