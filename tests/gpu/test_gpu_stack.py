"""Where a GPU exists, the GPU stack must run: cupy sees the device, NCCL makes a unique id, torch is a
CUDA build. ``make test-gpu`` runs this with the gpu tests, so a broken install fails instead of every gpu
test skipping. Skipped only where the machine has no NVIDIA GPU at all."""

from __future__ import annotations

import glob
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.gpu


def _gpu_present() -> bool:
    if glob.glob("/dev/nvidia[0-9]*"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return listed.returncode == 0 and "GPU" in listed.stdout


@pytest.mark.skipif(not _gpu_present(), reason="no NVIDIA GPU on this machine")
def test_cupy_nccl_and_torch_cuda_run_where_a_gpu_exists() -> None:
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as exc:
        pytest.fail(
            f"a GPU exists but cupy or its NCCL binding does not import ({exc}): pip install 'paramplane[gpu]'"
        )
    assert cupy.cuda.runtime.getDeviceCount() >= 1
    assert float(cupy.arange(4, dtype=cupy.float32).sum()) == 6.0
    assert len(nccl.get_unique_id()) > 0
    try:
        import torch
    except ImportError:
        pytest.fail("a GPU exists but torch is not installed: install a CUDA build of torch")
    assert torch.cuda.is_available(), (
        f"a GPU exists but torch {torch.__version__} is not a working CUDA build"
    )
    x = torch.ones(4, device="cuda")
    view = cupy.from_dlpack(x)
    view *= 2
    assert float(x.sum()) == 8.0, "a cupy view of a torch CUDA tensor does not share its memory"
