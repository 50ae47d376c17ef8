"""GPU EP tests: the drop's virtual-rank suite on one GPU (``gpu``) and the real multi-GPU
suite, pytest starting torchrun (``gpu_2``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")


@pytest.mark.gpu
def test_virtual_ranks_suite():
    """W = 1, 2, 4, 8 virtual ranks on one GPU (own streams, co-resident grids): bit-exact vs the
    torch reference, uneven T incl. 0, many forwards (epoch flags), stalls -> error words."""
    _sm90()
    from moe_ep.shim import drop_src

    env = dict(os.environ, PYTHONPATH=str(drop_src("sm90", "megamoe")) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "sm90_megamoe.ep_runner", "--suite"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ALL OK" in p.stdout, p.stdout[-4000:] + p.stderr[-3000:]
    assert "FAIL" not in p.stdout.split("suite summary")[-1]


@pytest.mark.gpu
def test_layout_runner():
    """The drop's own layout checks: exact (expert, slot, k) order for many W / K / E_l / chunk
    counts, stale scratch, repeat bit-identical, the wait timeout."""
    _sm90()
    from moe_ep.shim import drop_src

    env = dict(os.environ, PYTHONPATH=str(drop_src("sm90", "megamoe")) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "sm90_megamoe.layout_runner", "--no-timing"], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ALL OK" in p.stdout, p.stdout[-4000:] + p.stderr[-3000:]


PARTS = ["oracle", "graph many determinism bad layers stall"]


@pytest.mark.parametrize("n,part", [
    *[pytest.param(2, p, marks=pytest.mark.gpu_2) for p in PARTS],
    *[pytest.param(4, p, marks=pytest.mark.gpu_4) for p in PARTS],
    *[pytest.param(8, p, marks=pytest.mark.gpu_8) for p in PARTS],
])
def test_multi_gpu(n, part):
    """The EP layer over n GPUs of one host (torchrun, NCCL, NVSHMEM peer pointers over NVLink)."""
    _sm90()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(HERE / "ep_gpu_worker.py"), *part.split()]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-4000:]
    assert p.stdout.count("ALL OK") == n
