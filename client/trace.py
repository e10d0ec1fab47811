"""Chrome-trace timelines of collectives (``PARAMPLANE_TRACE=DIR``), and ``paramplane trace merge``.

Each rank writes ``DIR/rank-<r>.json`` (Trace Event Format, opened by Perfetto
and chrome://tracing): one complete event per collective with its name, bytes,
group, sequence number and transport. Timestamps are wall-clock microseconds so
ranks line up when merged.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

MAX_EVENTS = 1_000_000
"""Events a rank keeps (a few hundred MB of JSON at most); later ones are counted, not kept."""


class ChromeTracer:
    """Collects this rank's collective events and writes them on ``close()`` (and at exit).

    Memory is bounded: past ``max_events`` events are dropped and their number is written in the trace's
    metadata (``dropped_events``), so a long run with tracing on cannot exhaust the rank's memory.
    """

    def __init__(self, folder: str | os.PathLike[str], max_events: int = MAX_EVENTS) -> None:
        self.folder = Path(folder)
        self.rank = -1
        self._events: list[tuple[str, str, str, float, float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._offset_us = (time.time() - time.monotonic()) * 1e6
        self._closed = False
        self._name = ""
        self._max_events = max_events
        self.dropped = 0

    def open(self, rank: int, epoch: int = 1) -> None:
        """Start recording as ``rank``; a world re-formed at a later ``epoch`` writes a file of its own."""
        self.rank = rank
        self._name = f"rank-{rank}.json" if epoch <= 1 else f"rank-{rank}.epoch-{epoch}.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)

    def record(
        self, name: str, group: str, seq: int, nbytes: int, start: float, end: float, transport: str
    ) -> None:
        args = {"group": group, "seq": seq, "bytes": nbytes, "transport": transport}
        self._span(name, "collective", group, start, end, args)

    def mark(self, name: str, start: float, end: float, **args: Any) -> None:
        """A non-collective span (e.g. a layer's backward) on the ``compute`` track."""
        self._span(name, "compute", "compute", start, end, args)

    def _span(self, name: str, cat: str, track: str, start: float, end: float, args: dict[str, Any]) -> None:
        # A tuple now, the event's dict when read: a pipeline stage marks every compute, and whatever it does
        # between two computes is idle time. ``list.append`` needs no lock; the bound may be passed by a
        # few events when several threads record at once.
        if len(self._events) < self._max_events:
            self._events.append((name, cat, track, start, end, args))
        else:
            with self._lock:
                self.dropped += 1

    @property
    def num_events(self) -> int:
        return len(self._events)

    def events_since(self, first: int) -> list[dict[str, Any]]:
        """The events recorded after the first ``first`` ones, as Trace Event Format dicts."""
        return [
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": start * 1e6 + self._offset_us,
                "dur": max(0.0, (end - start) * 1e6),
                "pid": self.rank,
                "tid": track,
                "args": args,
            }
            for name, cat, track, start, end, args in self._events[first:]
        ]

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.events_since(0)

    def close(self) -> None:
        if self._closed or self.rank < 0:
            return
        self._closed = True
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "dropped_events", "ph": "M", "pid": self.rank, "args": {"count": self.dropped}},
        ]
        path = self.folder / self._name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        tmp.replace(path)


def merge(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Join every ``rank-*.json`` in ``folder`` into one trace (default ``folder/merged.json``)."""
    folder = Path(folder)
    files = sorted(folder.glob("rank-*.json"))
    if not files:
        raise FileNotFoundError(f"no rank-*.json traces in {folder}: run with PARAMPLANE_TRACE={folder}")
    events: list[dict[str, Any]] = []
    for f in files:
        events.extend(json.loads(f.read_text())["traceEvents"])
    target = Path(out) if out else folder / "merged.json"
    target.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return target


def main(argv: list[str] | None = None) -> int:
    """``paramplane trace merge DIR [--out FILE]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="paramplane trace", description="Tools for PARAMPLANE_TRACE timelines."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="join every rank-*.json of DIR into one Chrome trace")
    m.add_argument("folder")
    m.add_argument("--out", default=None, help="output file (default DIR/merged.json)")
    args = parser.parse_args(argv)
    try:
        path = merge(args.folder, args.out)
    except FileNotFoundError as exc:
        print(f"paramplane trace: {exc}")
        return 1
    print(f"wrote {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0
