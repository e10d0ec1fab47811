"""``PARAMPLANE_TRACE``: every rank writes its collectives as Chrome-trace events; ``merge`` joins them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _ddp_world import check_ok, run_world

from paramplane import trace

# What scenario_trace issues, in order, plus the barrier every scenario ends with: (name, bytes).
EXPECTED = [("all_reduce", 4000), ("broadcast", 80), ("all_gather", 24), ("all_reduce", 40), ("barrier", 0)]


def test_each_rank_writes_its_collectives_and_merge_joins_them(tmp_path: Path) -> None:
    folder = tmp_path / "trace"
    check_ok(run_world(2, "trace", tmp_path, env={"PARAMPLANE_TRACE": str(folder)}))
    for rank in range(2):
        events = json.loads((folder / f"rank-{rank}.json").read_text())["traceEvents"]
        ops = [e for e in events if e.get("cat") == "collective"]
        assert [(e["name"], e["args"]["bytes"]) for e in ops] == EXPECTED
        assert [e["args"]["seq"] for e in ops] == list(range(1, len(EXPECTED) + 1))
        for e in ops:
            assert e["ph"] == "X" and e["pid"] == rank and e["args"]["group"] == "world"
            assert e["dur"] >= 0 and e["ts"] > 0
        starts = [e["ts"] for e in ops]
        assert starts == sorted(starts), "ops of one group run in issue order"
    merged = trace.merge(folder)
    assert merged == folder / "merged.json"
    events = json.loads(merged.read_text())["traceEvents"]
    for rank in range(2):
        mine = [e for e in events if e.get("pid") == rank and e.get("cat") == "collective"]
        assert len(mine) == len(EXPECTED)
    # The same seq of one op on both ranks overlaps in wall-clock time (clocks line up when merged).
    first = [e for e in events if e.get("cat") == "collective" and e["args"]["seq"] == len(EXPECTED)]
    assert len(first) == 2
    a, b = first
    assert a["ts"] <= b["ts"] + b["dur"] and b["ts"] <= a["ts"] + a["dur"]


def test_merge_of_an_empty_folder_says_how_to_get_traces(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="PARAMPLANE_TRACE"):
        trace.merge(tmp_path)
