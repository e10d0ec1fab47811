"""Control-plane edges: barrier names across reform, coordinator waits that end with the runtime's abort, config
validation (NaN / inf / out-of-range timeouts), CLI token-file errors, rank hints of replacements, secrets in reprs."""

from __future__ import annotations

import concurrent.futures
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _world import listening_port, run_world

import paramplane as pp
from paramplane import health, status
from paramplane.coordinator.model import Joiner, assign_ranks
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread
from paramplane.coordinator.state import CoordinatorState
from paramplane.launch import LaunchConfig
from paramplane.node.peer import TlsConfig
from paramplane.node.runtime import NodeRuntime, RuntimeConfig
from paramplane.protos.net import MAX_TIMEOUT_S
from paramplane.world import World

# -- 1. unnamed barriers after reform ---------------------------------------------------------------------------


def test_unnamed_barriers_meet_after_reform_on_survivor_and_replacement() -> None:
    outcome = run_world(
        2,
        "reform_barriers.py",
        timeout=60,
        heartbeat_timeout_s=1.0,
        heartbeat_interval_s=0.2,
        replace={1: {}},
    )
    results = outcome.check_ok()
    assert [r["values"]["epoch"] for r in results] == [2, 2], outcome.describe()


# -- 2. coordinator waits end when the runtime declares the coordinator lost ------------------------------------


FAST_BEATS = ("--heartbeat-timeout", "1", "--heartbeat-interval", "0.2")


def test_coordinator_waits_fail_at_once_when_heartbeats_lose_the_coordinator() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMPLANE_")}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "paramplane.coordinator", "--port", "0", "--world-size", "2", *FAST_BEATS],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    runtimes: list[NodeRuntime] = []
    stopped = False
    try:
        address = f"127.0.0.1:{listening_port(coordinator, time.monotonic() + 30)}"
        runtimes = [
            NodeRuntime(RuntimeConfig(coordinator=address, world_size=2, rank_hint=r, join_timeout_s=20))
            for r in range(2)
        ]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for joined in [pool.submit(rt.start) for rt in runtimes]:
                joined.result(30)
            world = World(runtimes[0])
            os.killpg(coordinator.pid, signal.SIGSTOP)  # a partition: connected, but no answer ever comes
            stopped = True
            start = time.monotonic()
            waits = [
                pool.submit(world.barrier, timeout=30),
                pool.submit(world.kv.get, "never-set", wait=True, timeout=30),
            ]
            for wait in waits:
                # Before the fix each ran to its own deadline (35 s); now the heartbeat timeout ends it.
                with pytest.raises(pp.CoordinatorUnavailable, match="has not answered"):
                    wait.result(25)
            assert time.monotonic() - start < 25  # the old behaviour took 35 s
            # A later wait fails at once too.
            with pytest.raises(pp.CoordinatorUnavailable):
                world.barrier("later", timeout=30)
    finally:
        if stopped:
            os.killpg(coordinator.pid, signal.SIGCONT)
        coordinator.kill()
        coordinator.wait(10)
        assert coordinator.stdout is not None
        coordinator.stdout.close()
        for rt in runtimes:
            rt.shutdown(grace=0.5)


# -- 3. coordinator settings: NaN and inf --------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting",
    [
        {"heartbeat_interval_s": math.nan},
        {"heartbeat_timeout_s": math.nan},
        {"heartbeat_timeout_s": math.inf},
        {"join_timeout_s": math.nan},
        {"join_timeout_s": math.inf},
        {"progress_timeout_s": math.nan},
        {"progress_timeout_s": math.inf},
    ],
)
def test_coordinator_refuses_nan_and_inf_timeouts(setting: dict[str, float]) -> None:
    (name,) = setting
    with pytest.raises(ValueError, match=name):
        CoordinatorConfig(world_size=2, port=0, **setting)
    if name != "heartbeat_interval_s":  # the state machine has no interval
        with pytest.raises(ValueError):
            CoordinatorState(2, **setting)
    CoordinatorConfig(world_size=2, port=0, progress_timeout_s=0.0)  # 0 = off stays valid


def test_coordinator_cli_refuses_a_nan_interval(capsys: pytest.CaptureFixture[str]) -> None:
    from paramplane.coordinator.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--world-size", "2", "--port", "0", "--heartbeat-interval", "nan"])
    assert exit_.value.code == 2
    assert "heartbeat_interval_s must be a finite number" in capsys.readouterr().err


# -- 4. status / health with an unreadable token file -----------------------------------------------------------


