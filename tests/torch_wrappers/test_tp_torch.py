"""pp.parallelize: tensor parallel for torch modules (issue 26, "Tensor parallel for torch modules").

Every rank checks in the worker (``tests/workers/tp_torch.py``) against the dense model on one process; these
tests launch the worlds and look at what the ranks reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _world import run_world

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
import _torch_models as tm

pytest.importorskip("torch")
pytest.importorskip("transformers")

VIT = "vit" in tm.MODELS


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
def test_tp2_and_tp3_train_gpt2_and_llama_like_one_process() -> None:
    world = run_world(3, "tp_torch.py", args=["train"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=300)
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 100, counts


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
def test_tp_errors_vocab_parallel_loss_and_checkpoint_at_another_tp_size(tmp_path: Path) -> None:
    world = run_world(
        3, "tp_torch.py", args=["misc", str(tmp_path)], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=300
    )
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 20, counts


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_tp2_llama_equals_torch_parallelize_module() -> None:
    """pp.parallelize and torch's parallelize_module (DTensor, gloo) train the same Llama alike (float64)."""
    env = {"PARAMPLANE_TIMEOUT": "60", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    world = run_world(2, "tp_torch_peer.py", env=env, timeout=180)
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 100, counts


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_adamw_state_saved_at_one_tp_size_resumes_at_another(tmp_path: Path) -> None:
    """AdamW's moments and hyperparameters saved at tp 2 load at tp 4 and 3, tp 4's at 2 and 1, tp 1's at 2,
    resharded like their parameters (column splits written as one range per tp rank); the resumed steps equal
    the uninterrupted run's."""
    world = run_world(
        4, "tp_torch_optim.py", args=[str(tmp_path)], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180
    )
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 100, counts


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_tp2_bart_with_cross_attention_trains_like_one_process() -> None:
    """tp_plan_for on an encoder-decoder (BART: self- and cross-attention split by heads): losses, gradients and
    final parameters equal the dense model's."""
    world = run_world(2, "tp_torch_encdec.py", args=["bart"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 100, counts


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_tp2_t5_with_cross_attention_trains_like_one_process() -> None:
    """tp_plan_for on T5 (self- and cross-attention split by heads, the relative position bias by its head
    columns, gated feed-forward): losses, gradients and final parameters equal the dense model's."""
    world = run_world(2, "tp_torch_encdec.py", args=["t5"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 100, counts


@pytest.mark.skipif(not VIT, reason="timm not installed (make install puts it in .venv/timm)")
@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_tp2_timm_vit_trains_like_one_process() -> None:
    """tp_plan_for on timm's Vision Transformer (fused qkv split by heads, proj row-wise, MLP column/row; the
    class token, position and patch embeddings replicated): losses, gradients and final parameters equal the
    dense model's; heads that do not divide, and a norm over every head, are refused."""
    world = run_world(2, "tp_torch_vit.py", env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 60, counts
