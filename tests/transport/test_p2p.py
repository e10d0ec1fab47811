"""Point-to-point send / recv in real 2-rank worlds (tests/workers/p2p.py): order, shapes, errors."""

from __future__ import annotations

import pytest
from _world import run_world


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_messages_small_and_large_in_flight_arrive_in_order_with_their_shapes() -> None:
    """Small messages leave from the caller's thread and large ones from the event loop; together, all in
    flight, they still pair up in issue order, and recv_array takes each dtype and shape from the header."""
    results = run_world(2, "p2p.py", args=["order"], timeout=120).check_ok()
    assert results[1]["num_checks"] >= 3 * 3 * 8 + 1


def test_timeout_and_mismatch_fail_promptly_and_bad_arguments_fail_nothing() -> None:
    world = run_world(2, "p2p.py", args=["errors"], env={"PARAMPLANE_TIMEOUT": "2"}, timeout=90)
    r0, r1 = world.check_ok()
    assert r0["num_checks"] >= 10 and r1["num_checks"] >= 7
    for waited in ("timeout_elapsed", "direct_timeout_elapsed"):
        assert 1.5 <= r0["values"][waited] < 15
    # The receiver's error frames reach the sender: it fails long before its group's own 30 s deadline could
    # (two thirds of it: slack for two busy cores, and still no timeout could have told it).
    assert r0["values"]["mismatch_elapsed"] < 20.0
    assert r0["values"]["direct_mismatch_elapsed"] < 20.0


def test_recv_into_a_cupy_array_receives_the_data() -> None:
    """The device path of ``recv`` (a stand-in cupy: no GPU needed) writes what was sent into the array; all_to_all
    of cupy arrays is staged through the host and gives cupy arrays."""
    results = run_world(2, "cupy_stand_in.py", timeout=60).check_ok()
    assert results[1]["num_checks"] == 7
