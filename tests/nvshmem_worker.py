"""Multi-rank NVSHMEM bootstrap worker (CPU, gloo, fake NVSHMEM ops), launched through torchrun by
test_nvshmem_boot.py. Each scenario named on the command line runs on every rank; a rank prints
``rank R/W: <scenario> OK`` when its outcome is the expected one (a failing scenario must raise on
EVERY rank, with the failing rank named), then all ranks meet in a barrier, which would hang or
fail if some rank had been left inside a collective.
"""

import os
import sys
from datetime import timedelta

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvshmem_fakes import ROOT_UID, FakeOps  # noqa: E402

from moe_ep.shim import BootstrapError, NvshmemOwnershipError, SymmetricHeapError  # noqa: E402
from moe_ep.shim import nvshmem_boot  # noqa: E402

ENV = nvshmem_boot.SIZE_ENV


def report(line):
    os.write(1, (line + "\n").encode())  # one write: lines of different ranks do not interleave


def expect_raise(exc_type, **kw):
    try:
        nvshmem_boot.acquire(None, device_index=0, **kw)
    except exc_type as e:
        return e
    raise AssertionError(f"acquire did not raise {exc_type.__name__}")


def scenario_ok(r, W):
    """All ranks succeed: uid broadcast over gloo, heap size set and agreed, refcount, free, finalize."""
    ops = FakeOps()
    rt = nvshmem_boot.acquire(None, device_index=0, heap_bytes=3 << 30, ops=ops)
    assert ops.calls("init") == [("init", 0, ROOT_UID, r, W)], ops.log
    want = nvshmem_boot.heap_size_for(3 << 30)
    assert os.environ[ENV] == str(want) and rt.heap_bytes == want, (os.environ[ENV], rt.heap_bytes)
    sizes = [None] * W
    dist.all_gather_object(sizes, rt.heap_bytes)
    assert len(set(sizes)) == 1, sizes
    assert nvshmem_boot.acquire(None, device_index=0, heap_bytes=1 << 20, ops=ops) is rt and rt.refs == 2
    import torch

    t = rt.tensor((256, 8), torch.bfloat16)
    assert rt.allocated == nvshmem_boot.heap_cost(256 * 8 * 2)
    rt.release()
    rt.release()
    assert ops.calls("free") == [("free", tuple(t.shape))] and ops.calls("finalize") == [("finalize",)]
    assert nvshmem_boot.current() is None


def scenario_owner(r, W):
    """NVSHMEM already initialised by somebody else on rank 1 only: every rank raises, naming rank 1."""
    ops = FakeOps(initialized=(r == 1))
    e = expect_raise(NvshmemOwnershipError, ops=ops, heap_bytes=1 << 20)
    msg = str(e)
    assert isinstance(e, BootstrapError), type(e)
    assert "failed on rank 1 (global 1)" in msg and "another library" in msg, msg
    assert e.failures.keys() == {1}, e.failures
    assert not ops.calls("init") and nvshmem_boot.current() is None
    assert ENV not in os.environ  # nothing was set before agreement
    report(f"rank {r}: owner raised {type(e).__name__}: {msg.splitlines()[0]}")


def scenario_device(r, W):
    """A local failure of another kind (bad device) on the last rank: BootstrapError everywhere."""
    ops = FakeOps(fail="check_device" if r == W - 1 else None)
    e = expect_raise(BootstrapError, ops=ops)
    assert not isinstance(e, (NvshmemOwnershipError, SymmetricHeapError)), type(e)
    assert f"failed on rank {W - 1} (global {W - 1})" in str(e) and "fake check_device failure" in str(e), str(e)
    assert not ops.calls("init") and nvshmem_boot.current() is None


def scenario_envmismatch(r, W):
    """NVSHMEM_SYMMETRIC_SIZE differs on rank 1: every rank raises, listing each rank's size."""
    os.environ[ENV] = "2G" if r == 1 else "1G"
    ops = FakeOps()
    e = expect_raise(BootstrapError, ops=ops, heap_bytes=1 << 20)
    assert "same size on every rank" in str(e) and f"rank 1: {2 << 30}" in str(e), str(e)
    assert not ops.calls("init") and nvshmem_boot.current() is None


def scenario_heap(r, W):
    """The user's heap is too small for what is asked (same on every rank): SymmetricHeapError."""
    os.environ[ENV] = "64M"
    ops = FakeOps()
    e = expect_raise(SymmetricHeapError, ops=ops, heap_bytes=100 << 20)
    assert isinstance(e, BootstrapError) and e.failures.keys() == set(range(W)), e
    assert f"{ENV}=64M" in str(e) and not ops.calls("init")


SCENARIOS = {"ok": scenario_ok, "owner": scenario_owner, "device": scenario_device,
             "envmismatch": scenario_envmismatch, "heap": scenario_heap}


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a hang surfaces as an error
    r, W = dist.get_rank(), dist.get_world_size()
    for name in sys.argv[1:] or list(SCENARIOS):
        os.environ.pop(ENV, None)
        SCENARIOS[name](r, W)
        dist.barrier()
        report(f"rank {r}/{W}: {name} OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
