"""Where this process sits in its job: rank, world size, local rank, node, restart count and coordinator.

One resolution for ``pp.init()``, ``paramplane launch --slurm`` and ``paramplane env``. Each value comes from
the first layer that names it: ``PARAMPLANE_*``, then Slurm (inside an ``srun`` step), then MPI (Open MPI's
``OMPI_COMM_WORLD_*``, MPICH/Hydra's ``PMI_*``), then Kubernetes (an Indexed Job's ``JOB_COMPLETION_INDEX``),
then torch's env:// names (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``). Every value carries
the variables it came from, so errors and ``paramplane env`` can name them. Pure functions over an env dict.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PORT_BASE = 20000
PORT_SPAN = 20000
"""Slurm's derived coordinator port lies in [PORT_BASE, PORT_BASE + PORT_SPAN) (below Linux's ephemeral range)."""
PORT_ENV = "PARAMPLANE_COORDINATOR_PORT"
FILE_RENDEZVOUS = "file:"
"""Prefix of a coordinator found through a file that rank 0 writes (single-host MPI jobs)."""


@dataclass(frozen=True)
class Found:
    """One resolved value and where it came from."""

    value: int | str
    """The value (ints for counts and indices, strings for names and addresses)."""
    source: str
    """The variables that gave it, e.g. ``SLURM_PROCID=3``."""


@dataclass(frozen=True)
class Placement:
    """What the environment says about this process; ``None``: nothing names that value."""

    rank: Found | None
    """Global rank."""
    world_size: Found | None
    """Ranks in the job."""
    local_rank: Found | None
    """Index among the ranks of this node."""
    node: Found | None
    """Name of this node (ranks with the same name share a host)."""
    node_rank: Found | None
    """Index of this node in the job."""
    restart_count: Found
    """Which attempt of the job this is (0: the first)."""
    coordinator: Found | None
    """``HOST:PORT`` of the coordinator, or ``file:DIR`` (rank 0 writes its address in DIR)."""
    launcher: str
    """Who started this process: paramplane, slurm, openmpi, mpich, kubernetes, torch, or none."""
    hosts_coordinator: bool = False
    """This process starts the coordinator (rank 0 of a job whose launcher runs none)."""
    num_nodes: Found | None = None
    """Nodes in the job, where the launcher says."""

    def rows(self) -> list[tuple[str, str, str]]:
        """(name, value, source) for each value, for ``paramplane env``."""
        out = [("launcher", self.launcher, "")]
        for name in ("rank", "world_size", "local_rank", "node", "node_rank", "num_nodes", "restart_count"):
            found: Found | None = getattr(self, name)
            out.append((name, "-", "not set") if found is None else (name, str(found.value), found.source))
        coord = self.coordinator
        out.append(
            ("coordinator", "-", "not found")
            if coord is None
            else ("coordinator", str(coord.value), coord.source)
        )
        out.append(("hosts_coordinator", "yes" if self.hosts_coordinator else "no", ""))
        return out


def _int(env: Mapping[str, str], name: str, *, low: int = 0) -> Found | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {raw!r}") from None
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return Found(value, f"{name}={value}")


def _str(env: Mapping[str, str], name: str) -> Found | None:
    raw = env.get(name, "").strip()
    return Found(raw, f"{name}={raw}") if raw else None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    text = nodelist.strip()
    depth = 0
    for i, char in enumerate(text):  # the first top-level item
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            text = text[:i]
            break
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], text)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the Slurm host list {nodelist!r}")
    return host


def slurm_port(job_id: int, step_id: int | None) -> int:
    """The coordinator port of a Slurm job step: the same on every node, different for other jobs' steps
    (mostly: a hash of the job and step ids into the range, so two jobs collide with probability 1/20000)."""
    digest = hashlib.sha256(f"{job_id}.{step_id}".encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def _both(env: Mapping[str, str], rank_var: str, size_var: str) -> tuple[Found, Found] | None:
    """The rank and the world size a launcher names in ``rank_var`` and ``size_var``; ValueError when it names
    only one of them or the rank is not below the size."""
    rank, size = _int(env, rank_var), _int(env, size_var, low=1)
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        have, missing = (rank_var, size_var) if size is None else (size_var, rank_var)
        raise ValueError(f"{have} is set but {missing} is missing: the launcher must set both")
    if int(rank.value) >= int(size.value):
        raise ValueError(f"{rank.source} is not below {size.source}")
    return rank, size


Layer = dict[str, Found]


def _paramplane(env: Mapping[str, str]) -> Layer:
    out = {"coordinator": _str(env, "PARAMPLANE_COORDINATOR"), "node": _str(env, "PARAMPLANE_HOST_ID")}
    rank = _int(env, "PARAMPLANE_RANK", low=-1)  # -1: the launcher leaves the choice to the coordinator
    out |= {"rank": rank, "world_size": _int(env, "PARAMPLANE_WORLD_SIZE", low=1)}
    out |= {
        "local_rank": _int(env, "PARAMPLANE_LOCAL_RANK"),
        "restart_count": _int(env, "PARAMPLANE_RESTART_COUNT"),
    }
    return {k: v for k, v in out.items() if v is not None}


def _slurm(env: Mapping[str, str]) -> Layer:
    # The batch script itself also sees SLURM_PROCID and SLURM_NTASKS; only an srun step's tasks are ranks.
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        return {}
    pair = _both(env, "SLURM_PROCID", "SLURM_NTASKS")
    if pair is None:
        return {}
    out = {"rank": pair[0], "world_size": pair[1]}
    for key, name in (
        ("local_rank", "SLURM_LOCALID"),
        ("node_rank", "SLURM_NODEID"),
        ("restart_count", "SLURM_RESTART_COUNT"),
    ):
        if (found := _int(env, name)) is not None:
            out[key] = found
    nodes = _int(env, "SLURM_STEP_NUM_NODES", low=1) or _int(env, "SLURM_JOB_NUM_NODES", low=1)
    if nodes is not None:
        out["num_nodes"] = nodes
    if (node := _str(env, "SLURMD_NODENAME")) is not None:
        out["node"] = node
    list_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    job = _int(env, "SLURM_JOB_ID") or _int(env, "SLURM_JOBID")
    if env.get(list_var) and job is not None:
        host = first_host(env[list_var])
        port = _int(env, PORT_ENV, low=1)
        if port is not None:
            out["coordinator"] = Found(f"{host}:{port.value}", f"first host of {list_var}, {port.source}")
        else:
            step = _int(env, "SLURM_STEP_ID") or _int(env, "SLURM_STEPID")
            step_id = None if step is None else int(step.value)
            where = f"port derived from {job.source}" + ("" if step is None else f" and {step.source}")
            out["coordinator"] = Found(
                f"{host}:{slurm_port(int(job.value), step_id)}", f"first host of {list_var}, {where}"
            )
    return out


def slurm_step(env: Mapping[str, str]) -> dict[str, Found]:
    """What Slurm alone says (empty outside an srun step): rank, world_size (its tasks), local_rank, node,
    node_rank, num_nodes, restart_count, coordinator."""
    return _slurm(env)


def _job_key(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """A name the ranks of one MPI job share on one host: the launcher's job id where it sets one."""
    parts = [f"{n}={env[n]}" for n in names if env.get(n)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16] if parts else None


