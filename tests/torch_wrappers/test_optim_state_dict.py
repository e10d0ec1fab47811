"""torch FSDP1's full optimizer state dict: ``pp.FSDP.optim_state_dict`` / ``optim_state_dict_to_load``.

FSDP1 scripts save ``{"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}`` with
``torch.save`` and resume with ``optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, saved))``.
Compared with one process's AdamW on the whole batch and with torch's own FSDP1 (over gloo) on the same ranks.
"""

from __future__ import annotations

import importlib.util

import pytest
from _world import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the test extra (torch, transformers)"
)


def test_the_full_optimizer_state_equals_one_process_and_resumes_in_another_layout() -> None:
    """GPT-2, world 2: the state by parameter name equals one process's (tensors, steps, hyperparameters,
    param groups by name under use_orig_params), on every rank, and torch FSDP1's (names, param groups, and the
    tensors where torch's own are distinct: under use_orig_params torch 2.13 returns one storage for a
    parameter's exp_avg and exp_avg_sq); it loads into a plain torch optimizer and, after
    torch.save, into a fresh wrapper of another strategy, where one more step equals one process."""
    out = run_world(2, "optim_full.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=32)


def test_fsdp1s_older_optimizer_state_api_and_state_dict_settings_behave_as_torchs() -> None:
    """GPT-2, world 2: ``FSDP.full_optim_state_dict`` (rank 0 only by default) equals torch FSDP1's and one
    process's; ``rekey_optim_state_dict`` equals torch's both ways; ``shard_full_optim_state_dict`` and
    ``scatter_full_optim_state_dict`` (rank 0 alone holding the dict) load into fresh wrappers of other
    strategies where one more step equals one process; ``state_dict_type`` / ``set_state_dict_type`` /
    ``get_state_dict_type`` / ``fsdp_modules`` answer as torch's, a sharded type is refused."""
    out = run_world(2, "optim_full.py", args=["older"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=18)
