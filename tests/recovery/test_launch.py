"""``paramplane launch``: rank environment, output prefixes, failure handling, and no orphan processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paramplane.launch import LaunchConfig, describe_exit, main, parse_address

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "test-token-5f1c0a"  # a fake job token; the launcher must never print it
NOWHERE = "127.0.0.1:1"  # for scripts that never connect

# Rank scripts. BLOCKING_SCRIPT PIDS_DIR FAILING_RANK ACTIONS: every rank starts a grandchild that ignores
# SIGTERM and writes "<rank pid> <grandchild pid>" to PIDS_DIR/pids.<rank>; the failing rank waits for all those
# files, then acts (exit3, sigkill, exit0); the others block. ignore-term: ranks note SIGTERM in term.<rank>.
ENV_SCRIPT = """
import json, os, sys
keys = [k for k in os.environ if k.startswith(("PARAMPLANE_", "MALLOC_")) or k == "PYTHONUNBUFFERED"]
print(json.dumps({k: os.environ[k] for k in keys} | {"argv": sys.argv[1:]}))
print("to stderr", file=sys.stderr)
sys.stdout.write("partial last line")
"""
BLOCKING_SCRIPT = """
import os, signal, subprocess, sys, threading, time
rank = int(os.environ["PARAMPLANE_LOCAL_RANK"])
pids_dir, failing, actions = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
if "ignore-term" in actions:
    signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(pids_dir, f"term.{rank}"), "w").close())
child = subprocess.Popen([sys.executable, "-c",
    "import signal, threading; signal.signal(signal.SIGTERM, signal.SIG_IGN); threading.Event().wait()", pids_dir])