def _mpi(env: Mapping[str, str], kind: str) -> Layer:
    if kind == "openmpi":
        pair = _both(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_var, local_size_var = "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"
        key_vars: tuple[str, ...] = (
            "PMIX_NAMESPACE",
            "OMPI_MCA_orte_hnp_uri",
            "OMPI_MCA_ess_base_jobid",
            "PMIX_SERVER_URI41",
        )
    else:
        pair = _both(env, "PMI_RANK", "PMI_SIZE")
        local_var, local_size_var = "MPI_LOCALRANKID", "MPI_LOCALNRANKS"
        key_vars = ("PMI_KVSNAME", "PMI_PORT", "PMI_ID", "PMIX_NAMESPACE")
    if pair is None:
        return {}
    out = {"rank": pair[0], "world_size": pair[1]}
    local, local_size = _int(env, local_var), _int(env, local_size_var, low=1)
    if local is not None:
        out["local_rank"] = local
    # One host holds every rank: rank 0 writes the coordinator's address in a directory the job's ranks share.
    if local_size is not None and local_size.value == pair[1].value:
        key = _job_key(env, key_vars)
        if key is not None:
            out["meeting_file"] = Found(  # used when nothing names an address (MASTER_ADDR wins)
                f"{FILE_RENDEZVOUS}{kind}-{key}",
                f"one host ({local_size.source} = {pair[1].source}): rank 0 publishes it under a directory named by the job id",
            )
            out["num_nodes"] = Found(1, local_size.source)
    return out


def _kubernetes(env: Mapping[str, str]) -> Layer:
    index = _int(env, "JOB_COMPLETION_INDEX")
    if index is None:
        return {}
    out = {"rank": index, "local_rank": Found(0, "one rank per pod (JOB_COMPLETION_INDEX set)")}
    if (pod := _str(env, "HOSTNAME")) is not None:
        out["node"] = pod
    return out


def _torch(env: Mapping[str, str]) -> Layer:
    out: Layer = {}
    pair = _both(env, "RANK", "WORLD_SIZE")
    if pair is not None:
        out |= {"rank": pair[0], "world_size": pair[1]}
    for key, name in (
        ("local_rank", "LOCAL_RANK"),
        ("node_rank", "GROUP_RANK"),
        ("restart_count", "TORCHELASTIC_RESTART_COUNT"),
    ):
        if (found := _int(env, name)) is not None:
            out[key] = found
    addr, port = _str(env, "MASTER_ADDR"), _int(env, "MASTER_PORT", low=1)
    if (addr is None) != (port is None):
        have, missing = ("MASTER_ADDR", "MASTER_PORT") if port is None else ("MASTER_PORT", "MASTER_ADDR")
        raise ValueError(f"{have} is set but {missing} is missing")
    if addr is not None and port is not None:
        number, how = int(port.value), port.source
        if env.get("TORCHELASTIC_RUN_ID"):  # torchrun's own store listens on MASTER_PORT
            number, how = number + 1, f"{port.source} + 1 (torchrun's store has MASTER_PORT)"
        out["coordinator"] = Found(f"{addr.value}:{number}", f"{addr.source}, {how}")
    return out


LAYERS: tuple[tuple[str, Callable[[Mapping[str, str]], Layer]], ...] = (
    ("paramplane", _paramplane),
    ("slurm", _slurm),
    ("openmpi", lambda env: _mpi(env, "openmpi")),
    ("mpich", lambda env: _mpi(env, "mpich")),
    ("kubernetes", _kubernetes),
    ("torch", _torch),
)
"""The layers in the order they win."""


def resolve(env: Mapping[str, str], coordinator: str | None = None) -> Placement:
    """This process's placement as ``env`` describes it (ValueError naming the variables when it cannot);
    ``coordinator``: the address the caller gives (``pp.init(coordinator=...)``), which wins."""
    layers = [(name, read(env)) for name, read in LAYERS]
    merged: dict[str, Found] = {}
    launcher = "none"
    for name, layer in layers:
        if launcher == "none" and "rank" in layer and name != "paramplane":
            launcher = name
        for key, value in layer.items():
            merged.setdefault(key, value)
    if launcher == "none" and "PARAMPLANE_COORDINATOR" in env:
        launcher = "paramplane"
    rank, size = merged.get("rank"), merged.get("world_size")
    found: Found | None = merged.get("coordinator") or merged.get("meeting_file")
    if coordinator is not None:
        found = Found(coordinator, "given to pp.init (PARAMPLANE_COORDINATOR)")
    named = found is not None and "PARAMPLANE_COORDINATOR" in found.source
    # A running coordinator knows the world size; one this process would host (or look for) needs it here.
    if rank is not None and size is None and int(rank.value) >= 0 and not named:
        raise ValueError(
            f"{rank.source} names this process's rank but nothing names the world size: "
            "set PARAMPLANE_WORLD_SIZE (or WORLD_SIZE)"
        )
    if rank is not None and size is not None and int(rank.value) >= int(size.value):
        raise ValueError(f"{rank.source} is not below {size.source}")
    if rank is not None and int(rank.value) >= 0 and found is None:
        raise ValueError(
            f"{rank.source} names this process's rank but no coordinator can be found: set PARAMPLANE_COORDINATOR="
            "HOST:PORT (a running coordinator) or MASTER_ADDR and MASTER_PORT (rank 0 then hosts it there)"
        )
    hosts = found is not None and rank is not None and rank.value == 0 and not named and launcher != "none"
    restart = merged.get("restart_count", Found(0, "default (no launcher names a restart)"))
    return Placement(
        rank=rank,
        world_size=size,
        local_rank=merged.get("local_rank"),
        node=merged.get("node"),
        node_rank=merged.get("node_rank"),
        restart_count=restart,
        coordinator=found,
        launcher=launcher,
        hosts_coordinator=hosts,
        num_nodes=merged.get("num_nodes"),
    )


def main(argv: list[str] | None = None) -> int:
    """``paramplane env``: print where rank, world size, node and coordinator come from here."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(
        prog="paramplane env",
        description="Print this process's place in its job as pp.init() resolves it, and which variable gave "
        "each value (PARAMPLANE_*, then Slurm, MPI, Kubernetes, torch's env:// names).",
    )
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        placement = resolve(os.environ)
    except ValueError as error:
        print(f"paramplane env: error: {error}", file=sys.stderr)
        return 2
    rows = placement.rows()
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    for name, value, source in rows:
        print(f"{name:<{width}}  {value:<{value_width}}  {source}".rstrip())
    return 0
