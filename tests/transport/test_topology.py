"""Unit tests of the data plane's pure parts: node/topology.py, node/spec.py and node/inbox.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from paramplane.node.inbox import Inbox
from paramplane.node.spec import OpSpec, check_reduce_op, split_bounds
from paramplane.node.topology import RankInfo, Topology

WAIT_S = 2.0


def topo(*hosts: str) -> Topology:
    """A topology with rank i on ``hosts[i]``; node ranks in order of first appearance."""
    order: list[str] = []
    infos = []
    for rank, host in enumerate(hosts):
        if host not in order:
            order.append(host)
        local = sum(1 for h in hosts[:rank] if h == host)
        infos.append(RankInfo(rank, f"127.0.0.1:{5000 + rank}", host, order.index(host), local))
    return Topology(tuple(infos))


# -- topology ------------------------------------------------------------------------------------
def test_hosts_split_ranks_by_node_in_order() -> None:
    t = topo("a", "a", "b", "b", "c")
    assert t.world_size == 5
    assert t.hosts(range(5)) == [[0, 1], [2, 3], [4]]
    assert t.hosts([4, 3, 0]) == [[0], [3], [4]]
    assert t.host_of(3) == "b"
    assert t.same_host([2, 3]) and not t.same_host([1, 2])


def test_hierarchy_of_two_hosts_by_two() -> None:
    t = topo("a", "a", "b", "b")
    assert t.hierarchy(range(4)) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def test_hierarchy_of_a_subset_uses_only_its_ranks() -> None:
    t = topo("a", "a", "a", "b", "b", "b")
    assert t.hierarchy([0, 2, 3, 5]) == ([[0, 2], [3, 5]], [[0, 3], [2, 5]])


@pytest.mark.parametrize(
    ("hosts", "ranks"),
    [
        (("a", "a", "a"), [0, 1, 2]),  # one host
        (("a", "b", "c"), [0, 1, 2]),  # one rank per host
        (("a", "a", "b", "b"), [0, 2]),  # the group has one rank per host
        (("a", "a", "b"), [0, 1, 2]),  # uneven hosts
        (("a", "a", "b", "b", "b"), [0, 1, 2, 3, 4]),
    ],
)
def test_hierarchy_is_none_where_the_split_does_not_apply(hosts: tuple[str, ...], ranks: list[int]) -> None:
    assert topo(*hosts).hierarchy(ranks) is None


def test_topology_must_be_indexed_by_rank() -> None:
    with pytest.raises(AssertionError):
        Topology((RankInfo(1, "x:1", "a", 0, 0),))


# -- spec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("total", "parts"), [(0, 3), (1, 2), (7, 3), (10, 4), (1001, 4), (5, 5), (3, 7)])
def test_split_bounds_follows_numpy_array_split(total: int, parts: int) -> None:
    bounds = split_bounds(total, parts)
    pieces = np.array_split(np.arange(total), parts)
    assert [list(range(a, b)) for a, b in bounds] == [p.tolist() for p in pieces]
    assert len(bounds) == parts


def test_mismatch_text_names_ranks_ops_dtypes_and_shapes() -> None:
    mine = OpSpec("world", 4, "all_reduce", "float32", (3,), "sum")
    assert mine.mismatch(0, 1, mine) is None
    theirs = OpSpec("world", 4, "all_reduce", "float64", (4, 2), "sum")
    text = mine.mismatch(0, 1, theirs)
    assert text is not None
    for needle in ("'world'", "#4", "rank 0", "rank 1", "float32", "float64", "(3,)", "(4, 2)"):
        assert needle in text, (needle, text)


def test_mismatch_on_op_argument_or_sequence() -> None:
    mine = OpSpec("g1", 2, "broadcast", "int64", (5,), "src=0")
    text = mine.mismatch(1, 0, OpSpec("g1", 2, "broadcast", "int64", (5,), "src=1"))
    assert text is not None and "src=0" in text and "src=1" in text
    text = mine.mismatch(1, 0, OpSpec("g1", 3, "barrier", "uint8", (0,)))
    assert text is not None and "its op #3" in text and "barrier" in text


def test_check_reduce_op() -> None:
    check_reduce_op("mean", np.dtype(np.float32))
    check_reduce_op("product", np.dtype(np.int64))
    with pytest.raises(ValueError, match="unknown reduction 'avg'"):
        check_reduce_op("avg", np.dtype(np.float32))
    with pytest.raises(ValueError, match="floating"):
        check_reduce_op("mean", np.dtype(np.int64))


# -- inbox ---------------------------------------------------------------------------------------
async def test_inbox_is_fifo() -> None:
    inbox = Inbox(4)
    for i in range(3):
        await inbox.put(i)
    assert len(inbox) == 3
    assert [await inbox.get() for _ in range(3)] == [0, 1, 2]


async def test_put_blocks_while_full_until_a_get() -> None:
    inbox = Inbox(2)
    await inbox.put("a")
    await inbox.put("b")
    blocked = asyncio.ensure_future(inbox.put("c"))
    done, _ = await asyncio.wait([blocked], timeout=0.05)
    assert not done and len(inbox) == 2
    assert await inbox.get() == "a"
    await asyncio.wait_for(blocked, WAIT_S)
    assert [await inbox.get(), await inbox.get()] == ["b", "c"]


async def test_get_waits_for_a_put() -> None:
    inbox = Inbox(1)
    getter = asyncio.ensure_future(inbox.get())
    await asyncio.sleep(0)
    assert not getter.done()
    await inbox.put(7)
    assert await asyncio.wait_for(getter, WAIT_S) == 7


async def test_fail_wakes_a_blocked_reader_and_writer() -> None:
    reader_inbox, writer_inbox = Inbox(1), Inbox(1)
    reader = asyncio.ensure_future(reader_inbox.get())
    await writer_inbox.put(1)
    writer = asyncio.ensure_future(writer_inbox.put(2))
    await asyncio.sleep(0)
    assert not reader.done() and not writer.done()
    boom = RuntimeError("peer lost")
    reader_inbox.fail(boom)
    writer_inbox.fail(boom)
    for task in (reader, writer):
        with pytest.raises(RuntimeError, match="peer lost"):
            await asyncio.wait_for(task, WAIT_S)


async def test_fail_drops_buffered_items_and_later_calls_raise_the_first_error() -> None:
    inbox = Inbox(4)
    await inbox.put(1)
    first = ValueError("first")
    inbox.fail(first)
    inbox.fail(ValueError("second"))
    assert len(inbox) == 0
    with pytest.raises(ValueError, match="first"):
        await inbox.get()
    with pytest.raises(ValueError, match="first"):
        await inbox.put(2)
