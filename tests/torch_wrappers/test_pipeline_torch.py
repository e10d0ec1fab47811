"""Pipelines of torch modules (issue 26): ``pp.pipeline_split`` of transformers GPT-2 and Llama and the
project's torch GPT, every schedule, equal to one process; the checks run in ``tests/workers/pipeline_torch.py``."""

from __future__ import annotations

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

ENV = {"PARAMPLANE_TIMEOUT": "60"}


@pytest.mark.timeout(300)  # its own bound (240 s): one world of 2 ranks, seven pipelines
def test_torch_stages_equal_one_process_under_every_schedule() -> None:
    """pp 2, every schedule: three AdamW steps of GPT-2 and the project's GPT (and Llama and Qwen2 under
    interleaved 1F1B, Mistral under 1F1B: sliding-window attention shorter than the sequence, per layer for Qwen2)
    cut by ``pipeline_split``; every step's loss and gradients and the final parameters equal one process
    on the whole batch (float64 1e-9; Llama 1e-5 for its float32 internals), the attention mask (which changes
    the loss here) reaches every stage, and the tied embedding/head weight is the same on the first and the
    last stage. Then a stage given to the wrong rank and bad boundaries are ValueErrors."""
    out = run_world(2, "pipeline_torch.py", env=ENV, timeout=240).check_ok(min_checks=300)
    tied = out[0]["values"]["tied"]
    assert len(tied) == 9 and all(len(d) == 1 for d in tied.values())
    assert tied == out[1]["values"]["tied"]


def test_keyword_arguments_split_into_microbatches_and_shared_ones_whole() -> None:
    """What every stage's forward gets per microbatch: tensors of ``step``'s kwargs cut along dim 0 (torch's
    default chunking), non-tensors and ``shared=`` values whole; a tensor that does not split is a ValueError."""
    import torch

    from paramplane.parallel.pipeline.torch_stage import split_kwargs

    mask = torch.arange(12).reshape(6, 2)
    causal = torch.ones(3, 3)
    per_mb = split_kwargs({"attention_mask": mask, "scale": 0.5}, {"bias": causal}, 3)
    assert [mb["attention_mask"].tolist() for mb in per_mb] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9], [10, 11]],
    ]
    assert all(mb["scale"] == 0.5 and mb["bias"] is causal for mb in per_mb)
    with pytest.raises(ValueError, match="do not split into 4"):
        split_kwargs({"attention_mask": mask}, None, 4)


@pytest.mark.timeout(300)  # its own bounds: 4 worlds of 2 ranks, 60 s each
def test_torch_stage_pipeline_ranks_exit_cleanly_with_pipelines_alive() -> None:
    """Four worlds, each leaving 30 torch-stage pipelines alive for the interpreter's exit: every rank exits 0
    with no "terminate called" in its output (before the fix, 7 of 8 such worlds had a rank abort)."""
    for _ in range(4):
        out = run_world(2, "pipeline_exit.py", args=["30"], env=ENV, timeout=60)
        out.check_ok(min_checks=30)
        for r in out.ranks:
            assert "terminate called" not in r.output, out.describe()


@pytest.mark.timeout(240)  # its own bound (180 s): one world of 2 ranks, three schedules on each side
def test_torch_stages_equal_torch_pipelining_under_every_schedule() -> None:
    """The same GPT-2 stages (float64, tied head, attention mask) under ``pp.Pipeline`` and under torch's own
    ``torch.distributed.pipelining`` (``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` over
    gloo, its defaults), same microbatches: every step's per-microbatch losses, every gradient and the final
    AdamW parameters agree within 1e-12 relative; then stages that pass a tuple of tensors (pipeline_tuple.py's)
    under every schedule, and transformers' Llama cut by hand into such stages under 1F1B: losses and
    gradients agree within 1e-12."""
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    out = run_world(2, "pipeline_peer.py", env=env, timeout=180).check_ok(min_checks=100)
    assert len(out) == 2


def test_a_torch_stage_activation_that_changes_shape_mid_step_is_a_mismatch_on_both_stages() -> None:
    """The receiver threads turn messages into tensors for torch stages: a shape change at microbatch 2 is
    still a CollectiveMismatch on both ranks (and again on the next step), within the deadline."""
    world = run_world(
        2, "pipeline_torch_faults.py", args=["bad_shape"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90
    )
    assert all(r["num_checks"] == 2 for r in world.check_ok())


def test_a_dead_torch_stage_is_named_not_hung() -> None:
    """As for numpy stages: rank 1 dies, rank 0's step names it after the heartbeat bound (3 s here)."""
    world = run_world(
        2,
        "pipeline_torch_faults.py",
        args=["kill"],
        env={"PARAMPLANE_TIMEOUT": "30"},
        timeout=90,
        heartbeat_timeout_s=3.0,
    )
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == 9
    r0 = world.ranks[0].result
    assert r0 is not None and r0["failures"] == [] and r0["num_checks"] == 1, world.describe()


@pytest.mark.timeout(150)  # its own bound (120 s): one world of 2 ranks, five pipelines
def test_stages_that_pass_a_tuple_of_tensors_equal_one_process_under_every_schedule() -> None:
    """Stages that return ``(hidden, residual, ids)`` (two float64 tensors and an int64 one), taken by the next
    stage as positional arguments, as torch's pipelining allows; the last stage leaves ``residual`` unused.
    Every schedule, three AdamW steps: losses, gradients, final parameters and ``eval_step``'s output equal one
    process (1e-12); transformers' Llama cut by hand into stages passing ``(hidden_states, cos, sin)`` equals
    the whole model in one process too (GPipe, 1F1B). A stage that returns a dict, or changes its number of
    outputs between steps, is a ValueError on its rank and a TransportError on the other."""
    run_world(2, "pipeline_tuple.py", env=ENV, timeout=120).check_ok(min_checks=140)
