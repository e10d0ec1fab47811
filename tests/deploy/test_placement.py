"""``paramplane.placement``: which variable gives rank, world size, node and coordinator, and the errors."""

from __future__ import annotations

import os

import pytest

from paramplane.placement import FILE_RENDEZVOUS, first_host, resolve, slurm_port

SLURM = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "node08",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_ID": "4242",
    "SLURM_RESTART_COUNT": "2",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    "PMIX_NAMESPACE": "12345",
}


def test_slurm_step() -> None:
    p = resolve(SLURM)
    assert p.launcher == "slurm"
    assert (p.rank and p.rank.value, p.world_size and p.world_size.value) == (3, 4)
    assert p.local_rank and p.local_rank.value == 1 and p.local_rank.source == "SLURM_LOCALID=1"
    assert p.node and p.node.value == "node08" and p.node_rank and p.node_rank.value == 1
    assert p.restart_count.value == 2 and p.restart_count.source == "SLURM_RESTART_COUNT=2"
    assert p.coordinator and p.coordinator.value == f"node07:{slurm_port(4242, 0)}"
    assert "SLURM_JOB_NODELIST" in p.coordinator.source and "SLURM_JOB_ID=4242" in p.coordinator.source
    assert not p.hosts_coordinator
    assert resolve({**SLURM, "SLURM_PROCID": "0"}).hosts_coordinator


def test_slurm_port_is_per_job_step_and_overridable() -> None:
    assert slurm_port(4242, 0) == slurm_port(4242, 0) != slurm_port(4243, 0)
    assert slurm_port(4242, 0) != slurm_port(4242, 1)
    p = resolve({**SLURM, "PARAMPLANE_COORDINATOR_PORT": "31000"})
    assert p.coordinator and p.coordinator.value == "node07:31000"
    assert "PARAMPLANE_COORDINATOR_PORT=31000" in p.coordinator.source


def test_slurm_batch_script_is_not_a_rank() -> None:
    """The batch script sees SLURM_PROCID/SLURM_NTASKS too, but only an srun step's tasks are ranks."""
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert resolve(env).rank is None and resolve(env).launcher == "none"


def test_paramplane_wins_over_every_launcher() -> None:
    env = {
        **SLURM,
        **OMPI,
        "PARAMPLANE_RANK": "1",
        "PARAMPLANE_WORLD_SIZE": "8",
        "PARAMPLANE_COORDINATOR": "h:1",
    }
    p = resolve(env)
    assert p.rank and p.rank.source == "PARAMPLANE_RANK=1" and p.world_size and p.world_size.value == 8
    assert p.coordinator and p.coordinator.value == "h:1" and not p.hosts_coordinator
    assert p.local_rank and p.local_rank.source == "SLURM_LOCALID=1"  # not given by PARAMPLANE_*: Slurm's


def test_launcher_leaves_rank_to_coordinator() -> None:
    """``paramplane launch`` on several hosts sets PARAMPLANE_RANK=-1: Slurm's task id must not leak in."""
    p = resolve(
        {**SLURM, "PARAMPLANE_RANK": "-1", "PARAMPLANE_WORLD_SIZE": "8", "PARAMPLANE_COORDINATOR": "h:1"}
    )
    assert p.rank and p.rank.value == -1


def test_order_slurm_mpi_kubernetes_torch() -> None:
    torch = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    kube = {"JOB_COMPLETION_INDEX": "5", "HOSTNAME": "train-5-abc", "PARAMPLANE_WORLD_SIZE": "6"}
    assert resolve({**SLURM, **OMPI, **kube, **torch}).launcher == "slurm"
    assert resolve({**OMPI, **kube, **torch}).launcher == "openmpi"
    mpich = {
        "PMI_RANK": "0",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "0",
        "MPI_LOCALNRANKS": "2",
        "PMI_KVSNAME": "k",
    }
    assert resolve({**mpich, **kube}).launcher == "mpich"
    p = resolve({**kube, **torch})
    assert p.launcher == "kubernetes" and p.rank and p.rank.source == "JOB_COMPLETION_INDEX=5"
    assert p.world_size and p.world_size.source == "PARAMPLANE_WORLD_SIZE=6"
    assert p.coordinator and p.coordinator.value == "10.0.0.1:29500"
    t = resolve(torch)
    assert t.launcher == "torch" and t.rank and t.rank.value == 1 and not t.hosts_coordinator
    assert resolve({**torch, "RANK": "0"}).hosts_coordinator
    elastic = resolve({**torch, "TORCHELASTIC_RUN_ID": "x"})
    assert elastic.coordinator and elastic.coordinator.value == "10.0.0.1:29501"  # torchrun's store has 29500