with open(os.path.join(pids_dir, f"tmp.{rank}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.rename(os.path.join(pids_dir, f"tmp.{rank}"), os.path.join(pids_dir, f"pids.{rank}"))
if rank == failing:
    deadline = time.monotonic() + 30
    while len([n for n in os.listdir(pids_dir) if n.startswith("pids.")]) < int(os.environ["PARAMPLANE_WORLD_SIZE"]):
        assert time.monotonic() < deadline, "the other ranks never started"
        time.sleep(0.02)
    if "exit3" in actions:
        sys.exit(3)
    if "sigkill" in actions:
        os.kill(os.getpid(), signal.SIGKILL)
    if "exit0" in actions:
        sys.exit(0)  # leaving its grandchild behind
try:
    threading.Event().wait()
except KeyboardInterrupt:
    print("got SIGINT", flush=True)
    sys.exit(1)
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARAMPLANE_", "MALLOC_"))}
    return env | {"PARAMPLANE_TOKEN": TOKEN} | extra


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "paramplane.cli", "launch", *args]


def _run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _launch_cmd(*args), env=env or _env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, awaiting its reaper
    except OSError:
        return False


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _pids(pids_dir: Path) -> list[int]:
    return [int(pid) for path in pids_dir.glob("pids.*") for pid in path.read_text().split()]


def _assert_all_gone(pids: list[int]) -> None:
    _wait_for(
        lambda: not any(_alive(pid) for pid in pids), f"every rank and grandchild to be gone: {pids}", 10
    )


@pytest.fixture
def pids_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, where rank scripts note their PIDs; whatever of them a failed test leaves running is killed."""
    yield tmp_path
    for pid in _pids(tmp_path):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                ours = str(tmp_path).encode() in cmdline.read()  # not a recycled PID
            if ours and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _lines_by_rank(text: str) -> dict[int, list[str]]:
    by_rank: dict[int, list[str]] = {}
    for line in text.splitlines():
        assert line.startswith("[rank "), f"line without a rank prefix: {line!r}"
        head, _, rest = line.partition("] ")
        by_rank.setdefault(int(head.removeprefix("[rank ")), []).append(rest)
    return by_rank


def test_ranks_get_their_environment_and_every_line_is_prefixed(tmp_path: Path) -> None:
    script = _write(tmp_path, "env.py", ENV_SCRIPT)
    token_file = _write(tmp_path, "token", "file-token-77\n")
    env = _env(PARAMPLANE_TOKEN_FILE=str(_write(tmp_path, "other", "other-token")))  # --token-file wins
    result = _run("-n", "3", "--coordinator", NOWHERE, "--token-file", str(token_file), "--timeout", "7.5",
                  "--join-timeout", "12", str(script), "-n", "5", "--flag", env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    stdout, stderr = _lines_by_rank(result.stdout), _lines_by_rank(result.stderr)
    assert sorted(stdout) == sorted(stderr) == [0, 1, 2]
    for rank in range(3):
        env_line, partial = stdout[rank]
        env = json.loads(env_line)
        assert env.pop("argv") == ["-n", "5", "--flag"]
        assert env.pop("PARAMPLANE_AGENT").startswith("unix:/")  # the launcher is the host's agent
        assert env == {
            "PARAMPLANE_COORDINATOR": NOWHERE,
            "PARAMPLANE_WORLD_SIZE": "3",
            "PARAMPLANE_RANK": str(rank),
            "PARAMPLANE_LOCAL_RANK": str(rank),
            "PARAMPLANE_RESTART_COUNT": "0",
            "PARAMPLANE_HOST_ID": socket.gethostname(),
            "PARAMPLANE_TOKEN": "file-token-77",
            "PARAMPLANE_TIMEOUT": "7.5",
            "PARAMPLANE_JOIN_TIMEOUT": "12.0",
            "PYTHONUNBUFFERED": "1",
            "MALLOC_MMAP_THRESHOLD_": "33554432",
            "MALLOC_TRIM_THRESHOLD_": "67108864",
        }
        assert partial == "partial last line"
        assert stderr[rank] == ["to stderr"]


def test_multi_host_world_has_no_rank_hint_and_user_settings_win(tmp_path: Path) -> None:
    script = _write(tmp_path, "env.py", ENV_SCRIPT)
    env = _env(PARAMPLANE_RANK="7", MALLOC_MMAP_THRESHOLD_="1234")  # a stale hint from an outer job
    result = _run("-n", "2", "--world-size", "6", "--host-id", "node-b", "--coordinator", "10.0.0.5:2900",
                  str(script), env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank, lines in _lines_by_rank(result.stdout).items():
        seen = json.loads(lines[0])
        # -1: the coordinator numbers the ranks (neither the stale hint nor a scheduler's rank variables)
        assert seen["PARAMPLANE_RANK"] == "-1" and "PARAMPLANE_TIMEOUT" not in seen
        assert seen["PARAMPLANE_LOCAL_RANK"] == str(rank)
        assert seen["PARAMPLANE_WORLD_SIZE"] == "6"
        assert seen["PARAMPLANE_HOST_ID"] == "node-b"
        assert seen["PARAMPLANE_COORDINATOR"] == "10.0.0.5:2900"
        assert seen["PARAMPLANE_TOKEN"] == TOKEN
        assert seen["MALLOC_MMAP_THRESHOLD_"] == "1234"


def test_token_file_from_the_environment_wins_as_in_pp_init(tmp_path: Path) -> None:
    script = _write(tmp_path, "env.py", ENV_SCRIPT)
    env = _env(PARAMPLANE_TOKEN_FILE=str(_write(tmp_path, "token", " env-file-token\n")))
    result = _run("-n", "1", "--coordinator", NOWHERE, str(script), env=env)
    assert result.returncode == 0, result.stderr
    seen = json.loads(_lines_by_rank(result.stdout)[0][0])
    assert seen["PARAMPLANE_TOKEN"] == "env-file-token" and "PARAMPLANE_TOKEN_FILE" not in seen
    env["PARAMPLANE_TOKEN_FILE"] = str(tmp_path / "missing")
    result = _run("-n", "1", "--coordinator", NOWHERE, str(script), env=env)
    assert result.returncode == 2 and "cannot read PARAMPLANE_TOKEN_FILE" in result.stderr
    assert result.stdout == ""  # no rank started


def test_module_mode_and_no_prefix(tmp_path: Path) -> None:
    # One write per line: unprefixed ranks share our stdout, and print() on an unbuffered stream writes the
    # text and its newline separately, so two ranks' lines could interleave.
    module = "import os, sys\nsys.stdout.write(f\"{os.environ['PARAMPLANE_RANK']} {sys.argv[1:]} {'PARAMPLANE_TOKEN' in os.environ}\\n\")\n"
    _write(tmp_path, "rankmod.py", module)
    env = _env(PYTHONPATH=str(tmp_path))
    del env[
        "PARAMPLANE_TOKEN"
    ]  # no token anywhere: the ranks get none (for a tokenless loopback coordinator)
    result = _run("-n", "2", "--no-prefix", "--coordinator", NOWHERE, "-m", "rankmod", "--x", env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["0 ['--x'] False", "1 ['--x'] False"]


def test_no_python_runs_the_target_as_a_program(tmp_path: Path) -> None:
    """``--no-python`` (torchrun's): each rank runs the target itself with the arguments, not ``python
    target``; here a shell script, which ``python`` could not run. Named programs must exist."""
    program = _write(tmp_path, "rank.sh", '#!/bin/sh\necho "$PARAMPLANE_RANK $*"\n')
    program.chmod(0o755)
    result = _run("-n", "2", "--no-python", "--coordinator", NOWHERE, str(program), "--x", "y")
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["[rank 0] 0 --x y", "[rank 1] 1 --x y"]
    missing = _run("-n", "1", "--no-python", "--coordinator", NOWHERE, str(tmp_path / "none"))
    assert missing.returncode == 2 and "no such program" in missing.stderr, missing.stderr
    both = _run("-n", "1", "--no-python", "-m", "--coordinator", NOWHERE, str(program))
    assert both.returncode == 2 and "-m and --no-python exclude each other" in both.stderr, both.stderr


def test_failing_rank_stops_the_others_and_leaves_no_process(pids_dir: Path) -> None:
    script = _write(pids_dir, "block.py", BLOCKING_SCRIPT)
    # Surviving ranks and every grandchild ignore SIGTERM: only the SIGKILL after the grace ends them.
    result = _run("-n", "4", "--grace", "0.5", "--coordinator", NOWHERE, str(script), str(pids_dir), "2",
                  "exit3,ignore-term")  # fmt: skip
    assert result.returncode == 3
    assert "paramplane launch: rank 2 exited with code 3; stopped the other 3 ranks" in result.stderr
    assert TOKEN not in result.stdout + result.stderr
    pids = _pids(pids_dir)
    assert len(pids) == 8
    _assert_all_gone(pids)


@pytest.mark.parametrize("how", ["exit3", "sigkill"])
def test_failure_is_reported_with_code_or_signal(pids_dir: Path, how: str) -> None:
    script = _write(pids_dir, "block.py", BLOCKING_SCRIPT)
    result = _run("-n", "3", "--grace", "0.5", "--coordinator", NOWHERE, str(script), str(pids_dir), "1", how)
    if how == "exit3":
        assert result.returncode == 3
        assert "rank 1 exited with code 3; stopped the other 2 ranks" in result.stderr
    else:
        assert result.returncode == 128 + signal.SIGKILL
        assert "rank 1 was killed by SIGKILL; stopped the other 2 ranks" in result.stderr
    _assert_all_gone(_pids(pids_dir))


def test_success_still_ends_grandchildren(pids_dir: Path) -> None:
    script = _write(pids_dir, "leave.py", BLOCKING_SCRIPT)
    result = _run("-n", "1", "--grace", "0.5", "--coordinator", NOWHERE, str(script), str(pids_dir), "0",
                  "exit0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    _assert_all_gone(_pids(pids_dir))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_is_forwarded_and_ends_every_rank(pids_dir: Path, signum: int) -> None:
    script = _write(pids_dir, "block.py", BLOCKING_SCRIPT)
    launcher = subprocess.Popen(
        _launch_cmd("-n", "3", "--grace", "1", "--coordinator", NOWHERE, str(script), str(pids_dir), "-1", "block"),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        _wait_for(lambda: len(list(pids_dir.glob("pids.*"))) == 3, "all ranks to start")
        launcher.send_signal(signum)
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
    assert launcher.returncode == 128 + signum
    assert f"received {signal.Signals(signum).name}; stopped 3 ranks" in stderr
    if signum == signal.SIGINT:  # the ranks saw the signal itself, not just a SIGTERM
        assert sorted(stdout.splitlines()) == [f"[rank {r}] got SIGINT" for r in range(3)]
    _assert_all_gone(_pids(pids_dir))


def test_second_signal_skips_the_grace(pids_dir: Path) -> None:
    script = _write(pids_dir, "block.py", BLOCKING_SCRIPT)
    launcher = subprocess.Popen(
        _launch_cmd("-n", "2", "--grace", "60", "--coordinator", NOWHERE, str(script), str(pids_dir), "-1",
                    "ignore-term"),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        _wait_for(lambda: len(list(pids_dir.glob("pids.*"))) == 2, "all ranks to start")
        launcher.send_signal(signal.SIGTERM)
        _wait_for(lambda: len(list(pids_dir.glob("term.*"))) == 2, "the ranks to see SIGTERM")
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=15)  # far below the 60 s grace
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
    assert launcher.returncode == 128 + signal.SIGTERM
    _assert_all_gone(_pids(pids_dir))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ranks": 0}, "-n must be at least 1"),
        ({"coordinator": None}, "exactly one of --standalone or --coordinator"),
        ({"standalone": True}, "exactly one of --standalone or --coordinator"),
        ({"coordinator": "localhost"}, "HOST:PORT"),
        ({"coordinator": "127.0.0.1:70000"}, "HOST:PORT"),
        ({"world_size": 1}, "smaller than -n"),
        ({"coordinator": None, "standalone": True, "world_size": 4}, "--world-size must equal -n"),
        ({"heartbeat_timeout_s": 5.0}, "--standalone coordinator only"),
        ({"timeout_s": 0.0}, "--timeout must be a finite number of seconds > 0"),
        ({"host_id": "a b"}, "--host-id"),
        ({"target": "no/such/script.py"}, "no such script"),
    ],
)
def test_config_rejects_bad_input(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "num_ranks": 2,
        "target": str(_write(tmp_path, "s.py", "")),
        "coordinator": NOWHERE,
    }
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**(base | kwargs))  # type: ignore[arg-type]


def test_config_never_shows_the_token(tmp_path: Path) -> None:
    config = LaunchConfig(
        num_ranks=1, target=str(_write(tmp_path, "s.py", "")), coordinator=NOWHERE, token=TOKEN
    )
    assert TOKEN not in repr(config)


def test_cli_errors_are_clear_and_start_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = str(_write(tmp_path, "s.py", "raise SystemExit('must not run')"))
    assert main(["-n", "2", "--coordinator", NOWHERE, "--token-file", str(tmp_path / "missing"), script]) == 2
    assert "cannot read --token-file" in capsys.readouterr().err
    assert main(["-n", "2", "--standalone", "--coordinator", NOWHERE, script]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_helpers() -> None:
    assert parse_address("[::1]:29500") == ("::1", 29500)
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGTERM) == "was killed by SIGTERM"


def test_standalone_coordinator_accepts_connections(tmp_path: Path) -> None:
    script = _write(tmp_path, "probe.py", """
import os, socket
host, port = os.environ["PARAMPLANE_COORDINATOR"].rsplit(":", 1)
with socket.create_connection((host, int(port)), timeout=10):
    print("connected", host, len(os.environ["PARAMPLANE_TOKEN"]) >= 32)
""")  # fmt: skip
    result = _run("-n", "2", "--standalone", str(script), env=_env(PARAMPLANE_TOKEN=""))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[rank {r}] connected 127.0.0.1 True" for r in range(2)]


def test_hello_example_end_to_end() -> None:
    result = _run("-n", "4", "--standalone", "--timeout", "30", str(ROOT / "examples" / "hello.py"),
                  env=_env(PARAMPLANE_TOKEN=""))  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = _lines_by_rank(result.stdout)
    ranks = sorted(int(text.split()[1].split("/")[0]) for rank_lines in lines.values() for text in rank_lines)
    assert ranks == [0, 1, 2, 3]
    assert all(f"/4 local_rank {local}" in lines[local][0] for local in range(4))


def _restart_run(out: Path, *extra: str, restarts: int) -> subprocess.CompletedProcess[str]:
    worker = Path(__file__).resolve().parents[1] / "workers" / "restart.py"
    cmd = [
        sys.executable,
        "-m",
        "paramplane.cli",
        "launch",
        "--standalone",
        "-n",
        "2",
        "--heartbeat-timeout",
        "3",
        "--timeout",
        "30",
        "--grace",
        "2",
        "--max-restarts",
        str(restarts),
        str(worker),
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_max_restarts_resumes_from_the_checkpoint_and_ends_like_an_unbroken_run(tmp_path: Path) -> None:
    import numpy as np

    clean = _restart_run(tmp_path / "clean", restarts=0)
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    broken = _restart_run(tmp_path / "broken", "5", restarts=1)
    assert broken.returncode == 0, broken.stdout[-2000:] + broken.stderr[-2000:]
    assert "rank 1 exited with code 3" in broken.stderr and "restart 1 of 1" in broken.stderr, broken.stderr[
        -2000:
    ]
    assert "attempt 1 resumed at step 5" in broken.stdout, broken.stdout[-2000:]
    want, got = np.load(tmp_path / "clean" / "final.npz"), np.load(tmp_path / "broken" / "final.npz")
    for key in want.files:
        assert np.array_equal(got[key], want[key]), key  # bit for bit: same world, same steps
    # Without restarts the failure ends the launch with the rank's code.
    failed = _restart_run(tmp_path / "once", "5", restarts=0)
    assert failed.returncode == 3 and "rank 1 exited with code 3" in failed.stderr


def test_max_restarts_and_replacements_must_be_whole_numbers() -> None:
    from paramplane.launch import LaunchConfig

    for bad in (-1, True):
        with pytest.raises(ValueError, match="max-restarts must be"):
            LaunchConfig(num_ranks=2, target=__file__, standalone=True, max_restarts=bad)
        with pytest.raises(ValueError, match="max-replacements must be"):
            LaunchConfig(num_ranks=2, target=__file__, standalone=True, max_replacements=bad)


@pytest.mark.timeout(480)  # its own bounds (420 s), not the global 120 s
def test_max_restarts_across_two_launchers_reforms_the_world_on_the_coordinator(tmp_path: Path) -> None:
    """Two launchers (two host ids) share an external coordinator; a rank on one of them dies at step 5.
    Its launcher aborts the world there, both launchers restart their ranks, the coordinator forms epoch 2,
    and the job ends like an unbroken run (within float64 rounding: the reduction order across hosts differs
    from the single-host reference)."""
    import numpy as np

    from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

    worker = Path(__file__).resolve().parents[1] / "workers" / "restart.py"
    ref_cmd = [
        sys.executable,
        "-m",
        "paramplane.cli",
        "launch",
        "--standalone",
        "-n",
        "4",
        str(worker),
        str(tmp_path / "ref"),
    ]
    ref = subprocess.run(ref_cmd, capture_output=True, text=True, timeout=180)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "multi"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMPLANE_")}
    config = CoordinatorConfig(
        host="127.0.0.1", port=0, world_size=4, token="restart-token", heartbeat_timeout_s=5
    )
    with CoordinatorThread(config) as coord:
        env["PARAMPLANE_TOKEN"] = "restart-token"
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "paramplane.cli",
                    "launch",
                    "-n",
                    "2",
                    "--coordinator",
                    coord.address,
                    "--world-size",
                    "4",
                    "--host-id",
                    host,
                    "--timeout",
                    "30",
                    "--grace",
                    "2",
                    "--max-restarts",
                    "1",
                    str(worker),
                    str(out),
                    "5",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for host in ("hostA", "hostB")
        ]
        try:
            results = [p.communicate(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stdout[-2000:] + stderr[-3000:]
        assert "restart 1 of 1" in stderr, stderr[-2000:]
    assert any("attempt 1 resumed at step 5" in stdout for stdout, _ in results)
    want, got = np.load(tmp_path / "ref" / "final.npz"), np.load(out / "final.npz")
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-12)


COLLECTIVES_UNTIL_ERROR = """
import time
import numpy as np
import paramplane as pp
with pp.init() as world:
    world.group.all_reduce(np.ones(4))
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # a small collective every 50 ms until one fails (and the rank with it)
        world.group.all_reduce(np.ones(4))
        time.sleep(0.05)
"""


def test_max_restarts_stops_in_one_line_when_the_coordinator_is_gone(tmp_path: Path) -> None:
    """An external coordinator dies under a running world: the ranks fail naming it, and the launcher, instead of
    restarting ranks that could only wait in pp.init() for the join timeout, says in its last line that the
    coordinator does not answer and stops (one attempt only)."""
    from _world import listening_port

    env = {k: v for k, v in _env().items() if not k.startswith("PARAMPLANE_")}
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "paramplane.coordinator", "--host", "127.0.0.1", "--port", "0",
         "--world-size", "2", "--heartbeat-timeout", "2", "--heartbeat-interval", "0.2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    launcher: subprocess.Popen[bytes] | None = None
    try:
        port = listening_port(coordinator, time.monotonic() + 30)
        address = f"127.0.0.1:{port}"
        worker = _write(tmp_path, "collectives_until_error.py", COLLECTIVES_UNTIL_ERROR)
        launcher = subprocess.Popen(
            _launch_cmd("-n", "2", "--grace", "1", "--coordinator", address, "--max-restarts", "3", str(worker)),
            env=dict(env, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        assert launcher.stdout is not None
        seen: list[bytes] = []
        deadline = time.monotonic() + 60
        while sum(b"ready" in line for line in seen) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            assert line, b"".join(seen)
            seen.append(line)
        os.killpg(coordinator.pid, signal.SIGKILL)
        out, err = launcher.communicate(timeout=90)
    finally:
        for p in (launcher, coordinator):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            if p is not None:
                p.wait(10)
    text = err.decode()
    last = text.strip().splitlines()[-1]
    assert launcher.returncode != 0
    assert f"the coordinator at {address} did not answer" in last and "not restarting" in last, text
    assert "restarting every rank" not in text, text  # no second attempt
    assert sum(b"ready" in line for line in [*seen, *out.splitlines()]) == 2
    assert "Traceback" not in last
