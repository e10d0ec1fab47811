"""pp.DiLoCo (issue 30) in one world of 4 ranks on 2 emulated hosts (tests/workers/diloco.py): H = 1 equals
DDP, H = 4 Nesterov, fragments and overlap equal a single-process simulation step for step (float64, 1e-10),
the fragment schedule and the wire dtypes seen at the group, bounded quantisation error, checkpoint round
trips (plain, FSDP shards, torch), FSDP inside a host and a torch module with torch.optim.Adam inside."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from _world import run_world

from paramplane.parallel.diloco_comm import INT8_BLOCK, dequantize_int8, quantize_int8

HOSTS = {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}


def test_int8_blocks_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3 * INT8_BLOCK + 17) * np.repeat([1e-3, 1.0, 50.0, 0.0], [256, 256, 256, 17])
    x[-17:] = 0.0  # an all-zero block: scale 0, values 0
    q, scales = quantize_int8(x)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and q.size == 4 * INT8_BLOCK
    back = dequantize_int8(q, scales)[: x.size]
    step = np.repeat(scales, INT8_BLOCK)[: x.size]
    assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(back[-17:] == 0)


@pytest.mark.timeout(200)
def test_diloco_world_4_on_two_hosts() -> None:
    world = run_world(
        4,
        "diloco.py",
        env={"PARAMPLANE_TIMEOUT": "60"},
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()},
        timeout=180,
    )
    with_torch = importlib.util.find_spec("torch") is not None  # the torch module under DiLoCo runs too
    results = world.check_ok(min_checks=200 if with_torch else 190)
    assert all(bool(r["values"].get("torch_checked")) == with_torch for r in results)
    errors = results[0]["values"]["wire_errors"]
    assert errors["float16"] < errors["bfloat16"], errors
