"""The harness's torch ranks, forked from the zygote (``tests/_zygote.py``), behave as exec'd processes do:
argv, environment, working directory and output are the rank's own; exit codes, exceptions and signals come
back as they happened; a rank past the deadline is killed with everything it started."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import _zygote
import pytest
from _world import WORKERS, run_world

from paramplane.launch import thread_env

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
        reason="needs the test extra (torch, transformers): the zygote imports them and serves torch workers",
    ),
    pytest.mark.skipif(
        thread_env(2)["OMP_NUM_THREADS"] != "1" or os.environ.get("PARAMPLANE_TEST_ZYGOTE") == "0",
        reason="the zygote serves ranks with one intra-op thread only (two ranks on more than two cores get more)",
    ),
]


def _probes(out: Path, n: int) -> list[dict[str, object]]:
    return [json.loads((out / f"probe-{r}.json").read_text()) for r in range(n)]


def _zygote_pid() -> int:
    zygote = _zygote.for_rank(
        WORKERS / "zygote_probe.py", {**os.environ, **thread_env(2), "PYTHONUNBUFFERED": "1"}
    )
    assert zygote is not None and zygote.proc is not None, "the zygote does not serve on this machine"
    return zygote.proc.pid


def test_a_forked_rank_sees_its_own_argv_environment_and_directory(tmp_path: Path) -> None:
    world = run_world(2, "zygote_probe.py", args=["ok"], rank_env={1: {"PROBE_TAG": "one"}}, out_dir=tmp_path)
    assert not world.timed_out and [r.returncode for r in world.ranks] == [0, 0], world.describe()
    probes = _probes(tmp_path, 2)
    assert {p["ppid"] for p in probes} == {_zygote_pid()}  # the scenario under test: forked, not exec'd
    assert [p["tag"] for p in probes] == [None, "one"]
    assert all(p["argv"] == ["ok"] and p["main_file"] == str(WORKERS / "zygote_probe.py") for p in probes)
    assert all(p["cwd"] == str(WORKERS.parent.parent) and p["torch_threads"] == 1 for p in probes)
    assert all(p["sum"] == 45.0 for p in probes)
    assert [f"probe rank {r} says hello" in world.ranks[r].output for r in range(2)] == [True, True]


@pytest.mark.parametrize(("what", "code", "needle"), [("exit3", 3, ""), ("raise", 1, "probe failure on purpose"),
                                                      ("sigkill", -9, "")])  # fmt: skip
def test_a_forked_rank_exits_as_it_ended(tmp_path: Path, what: str, code: int, needle: str) -> None:
    world = run_world(2, "zygote_probe.py", args=[what], out_dir=tmp_path, timeout=60)
    assert not world.timed_out, world.describe()
    assert [r.returncode for r in world.ranks] == [code, code], world.describe()
    assert all(needle in r.output for r in world.ranks)
    assert {p["ppid"] for p in _probes(tmp_path, 2)} == {_zygote_pid()}


def test_a_forked_rank_past_the_deadline_is_killed(tmp_path: Path) -> None:
    world = run_world(2, "zygote_probe.py", args=["hang"], out_dir=tmp_path, timeout=5)  # forks start in ms
    assert world.timed_out and all(r.returncode == -9 for r in world.ranks), world.describe()
    for probe in _probes(tmp_path, 2):
        pid = probe["pid"]
        assert isinstance(pid, int)
        assert not Path(f"/proc/{pid}").exists(), f"forked rank {pid} outlived its deadline"


def test_an_edit_of_the_code_it_imported_starts_a_fresh_zygote(tmp_path: Path) -> None:
    """A worker edited after the zygote imported it (between two tests of one session) runs its new code."""
    before = _zygote_pid()
    os.utime(WORKERS / "zygote_probe.py")  # as an edit leaves it: a newer modification time
    world = run_world(2, "zygote_probe.py", args=["ok"], out_dir=tmp_path)
    assert [r.returncode for r in world.ranks] == [0, 0], world.describe()
    after = _zygote_pid()
    assert after != before and {p["ppid"] for p in _probes(tmp_path, 2)} == {after}
