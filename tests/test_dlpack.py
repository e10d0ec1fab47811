"""Collectives and checkpoints accept any __dlpack__ tensor (torch CPU here) zero-copy, in place where the op is in place."""

from __future__ import annotations

import pytest
from _world import run_world

pytest.importorskip("torch")


def test_torch_tensors_through_collectives() -> None:
    world = run_world(2, "dlpack.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    assert all(r["num_checks"] >= 11 for r in world.check_ok())