@pytest.mark.parametrize(("name", "command"), [("status", status.main), ("health", health.main)])
def test_status_and_health_report_an_unreadable_token_file_in_one_line(
    name: str, command: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-token"
    assert callable(command)
    assert command(["127.0.0.1:1", "--token-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"paramplane {name}: error: cannot read --token-file {missing}: No such file or directory\n"


# -- 5. ranks of survivors when a joiner has no hint ----------------------------------------------------------


def _ranks(joiners: list[Joiner]) -> dict[str, tuple[int, int]]:
    return {iid: (a.rank, a.node_rank) for iid, a in assign_ranks(joiners, 2, "j").items()}


def test_survivors_keep_their_ranks_when_the_replacement_has_no_hint() -> None:
    # 2 hosts x 2 ranks, rank 1 (host A) lost; host B's survivors arrive first, A's replacement has no hint.
    joiners = [Joiner("b2", "B", "x", 2), Joiner("b3", "B", "x", 3), Joiner("a0", "A", "x", 0)]
    got = _ranks([*joiners, Joiner("a1new", "A", "x", -1)])
    assert got == {"a0": (0, 0), "a1new": (1, 0), "b2": (2, 1), "b3": (3, 1)}
    # One host: rank 0 lost, the survivor rank 1 arrives first.
    assert _ranks([Joiner("s1", "H", "x", 1), Joiner("new", "H", "x", -1)]) == {"new": (0, 0), "s1": (1, 0)}
    # A whole host lost: its unhinted replacements take the free block.
    joiners = [Joiner("a0", "A", "x", 0), Joiner("c0", "C", "x", -1), Joiner("a1", "A", "x", 1)]
    assert _ranks([*joiners, Joiner("c1", "C", "x", -1)]) == {
        "a0": (0, 0),
        "a1": (1, 0),
        "c0": (2, 1),
        "c1": (3, 1),
    }
    # No hints at all: first-arrival order, as before.
    assert _ranks([Joiner("p", "P", "x"), Joiner("q", "Q", "x")]) == {"p": (0, 0), "q": (1, 1)}


# -- 6. secrets stay out of reprs ----------------------------------------------------------------------------


def test_runtime_config_repr_hides_the_token_and_tls_material() -> None:
    tls = TlsConfig(cert=b"CERT", key=b"PRIVATE-KEY", root_cert=b"ROOT")
    config = RuntimeConfig(
        coordinator="127.0.0.1:1", token="s3cr3t-job-token", tls=tls, coordinator_root_cert=b"COORD-ROOT"
    )
    text = repr(config)
    for secret in ("s3cr3t-job-token", "PRIVATE-KEY", "COORD-ROOT"):
        assert secret not in text
    assert "coordinator='127.0.0.1:1'" in text
    assert "PRIVATE-KEY" not in repr(tls) and "ROOT" in repr(tls)


# -- 7. timeouts: zero, NaN, inf, too long -------------------------------------------------------------------


def test_barrier_and_kv_wait_refuse_non_positive_and_non_finite_timeouts() -> None:
    with CoordinatorThread(CoordinatorConfig(world_size=1, port=0)) as coordinator:
        address = coordinator.address
        runtime = NodeRuntime(RuntimeConfig(coordinator=address, world_size=1, join_timeout_s=20))
        runtime.start()
        try:
            world = World(runtime)
            for bad in (0, -1.0, math.nan, math.inf, MAX_TIMEOUT_S * 2):
                with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
                    world.barrier(timeout=bad)
                with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
                    world.kv.get("k", wait=True, timeout=bad)
            world.barrier(timeout=5)
            assert world.kv.get("k") is None
            world.kv.set("k", b"v")
            assert world.kv.get("k", wait=True, timeout=5) == b"v"
        finally:
            runtime.shutdown(grace=0.5)


@pytest.mark.parametrize("field", ["timeout_s", "join_timeout_s", "heartbeat_timeout_s"])
@pytest.mark.parametrize("value", [math.inf, math.nan, MAX_TIMEOUT_S + 1])
def test_launch_refuses_timeouts_the_ranks_would_refuse(field: str, value: float, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ValueError, match="at most 31536000"):
        LaunchConfig(num_ranks=1, target=str(script), standalone=True, **{field: value})
    LaunchConfig(num_ranks=1, target=str(script), standalone=True, **{field: MAX_TIMEOUT_S})


def test_launch_cli_reports_a_too_long_timeout_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from paramplane.launch import main

    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["--standalone", "-n", "1", "--join-timeout", "inf", str(script)]) == 2
    assert capsys.readouterr().err.startswith("paramplane launch: error: --join-timeout must be")


def test_the_control_plane_gil_switch_interval_is_only_ever_lowered() -> None:
    """The coordinator and the launcher lower the GIL switch interval (gRPC's completion thread hands calls to
    the loop sooner); a process that already runs a lower one keeps it. In a child: the setting is global."""
    code = (
        "import math, sys\n"
        "from paramplane.protos.net import CONTROL_SWITCH_INTERVAL_S as S, prefer_control_latency as p\n"
        "assert sys.getswitchinterval() > S\n"
        "p(); assert math.isclose(sys.getswitchinterval(), S, rel_tol=0.05), sys.getswitchinterval()\n"
        "sys.setswitchinterval(S / 2); p(); assert math.isclose(sys.getswitchinterval(), S / 2, rel_tol=0.05)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
