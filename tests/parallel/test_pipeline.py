"""Pipeline parallelism: schedules validated as data over a grid, and real worlds equal to one process."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _world import run_example, run_world

from paramplane.node.arrays import cupy_module
from paramplane.parallel.pipeline import schedules


@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
def test_every_schedule_is_complete_ordered_and_deadlock_free(schedule: str) -> None:
    checked = 0
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 6, 8, 12):
            for v in (1, 2, 3) if schedule == "interleaved_1f1b" else (1,):
                for group in (None, 2 * p, m) if schedule == "interleaved_1f1b" else (None,):
                    try:
                        lists = [schedules.build(schedule, r, p, m, v, group) for r in range(p)]
                    except ValueError:
                        continue
                    schedules.validate(lists, m, v)
                    checked += 1
    assert checked >= 10


def test_schedules_reach_their_theoretical_bubble_with_free_transfers() -> None:
    """Simulated with unit forward and backward times per rank (split over v chunks) and free transfers,
    each schedule's idle fraction is exactly (p-1)/(m+p-1), and (p-1)/(v*m+p-1) interleaved."""
    checked = 0
    for schedule in schedules.SCHEDULES:
        for p in (2, 3, 4):
            for m in (4, 8, 12):
                for v in (2, 3) if schedule == "interleaved_1f1b" else (1,):
                    # Larger microbatch groups (interleaved) leave the theoretical bubble as it is.
                    for group in (None, 2 * p) if schedule == "interleaved_1f1b" else (None,):
                        try:
                            lists = [schedules.build(schedule, r, p, m, v, group) for r in range(p)]
                        except ValueError:
                            continue
                        step = max(schedules.simulate(lists, lambda _a, v=v: 1.0 / v))
                        bubble = 1.0 - 2 * m / step
                        expected = (p - 1) / (v * m + p - 1)
                        assert bubble == pytest.approx(expected, abs=1e-12), (schedule, p, m, v, group)
                        checked += 1
    # A receive nobody sends is a deadlock, not a clock that stops.
    lonely = [schedules.build("gpipe", r, 2, 2) for r in range(2)]
    lonely[0] = [a for a in lonely[0] if a.kind != "SEND_F"]
    with pytest.raises(ValueError, match="deadlocks"):
        schedules.simulate(lonely, lambda _a: 1.0)
    assert checked >= 30


