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
    # Each rank maps its monotonic clock to wall time once; the two mappings differ by some microseconds,
    # more than two short barriers may overlap by, and far less than a missing or wrong mapping would.
    slack_us = 1000.0
    assert a["ts"] <= b["ts"] + b["dur"] + slack_us and b["ts"] <= a["ts"] + a["dur"] + slack_us, (a, b)


@pytest.mark.parametrize(("lanes", "label"), [("1", "lane"), ("0", "grpc-stream")])
def test_traces_name_how_the_grpc_transport_moved_the_frames(tmp_path: Path, lanes: str, label: str) -> None:
    """The ``grpc`` transport's frames ride lanes by default and gRPC streams with lanes off (or under TLS):
    the trace says which, not "grpc" for both."""
    folder = tmp_path / "trace"
    env = {"PARAMPLANE_TRACE": str(folder), "PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_TCP_LANE": lanes}
    check_ok(run_world(2, "trace", tmp_path, env=env))
    for rank in range(2):
        events = json.loads((folder / f"rank-{rank}.json").read_text())["traceEvents"]
        labels = {e["args"]["transport"] for e in events if e.get("cat") == "collective"}
        assert labels == {label}, labels


def test_merge_of_an_empty_folder_says_how_to_get_traces(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="PARAMPLANE_TRACE"):
        trace.merge(tmp_path)


def test_trace_merge_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from paramplane import cli

    for rank in range(2):
        event = {
            "name": "all_reduce",
            "cat": "collective",
            "ph": "X",
            "ts": 1.0 + rank,
            "dur": 2.0,
            "pid": rank,
        }
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"traceEvents": [event]}))
    assert cli.main(["trace", "merge", str(tmp_path), "--out", str(tmp_path / "all.json")]) == 0
    merged = json.loads((tmp_path / "all.json").read_text())["traceEvents"]
    assert sorted(e["pid"] for e in merged) == [0, 1]
    assert "all.json" in capsys.readouterr().out
    assert cli.main(["trace", "merge", str(tmp_path / "missing")]) == 1


def test_bench_command_lists_and_refuses_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    from paramplane import cli

    assert cli.main(["bench", "--help"]) == 0
    assert "collectives" in capsys.readouterr().out
    assert cli.main(["bench", "no-such-benchmark"]) == 2
    assert "no benchmark 'no-such-benchmark'" in capsys.readouterr().err


def test_tracer_memory_is_bounded(tmp_path: Path) -> None:
    tracer = trace.ChromeTracer(tmp_path, max_events=5)
    tracer.open(0)
    for i in range(8):
        tracer.record("all_reduce", "world", i, 4, 0.0, 1.0, "shm")
    tracer.close()
    data = json.loads((tmp_path / "rank-0.json").read_text())
    spans = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    dropped = [e for e in data["traceEvents"] if e.get("name") == "dropped_events"]
    assert len(spans) == 5 and dropped[0]["args"]["count"] == 3