def test_mpi_single_host_rendezvous_file() -> None:
    p = resolve(OMPI)
    assert p.launcher == "openmpi" and p.rank and p.rank.value == 2
    assert p.coordinator and str(p.coordinator.value).startswith(FILE_RENDEZVOUS + "openmpi-")
    other_job = resolve({**OMPI, "PMIX_NAMESPACE": "999"})
    assert other_job.coordinator and other_job.coordinator.value != p.coordinator.value
    assert resolve({**OMPI, "OMPI_COMM_WORLD_RANK": "0"}).hosts_coordinator


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"OMPI_COMM_WORLD_RANK": "1"}, ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
        ({"PMI_SIZE": "2"}, ["PMI_SIZE", "PMI_RANK"]),
        ({**SLURM, "SLURM_PROCID": "4"}, ["SLURM_PROCID=4", "SLURM_NTASKS=4"]),
        ({**SLURM, "SLURM_NTASKS": "four"}, ["SLURM_NTASKS", "'four'"]),
        (
            {"PARAMPLANE_RANK": "5", "PARAMPLANE_WORLD_SIZE": "2"},
            ["PARAMPLANE_RANK=5", "PARAMPLANE_WORLD_SIZE=2"],
        ),
        ({"JOB_COMPLETION_INDEX": "0"}, ["JOB_COMPLETION_INDEX=0", "world size"]),
        ({"MASTER_ADDR": "h"}, ["MASTER_ADDR", "MASTER_PORT"]),
        # An MPI job over several hosts has no shared directory to meet in: it needs an address.
        (
            {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
            ["OMPI_COMM_WORLD_RANK=2", "PARAMPLANE_COORDINATOR", "MASTER_ADDR"],
        ),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["RANK=0", "no coordinator"]),
    ],
)
def test_errors_name_the_variables(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        resolve(env)
    for name in names:
        assert name in str(error.value)


def test_nothing_set() -> None:
    p = resolve({})
    assert p.launcher == "none" and p.rank is None and p.coordinator is None
    assert p.restart_count.value == 0


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("node[07-09,12],gpu1", "node07"),
        ("a1,b[2-3]", "a1"),
        ("rack[1-2]-n[03-04]", "rack1-n03"),
        ("solo", "solo"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_bad_host_list() -> None:
    with pytest.raises(ValueError, match="host list"):
        first_host("node[1-")


def test_master_addr_wins_over_the_mpi_meeting_file() -> None:
    p = resolve({**OMPI, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"})
    assert p.coordinator and p.coordinator.value == "127.0.0.1:29600"


def test_launch_slurm_outside_a_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from paramplane.launch import main

    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    assert main(["--slurm", "-n", "2", __file__]) == 2
    assert "SLURM_STEP_ID" in capsys.readouterr().err


def test_launch_slurm_needs_one_task_per_node(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from paramplane.launch import main

    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert main(["--slurm", "-n", "2", __file__]) == 2
    err = capsys.readouterr().err
    assert "SLURM_NTASKS=4" in err and "SLURM_STEP_NUM_NODES=2" in err and "--ntasks-per-node=1" in err


def test_paramplane_env_prints_each_value_and_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from paramplane.cli import main

    for name in list(os.environ):
        if name.startswith(("SLURM_", "PARAMPLANE_", "OMPI_", "PMI_")) or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert main(["env"]) == 0
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["launcher"] == ["slurm"]
    assert rows["rank"] == ["3", "SLURM_PROCID=3"] and rows["world_size"] == ["4", "SLURM_NTASKS=4"]
    assert rows["node"] == ["node08", "SLURMD_NODENAME=node08"]
    assert rows["restart_count"] == ["2", "SLURM_RESTART_COUNT=2"]
    assert rows["coordinator"][0] == f"node07:{slurm_port(4242, 0)}" and rows["hosts_coordinator"] == ["no"]
    monkeypatch.setenv("SLURM_PROCID", "9")
    assert main(["env"]) == 2
    assert "SLURM_PROCID=9 is not below SLURM_NTASKS=4" in capsys.readouterr().err


def test_a_named_coordinator_knows_the_world_size() -> None:
    """A running coordinator (PARAMPLANE_COORDINATOR or pp.init's argument) gives the size: no error without one."""
    p = resolve({"PARAMPLANE_RANK": "1", "PARAMPLANE_COORDINATOR": "h:1"})
    assert p.rank and p.rank.value == 1 and p.world_size is None and not p.hosts_coordinator
    given = resolve({"JOB_COMPLETION_INDEX": "0"}, coordinator="h:2")
    assert given.coordinator and given.coordinator.value == "h:2" and not given.hosts_coordinator
    mpi = resolve({**OMPI, "OMPI_COMM_WORLD_RANK": "0"}, coordinator="h:3")
    assert mpi.rank and mpi.rank.value == 0 and not mpi.hosts_coordinator  # the given one runs elsewhere


def test_data_plane_binds_wide_only_for_a_world_over_nodes() -> None:
    """A two-node srun step binds the data plane for other nodes, unless this world is one host's (a loopback
    coordinator, as ``paramplane launch --standalone`` run inside the step gives its ranks)."""
    from paramplane.world import _multi_node

    step = resolve(SLURM)
    assert _multi_node(step, "node07:29400")
    assert not _multi_node(step, "127.0.0.1:29400")
    assert not _multi_node(resolve({**SLURM, "SLURM_STEP_NUM_NODES": "1"}), "node07:29400")
