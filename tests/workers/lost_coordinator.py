"""Ranks keep issuing collectives until the (killed) coordinator is declared lost; they report how."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def scenario(world: Any, rep: Report) -> None:
    world.group.all_reduce(np.ones(4))
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            world.group.all_reduce(np.ones(4))
        except pp.PlaneError as exc:
            rep.values.update(error=type(exc).__name__, message=str(exc), at=time.time())
            return
        time.sleep(0.05)  # pacing: one small collective every 50 ms
    rep.check("the lost coordinator was noticed", False, "no error within 60 s")


if __name__ == "__main__":
    run_rank(scenario)
