"""Every dtype the README lists moves through every collective on gRPC, shm and the hierarchical path."""

from __future__ import annotations

import pytest
from _world import run_world

CASES = [
    pytest.param(2, {"PARAMPLANE_TRANSPORT": "grpc"}, None, id="grpc"),
    pytest.param(2, {"PARAMPLANE_TRANSPORT": "shm"}, None, id="shm"),
    pytest.param(
        4,
        {"PARAMPLANE_TRANSPORT": "auto"},
        {r: {"PARAMPLANE_HOST_ID": f"host{r // 2}"} for r in range(4)},
        id="hier",
    ),
]


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
@pytest.mark.parametrize(("n", "env", "rank_env"), CASES)
def test_every_dtype_every_collective(
    n: int, env: dict[str, str], rank_env: dict[int, dict[str, str]] | None
) -> None:
    world = run_world(n, "dtypes.py", env={"PARAMPLANE_TIMEOUT": "60", **env}, rank_env=rank_env, timeout=180)
    assert all(r["num_checks"] == 9 * 2 * 5 + 3 for r in world.check_ok())
    assert world.shm_leaks() == set()
