"""Rank 0 asks the coordinator for the world's status after some collectives and checks what it says."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

from paramplane import status


def scenario(world: Any, rep: Report) -> None:
    for _ in range(3):
        world.group.all_reduce(np.ones(4))
    world.barrier()
    if world.rank != 0:
        world.barrier()
        return
    s = status.fetch(os.environ["PARAMPLANE_COORDINATOR"], os.environ.get("PARAMPLANE_TOKEN"), 10.0)
    rep.check("formed", s["formed"] and s["world_size"] == 2 and s["job_id"] == world.job_id, str(s))
    rep.check(
        "ranks", [r["rank"] for r in s["ranks"]] == [0, 1] and all(r["pid"] > 0 for r in s["ranks"]), str(s)
    )
    rep.check("not aborted", not s["aborted"], str(s))
    text = status.render(s)
    rep.check("render", "host " in text and "rank   0" in text and "rank   1" in text, text)
    rep.values["text"] = text
    world.barrier()


if __name__ == "__main__":
    run_rank(scenario)
