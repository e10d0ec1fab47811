"""``srun paramplane launch --slurm [-n N] script.py``: one launcher per node of a Slurm job step.

Each srun task is one node's launcher; it starts ``-n`` ranks numbered ``SLURM_PROCID * n + i`` out of
``SLURM_NTASKS * n``. The first node's launcher hosts the coordinator at the address ``paramplane.placement``
derives from the node list and the job id; the token comes from ``PARAMPLANE_TOKEN_FILE`` (or ``--token-file``),
else from a 0600 file in the job directory that the first launcher writes (``paramplane.hosting.slurm_token``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from paramplane.hosting import find_or_host
from paramplane.launch import LaunchConfig
from paramplane.node.runtime import RuntimeConfig
from paramplane.placement import Found, resolve, slurm_step
from paramplane.protos.net import resolve_token


def slurm_launch(options: dict[str, Any], launch: Callable[[LaunchConfig], int]) -> int:
    """Build the node's LaunchConfig from the Slurm step, host the coordinator on node 0, run ``launch``."""
    env = os.environ
    step = slurm_step(env)
    if "rank" not in step:
        raise ValueError(
            "--slurm runs as a task of an srun step, and SLURM_STEP_ID, SLURM_PROCID or SLURM_NTASKS is not set "
            "(run `srun --ntasks-per-node=1 paramplane launch --slurm -n N script.py`)"
        )
    if options.pop("world_size", None) is not None:
        raise ValueError(
            "--slurm takes the world size from the job (SLURM_NTASKS times -n); drop --world-size"
        )
    options.pop("coordinator", None)  # argparse: exclusive with --slurm
    options.pop("standalone", None)
    num_tasks, node_index = int(step["world_size"].value), int(step["rank"].value)
    nodes = step.get("num_nodes")
    if nodes is not None and int(nodes.value) != num_tasks:
        raise ValueError(
            f"--slurm runs one launcher per node, but {step['world_size'].source} tasks run on {nodes.source} "
            "nodes: use srun --ntasks-per-node=1"
        )
    per_node = options.pop("num_ranks") or 1
    total = num_tasks * per_node
    placement = resolve(env)
    if placement.coordinator is None:
        raise ValueError("the Slurm step names no node list or job id (SLURM_JOB_NODELIST, SLURM_JOB_ID)")
    placement = dataclasses.replace(
        placement,
        world_size=Found(total, f"{step['world_size'].source} launchers times -n {per_node}"),
        hosts_coordinator=node_index == 0 and "PARAMPLANE_COORDINATOR" not in placement.coordinator.source,
    )
    join = options.get("join_timeout_s") or RuntimeConfig.join_timeout_s
    hosted = find_or_host(placement, resolve_token(options.pop("token")), join, env)
    node = step.get("node")
    restart = step.get("restart_count")
    if node is not None and not options.get("host_id"):
        options["host_id"] = str(node.value)
    try:
        config = LaunchConfig(
            **options,
            num_ranks=per_node,
            coordinator=hosted.address,
            world_size=total,
            first_rank=node_index * per_node,
            restart_base=0 if restart is None else int(restart.value),
            token=hosted.token,
        )
        return launch(config)
    finally:
        hosted.stop()