def test_schedule_rules() -> None:
    one = [schedules.build("1f1b", r, 4, 8) for r in range(4)]
    # 1F1B: the first stage holds at most p forwards before its first backward; GPipe holds m.
    first = [a.kind for a in one[0] if a.kind in ("F", "B")]
    assert first.index("B") == 4
    gp = [a.kind for a in schedules.build("gpipe", 0, 4, 8) if a.kind in ("F", "B")]
    assert gp.index("B") == 8
    with pytest.raises(ValueError, match="at least as many microbatches"):
        schedules.build("1f1b", 0, 4, 3)
    with pytest.raises(ValueError, match="divisible"):
        schedules.build("interleaved_1f1b", 0, 2, 5, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.build("zigzag", 0, 2, 4)
    # A hand-broken list is caught: a backward before its forward, and a receive nobody sends.
    broken = [list(reversed(schedules.build("gpipe", 0, 1, 2)))]
    with pytest.raises(ValueError, match="before its forward"):
        schedules.validate(broken, 2, 1)
    unsent = [schedules.build("1f1b", r, 2, 2) for r in range(2)]
    unsent[1] = [a for a in unsent[1] if a.kind != "SEND_B"]
    with pytest.raises(ValueError, match=r"needs SEND_B1\.0 after it"):
        schedules.validate(unsent, 2, 1)
    # Rank 0 waits for a gradient before sending the forward rank 1 needs to produce it.
    cyclic = [
        schedules._with_transfers([("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)], 1),
        schedules._with_transfers([("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)], 1),
    ]
    with pytest.raises(ValueError, match="deadlocks"):
        schedules.validate(cyclic, 2, 1)
    # A send listed before the compute that makes it (a runtime sends after computing), an action beyond the
    # microbatches, an unknown kind: refused.
    early = [schedules.build("gpipe", r, 2, 2) for r in range(2)]
    f = next(i for i, a in enumerate(early[0]) if a.kind == "F")
    early[0][f], early[0][f + 1] = early[0][f + 1], early[0][f]
    with pytest.raises(ValueError, match=r"needs SEND_F0\.0 after it"):
        schedules.validate(early, 2, 1)
    with pytest.raises(ValueError, match="outside"):
        schedules.validate([[*schedules.build("gpipe", 0, 1, 2), schedules.Action("F", 0, 7)]], 2, 1)
    with pytest.raises(ValueError, match="unknown action kind"):
        schedules.validate([[*schedules.build("gpipe", 0, 1, 2), schedules.Action("W", 0, 0)]], 2, 1)
    # Receiving two gradients in another order than they are sent is fine: messages are taken by name (the
    # pipeline's receiver threads file them), and interleaved 1F1B with larger microbatch groups does so.
    crossed = [schedules.build("gpipe", r, 2, 2) for r in range(2)]
    recvs = [i for i, a in enumerate(crossed[0]) if a.kind == "RECV_B"]
    crossed[0].insert(recvs[0], crossed[0].pop(recvs[1]))  # RECV_B0.1 first, then RECV_B0.0, B0.0, B0.1
    schedules.validate(crossed, 2, 1)
    # Microbatch groups: interleaved 1F1B's setting, at least p and dividing m; more warm-up forwards.
    for bad in (1, 3, 5):
        with pytest.raises(ValueError, match="microbatch_group"):
            schedules.build("interleaved_1f1b", 0, 2, 8, 2, bad)
    with pytest.raises(ValueError, match="setting of interleaved_1f1b"):
        schedules.build("1f1b", 0, 2, 8, 1, 4)
    warmups = []
    for group in (2, 4, 8):
        order = [
            a.kind for a in schedules.build("interleaved_1f1b", 0, 2, 8, 2, group) if a.kind in ("F", "B")
        ]
        warmups.append(order.index("B"))
    assert warmups == [2 + 2 + 1, 2 + 4 + 1, 2 + 8 + 1]  # warm-up forwards, then one forward before each B


CASES = [
    ("gpipe", 2, 4, 1, "mean", None),
    ("gpipe", 2, 8, 1, "sum", None),
    ("1f1b", 2, 4, 1, "mean", None),
    ("1f1b", 2, 8, 1, "sum", None),
    ("interleaved_1f1b", 2, 4, 2, "mean", None),
    ("interleaved_1f1b", 2, 8, 2, "sum", None),
    # Groups of 4 microbatches per chunk: rank 1 takes stage 2's gradients before activations sent earlier.
    ("interleaved_1f1b", 2, 8, 2, "mean", 4),
    # One rank holding every stage: values pass between its stages without transfers.
    ("interleaved_1f1b", 1, 4, 2, "mean", None),
    pytest.param("1f1b", 4, 4, 1, "mean", None, marks=pytest.mark.slow),
    pytest.param("gpipe", 4, 8, 1, "sum", None, marks=pytest.mark.slow),
]


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
@pytest.mark.parametrize(("schedule", "p", "m", "v", "reduction", "group"), CASES)
def test_pipeline_equals_one_process(
    schedule: str, p: int, m: int, v: int, reduction: str, group: int | None
) -> None:
    check_equivalence(schedule, p, m, v, reduction, group, poll_us=0)


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_pipeline_whose_transfer_threads_poll_equals_one_process() -> None:
    check_equivalence("interleaved_1f1b", 2, 8, 2, "mean", None, poll_us=100)


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_pipeline_over_grpc_streams_equals_one_process() -> None:
    """Lanes off: activations and gradients ride gRPC streams (the path TLS uses)."""
    check_equivalence("1f1b", 2, 4, 1, "mean", None, poll_us=0, env={"PARAMPLANE_TCP_LANE": "0"})


def check_equivalence(
    schedule: str,
    p: int,
    m: int,
    v: int,
    reduction: str,
    group: int | None,
    *,
    poll_us: int,
    env: dict[str, str] | None = None,
) -> None:
    args = [schedule, str(m), str(v), reduction] + ([str(group)] if group else [])
    env = {"PARAMPLANE_TIMEOUT": "60", "TEST_PIPELINE_POLL_US": str(poll_us), **(env or {})}
    world = run_world(p, "pipeline.py", args=args, env=env, timeout=120)
    results = world.check_ok()
    assert all(r["num_checks"] >= 2 * 2 * v for r in results)
    first = results[0]["values"]["memory"]
    if schedule == "gpipe":
        assert first["peak_activation_sets"] == m == first["gpipe_peak_activations"]
    elif schedule == "1f1b":
        assert first["peak_activation_sets"] <= first["one_f_one_b_peak_activations"] == p


@pytest.mark.parametrize("poll_us", [0, 100])
def test_a_dead_stage_is_named_not_hung(poll_us: int) -> None:
    """Rank 1 dies mid-step: rank 0's step fails with PeerLost naming it once the coordinator's heartbeat bound
    (3 s here) has passed, not after its 30 s group timeout."""
    env = {"PARAMPLANE_TIMEOUT": "30", "TEST_PIPELINE_POLL_US": str(poll_us)}
    world = run_world(2, "pipeline.py", args=["kill"], env=env, timeout=90, heartbeat_timeout_s=3.0)
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == 9
    r0 = world.ranks[0].result
    assert r0 is not None and r0["failures"] == [] and r0["num_checks"] == 1, world.describe()


def test_an_activation_that_changes_shape_mid_step_is_a_mismatch_on_both_stages() -> None:
    world = run_world(2, "pipeline.py", args=["bad_shape"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    assert all(r["num_checks"] == 2 for r in world.check_ok())


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_activations_larger_than_the_socket_and_inbox_buffers_flow() -> None:
    world = run_world(2, "pipeline.py", args=["large"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=120)
    assert all(r["num_checks"] == 1 for r in world.check_ok())


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_pipeline_times_data_parallel_trains_like_one_process() -> None:
    world = run_world(4, "pipeline.py", args=["dp_pp"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    assert all(r["num_checks"] >= 2 for r in world.check_ok())


@pytest.mark.timeout(300)  # its own bounds (240 s), not the global 120 s
def test_dp_times_pp_trains_the_digits_mlp_with_the_losses_of_ddp() -> None:
    world = run_world(4, "pipeline.py", args=["digits_3d"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=240)
    results = world.check_ok()
    assert sum(r["num_checks"] for r in results) == 2 * 3  # the two last-stage ranks check the losses


def test_train_pipeline_example_runs_under_the_launcher() -> None:
    out = run_example("train_pipeline.py", 2, "--epochs", "2")
    match = re.search(r"test accuracy: (\d\.\d+)", out)
    assert match and float(match.group(1)) > 0.5, out


def test_pipeline_argument_errors_on_every_rank() -> None:
    world = run_world(2, "pipeline.py", args=["errors"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    assert all(r["num_checks"] == 16 for r in world.check_ok())


@pytest.mark.timeout(300)  # its own bounds (240 s), not the global 120 s
def test_bubble_benchmark_measures_idle_from_the_traced_compute(tmp_path: Path) -> None:
    """benchmarks/pipeline.py at a tiny size: one line per schedule, the bubble taken from the traced
    forward/backward spans (a fraction, its size the benchmark's to report: not asserted on busy cores),
    theory as documented, a replay of the same spans with free transfers, and the same run's p2p latency."""
    out = tmp_path / "pipeline.jsonl"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "pipeline.py"
    args = ["--compute-ms", "4", "--microbatches", "2,4", "--steps", "1", "--out", str(out)]
    bad = subprocess.run(
        [sys.executable, str(script), "--repeats", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--repeats must be at least 1" in bad.stderr, bad.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["repeat"] == 0 and r["load_avg_1min"] >= 0 for r in every)  # one repeat by default
    rows = [r for r in every if r["impl"] == "paramplane"]
    # Every stage computes 4 ms, a chunk of an interleaved rank too, and once more with a rank's 4 ms split.
    split = {("interleaved_1f1b", None, True, m) for m in (2, 4)}
    configs = {(s, None, False, m) for s in schedules.SCHEDULES for m in (2, 4)} | split
    configs.add(("interleaved_1f1b", 4, False, 4))
    assert {(r["schedule"], r["microbatch_group"], r["split_rank_work"], r["m"]) for r in rows} == configs
    for r in rows:
        assert r["stage_ms"] == (2.0 if r["split_rank_work"] else 4.0), r
    peer = {(r["schedule"], r["m"], r["split_rank_work"]): r for r in every if r["impl"] == "torch"}
    if importlib.util.find_spec("torch") is not None:
        # The peer ran the same schedules (torch has no microbatch group) and is measured the same way.
        assert set(peer) == {(s, m, split_work) for s, g, split_work, m in configs if g is None}
        for (schedule, m, split_work), t in peer.items():
            assert 0 < t["bubble_measured"] < 1 and t["measured_over_theory"] > 0, t
            # busy as the stage module's own code, which holds its waits: at most the waits' bubble
            assert 0 < t["bubble_module_spans"] <= t["bubble_measured"], t
            assert t["stage_ms"] == (2.0 if split_work else 4.0), t
            ours = next(
                r
                for r in rows
                if (r["schedule"], r["m"], r["microbatch_group"], r["split_rank_work"])
                == (schedule, m, None, split_work)
            )
            assert ours["bubble_over_torch"] == pytest.approx(ours["bubble_measured"] / t["bubble_measured"])
        # torch stage modules under pp.Pipeline: the peer's configurations, measured the same way, and the
        # larger microbatch group (not torch's: no ratio to it).
        staged_rows = [r for r in every if r["impl"] == "paramplane-torch-stages"]
        grouped = [r for r in staged_rows if r["microbatch_group"] is not None]
        assert [(r["schedule"], r["microbatch_group"], r["m"]) for r in grouped] == [
            ("interleaved_1f1b", 4, 4)
        ]
        assert "bubble_over_torch" not in grouped[0] and 0 < grouped[0]["bubble_measured"] < 1, grouped
        staged = {
            (r["schedule"], r["m"], r["split_rank_work"]): r
            for r in staged_rows
            if r["microbatch_group"] is None
        }
        assert set(staged) == set(peer)
        for key, r in staged.items():
            assert 0 < r["bubble_measured"] < 1 and r["stage_ms"] == peer[key]["stage_ms"], r
            # the stages' whole traced spans hold their waits: less idle, by torch's work inside the stage
            assert r["bubble_stage_spans"] < r["bubble_measured"] and r["torch_work_ms_per_step"] > 0, r
            # the module's own code lies inside the stage's span and holds the waits
            assert r["bubble_stage_spans"] <= r["bubble_module_spans"] <= r["bubble_measured"], r
            assert r["module_spans_over_torch"] == pytest.approx(
                r["bubble_module_spans"] / peer[key]["bubble_module_spans"]
            )
            # the same spans replayed with free transfers: a bubble, as a fraction of the replayed step
            assert 0 <= r["replay_over_theory"] * r["bubble_theory"] < 1, r
            assert r["bubble_over_torch"] == pytest.approx(
                r["bubble_measured"] / peer[key]["bubble_measured"]
            )
    else:
        assert not peer
    for r in rows:
        theory = (r["p"] - 1) / (r["v"] * r["m"] + r["p"] - 1)
        assert r["bubble_theory"] == pytest.approx(theory)
        # Fractions of wall-clock time: their sizes are the benchmark's to report, not asserted here (on two
        # busy cores a sleep that overshoots moves them by tenths).
        assert 0 < r["bubble_measured"] < 1 and 0 < r["bubble_nominal"] < 1, r
        assert r["measured_over_theory"] == pytest.approx(r["bubble_measured"] / theory)
        assert r["p2p_one_way_ms"] > 0
        assert r["cold_code_us"] > 0
        assert 0 <= r["bubble_replay"] < 1, r
        assert r["runtime_ms_per_step"] > -1.0, r
        assert r["poll_us"] == 0 and r["cpu_ms_per_step"] > 0, r
    peak = {
        (r["schedule"], r["microbatch_group"], r["split_rank_work"]): r["peak_activation_sets_first_stage"]
        for r in rows
        if r["m"] == 4
    }
    assert peak == {
        ("gpipe", None, False): 4,
        ("1f1b", None, False): 2,
        ("interleaved_1f1b", None, False): 5,
        ("interleaved_1f1b", 4, False): 7,
        ("interleaved_1f1b", None, True): 5,
    }


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
@pytest.mark.gpu
@pytest.mark.skipif(cupy_module() is None, reason="cupy finds no CUDA device")
def test_pipeline_on_cupy_equals_one_process() -> None:
    """1F1B and interleaved 1F1B (groups of 2 and 4) with stages on the GPU: activations cross through host
    memory on the stage's stream, every gradient equals the numpy model's."""
    world = run_world(2, "pipeline_gpu.py", env={"PARAMPLANE_TIMEOUT": "120"}, timeout=300)
    assert all(r["num_checks"] >= 3 * 4 for r in world.check_ok())
