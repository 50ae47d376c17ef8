"""NVSHMEM bootstrap: verdict agreement before any collective set-up, symmetric-heap sizing and
accounting, NVSHMEM_SYMMETRIC_SIZE parsing, no lock held across collectives. GPU-free: fake ops;
the multirank tests run the real torch.distributed exchange over gloo in torchrun."""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from nvshmem_fakes import ROOT_UID, FakeOps, lock_is_free

from moe_ep.shim import BootstrapError, NvshmemOwnershipError, SymmetricHeapError, parse_size
from moe_ep.shim import nvshmem_boot
from moe_ep.shim.nvshmem_boot import heap_cost, heap_size_for

HERE = Path(__file__).resolve().parent
ENV = nvshmem_boot.SIZE_ENV
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def clean(monkeypatch):
    """No runtime before or after; NVSHMEM_SYMMETRIC_SIZE unset, and restored whatever acquire does."""
    assert nvshmem_boot.current() is None
    monkeypatch.setenv(ENV, "0")  # recorded, so that the delenv below is undone at teardown
    monkeypatch.delenv(ENV)
    yield monkeypatch
    nvshmem_boot._RUNTIME = None
    nvshmem_boot._BUSY = False


def acquire(rank=0, nranks=1, **kw):
    kw.setdefault("ops", FakeOps())
    kw.setdefault("uid_exchange", lambda raw, size: ROOT_UID)
    return nvshmem_boot.acquire(group_info=(rank, list(range(nranks))), device_index=0, **kw)


def others(answers):
    """Verdict exchange where the other ranks answer ``answers[r](my_verdict)`` (default: like me)."""
    def agree(v):
        n = len(v.global_ranks)
        return [v if r == v.rank else answers.get(r, lambda m: m)(dataclasses.replace(v, rank=r)) for r in range(n)]
    return agree


# ---- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("1073741824", GiB), ("512M", 512 * MiB), ("512m", 512 * MiB), ("2G", 2 * GiB), ("1GB", GiB),
    ("1gb", GiB), ("1GiB", GiB), ("4k", 4096), ("1T", 1 << 40), ("1.5G", 3 * GiB // 2), ("0.5k", 512),
    ("1e3", 1000), ("  2G", 2 * GiB), ("0", 0), ("1.0000001", 2),  # rounded up to whole bytes
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "   ", "abc", "-1", "-1G", "1X", "1B", "G", "1 G", "2G ", "0x10", "1GBB",
                                  "1.2.3", None])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_heap_size_formula():
    assert heap_size_for(None) == heap_size_for(0) == heap_size_for(100 * MiB) == GiB  # the 1 GiB floor
    assert heap_size_for(2 * GiB) == 2 * GiB + GiB // 2 + 64 * MiB
    odd = heap_size_for(GiB + 1)
    assert odd % (2 * MiB) == 0 and odd >= GiB + 1 + GiB // 4 + 64 * MiB
    assert heap_cost(1) == 512 + 1024 and heap_cost(512) == 512 + 1024 and heap_cost(513) == 1024 + 1024


# ---- NVSHMEM_SYMMETRIC_SIZE ------------------------------------------------------------------------
def test_env_set_when_unset(clean):
    rt = acquire(heap_bytes=3 * GiB)
    want = heap_size_for(3 * GiB)
    assert os.environ[ENV] == str(want) and rt.heap_bytes == want and rt.heap_env == str(want)
    rt.release()


def test_env_default_without_heap_bytes(clean):
    rt = acquire()
    assert os.environ[ENV] == str(GiB) and rt.heap_bytes == GiB
    rt.release()


def test_env_respected_when_set(clean):
    clean.setenv(ENV, "2G")
    rt = acquire(heap_bytes=GiB)
    assert os.environ[ENV] == "2G" and rt.heap_bytes == 2 * GiB and rt.heap_env == "2G"
    rt.release()


def test_env_too_small_fails_before_init(clean):
    clean.setenv(ENV, "512M")
    ops = FakeOps()
    with pytest.raises(SymmetricHeapError) as ei:
        acquire(ops=ops, heap_bytes=GiB)
    msg = str(ei.value)
    assert isinstance(ei.value, BootstrapError) and ei.value.failures.keys() == {0}
    assert f"{ENV}=512M ({512 * MiB} bytes" in msg and f"{heap_cost(GiB)} bytes" in msg
    assert f"set {ENV}={heap_size_for(GiB) >> 20}M" in msg and "before the first layer is built" in msg
    assert not ops.calls("init") and nvshmem_boot.current() is None and os.environ[ENV] == "512M"


def test_env_unreadable(clean):
    clean.setenv(ENV, "lots")
    ops = FakeOps()
    with pytest.raises(SymmetricHeapError, match=r"NVSHMEM_SYMMETRIC_SIZE='lots' cannot be read"):
        acquire(ops=ops)
    assert not ops.calls("init")


def test_bad_heap_bytes_argument(clean):
    with pytest.raises(BootstrapError, match="heap_bytes must be a non-negative int"):
        acquire(heap_bytes=-5)


# ---- heap accounting -------------------------------------------------------------------------------
def test_heap_accounting_and_error_message(clean):
    clean.setenv(ENV, "1M")
    ops = FakeOps()
    rt = acquire(ops=ops)
    assert rt.heap_bytes == MiB and rt.allocated == 0 and rt.heap_free == MiB
    t = rt.tensor((1000,), torch.float32)
    assert rt.allocated == heap_cost(4000) == 5120
    u = rt.tensor((10, 10), torch.bfloat16)
    assert rt.allocated == 5120 + heap_cost(200)
    rt.free(t)
    assert rt.allocated == heap_cost(200) and rt.heap_free == MiB - heap_cost(200)
    with pytest.raises(ValueError, match="not allocated"):
        rt.free(t)
    n_before = len(ops.calls("tensor"))
    with pytest.raises(SymmetricHeapError) as ei:
        rt.tensor((MiB,), torch.uint8)
    msg = str(ei.value)
    assert f"needs {heap_cost(MiB)} bytes" in msg and f"only {MiB - heap_cost(200)} bytes" in msg
    assert f"of the {MiB} bytes (1.0 MiB) heap" in msg and f"{ENV}=1M)" in msg
    assert f"set {ENV}=1024M (or more)" in msg and "before the first layer is built" in msg
    assert len(ops.calls("tensor")) == n_before and rt.allocated == heap_cost(200)  # nothing attempted
    with pytest.raises(SymmetricHeapError, match="too small for layer 7's workspace"):
        rt.ensure_heap(MiB, "layer 7's workspace")
    rt.ensure_heap(MiB - heap_cost(200) - 1024)  # exactly fits
    rt.release()
    assert rt.allocated == 0 and ops.calls("free")[-1] == ("free", tuple(u.shape))


def test_failed_malloc_is_not_counted(clean):
    ops = FakeOps()
    rt = acquire(ops=ops)

    def boom(shape, dtype):
        raise RuntimeError("nvshmem_malloc failed")
    ops.tensor = boom
    with pytest.raises(RuntimeError, match="malloc failed"):
        rt.tensor((1024,), torch.uint8)
    assert rt.allocated == 0
    rt.release()


def test_acquire_on_live_runtime_checks_free_heap(clean):
    clean.setenv(ENV, "1M")
    ops = FakeOps()
    rt = acquire(ops=ops, nranks=2, agree=others({}))
    rt.tensor((600 * 1024,), torch.uint8)
    with pytest.raises(SymmetricHeapError) as ei:
        acquire(ops=ops, nranks=2, agree=others({}), heap_bytes=600 * 1024)
    assert isinstance(ei.value, BootstrapError) and ei.value.failures.keys() == {0, 1}
    assert rt.refs == 1
    assert acquire(ops=ops, nranks=2, agree=others({}), heap_bytes=100 * 1024) is rt and rt.refs == 2
    assert len(ops.calls("init")) == 1
    rt.release()
    rt.release()


# ---- agreement -------------------------------------------------------------------------------------
def test_peer_ownership_failure_raises_here_before_any_collective_setup(clean):
    ops, uids = FakeOps(), []
    foreign = "NVSHMEM is already initialised in this process by another library"
    agree = others({1: lambda v: dataclasses.replace(v, error=foreign, kind="ownership")})
    with pytest.raises(NvshmemOwnershipError) as ei:
        acquire(ops=ops, nranks=3, agree=agree, uid_exchange=lambda raw, n: uids.append(raw) or ROOT_UID)
    e = ei.value
    assert isinstance(e, BootstrapError) and e.failures == {1: foreign}
    assert "failed on rank 1 (global 1)" in str(e) and foreign in str(e) and "every rank raises" in str(e)
    assert uids == [] and not ops.calls("init") and nvshmem_boot.current() is None
    assert ENV not in os.environ and not nvshmem_boot._BUSY


def test_local_ownership_failure_is_exchanged_not_raised_early(clean):
    seen = []
    with pytest.raises(NvshmemOwnershipError, match="another library"):
        acquire(ops=FakeOps(initialized=True), rank=1, nranks=2,
                agree=lambda v: seen.append(v) or [dataclasses.replace(v, rank=0, error=None, kind=None), v])
    assert len(seen) == 1 and seen[0].kind == "ownership" and seen[0].rank == 1


def test_mixed_failures_raise_plain_bootstrap_error(clean):
    agree = others({1: lambda v: dataclasses.replace(v, error="owned", kind="ownership"),
                    2: lambda v: dataclasses.replace(v, error="too small", kind="heap")})
    with pytest.raises(BootstrapError) as ei:
        acquire(nranks=3, agree=agree)
    assert not isinstance(ei.value, (NvshmemOwnershipError, SymmetricHeapError))
    assert "ranks 1, 2 (global 1, 2)" in str(ei.value) and ei.value.failures == {1: "owned", 2: "too small"}


def test_peer_heap_failure_raises_heap_error(clean):
    agree = others({1: lambda v: dataclasses.replace(v, error="heap too small", kind="heap")})
    with pytest.raises(SymmetricHeapError) as ei:
        acquire(nranks=2, agree=agree)
    assert isinstance(ei.value, BootstrapError) and "rank 1" in str(ei.value)


@pytest.mark.parametrize("step", ["make_uid", "check_device"])
def test_local_exception_becomes_agreed_error(clean, step):
    with pytest.raises(BootstrapError, match=f"(?s)failed on rank 0.*RuntimeError: fake {step} failure"):
        acquire(ops=FakeOps(fail=step))
    assert nvshmem_boot.current() is None


def test_heap_size_agreed_as_max_over_ranks(clean):
    agree = others({1: lambda v: dataclasses.replace(v, heap_bytes=4 * GiB)})
    rt = acquire(nranks=2, agree=agree, heap_bytes=MiB)
    assert rt.heap_bytes == 4 * GiB and os.environ[ENV] == str(4 * GiB)
    rt.release()


def test_env_must_match_on_every_rank(clean):
    clean.setenv(ENV, "2G")
    ops = FakeOps()
    with pytest.raises(BootstrapError, match=r"same size on every rank or on none \(rank 0: 2147483648; rank 1: unset"):
        acquire(ops=ops, nranks=2, agree=others({1: lambda v: dataclasses.replace(v, heap_user=False)}))
    with pytest.raises(BootstrapError, match=r"rank 1: 1073741824"):
        acquire(ops=ops, nranks=2, agree=others({1: lambda v: dataclasses.replace(v, heap_bytes=GiB)}))
    assert not ops.calls("init")


def test_ranks_disagree_on_live_runtime_or_group(clean):
    with pytest.raises(BootstrapError, match=r"live on rank 1 \(global 1\) but not on the others"):
        acquire(nranks=2, agree=others({1: lambda v: dataclasses.replace(v, attach=True)}))
    with pytest.raises(BootstrapError, match="disagree on the group"):
        acquire(nranks=2, agree=others({1: lambda v: dataclasses.replace(v, global_ranks=(0, 7))}))
    with pytest.raises(BootstrapError, match="expected one from each of 2 ranks"):
        acquire(nranks=2, agree=lambda v: [v])


def test_exchange_failure_is_a_bootstrap_error(clean):
    def broken(v):
        raise RuntimeError("gloo: connection reset by peer")
    with pytest.raises(BootstrapError, match="exchanging verdicts failed on rank 0: RuntimeError: gloo"):
        acquire(nranks=2, agree=broken)
    assert not nvshmem_boot._BUSY


def test_init_failure_after_agreement(clean):
    with pytest.raises(BootstrapError, match="NVSHMEM init failed on rank 0 .*after every rank agreed"):
        acquire(ops=FakeOps(fail="init"))
    assert nvshmem_boot.current() is None and not nvshmem_boot._BUSY


# ---- locking ---------------------------------------------------------------------------------------
def test_lock_not_held_across_collectives(clean):
    where = []

    def check(name):
        where.append((name, lock_is_free()))
    ops = FakeOps(on_collective=check)

    def agree(v):
        check("agree")
        return others({})(v)

    def uid_exchange(raw, size):
        check("uid_exchange")
        return ROOT_UID
    rt = acquire(ops=ops, nranks=2, agree=agree, uid_exchange=uid_exchange, heap_bytes=MiB)
    acquire(ops=ops, nranks=2, agree=agree)
    t = rt.tensor((8,), torch.int64)
    rt.barrier(None)
    rt.free(t)
    rt.tensor((8,), torch.int64)
    rt.release()
    rt.release()
    names = [n for n, _ in where]
    assert names == ["agree", "uid_exchange", "init", "agree", "tensor", "barrier", "free", "tensor",
                     "free", "finalize"], names
    assert all(free for _, free in where), where


def test_concurrent_acquire_waits_without_holding_the_lock(clean):
    ops = FakeOps()
    entered, go, results = threading.Event(), threading.Event(), {}

    def slow_agree(v):
        entered.set()
        assert go.wait(10)
        return [v]

    def run(name, **kw):
        results[name] = acquire(ops=ops, **kw)
    a = threading.Thread(target=run, args=("a",), kwargs={"agree": slow_agree})
    a.start()
    assert entered.wait(10)
    b = threading.Thread(target=run, args=("b",))
    b.start()
    b.join(0.3)
    assert b.is_alive() and "b" not in results  # waits for a's bootstrap ...
    assert lock_is_free()  # ... without anyone holding the lock
    go.set()
    a.join(10)
    b.join(10)
    assert results["a"] is results["b"] and results["a"].refs == 2 and len(ops.calls("init")) == 1
    results["a"].release()
    results["a"].release()


# ---- multirank (torchrun, gloo) --------------------------------------------------------------------
def torchrun(n, *args, timeout=180):
    """Run tests/nvshmem_worker.py on ``n`` CPU ranks; a hang fails the test (the whole process
    group is killed) instead of blocking it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop(ENV, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           str(HERE / "nvshmem_worker.py"), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"torchrun hung (> {timeout} s): a rank was left blocked\n{out[-3000:]}\n{err[-3000:]}")
    return p.returncode, out, err


@pytest.mark.multirank
@pytest.mark.parametrize("n", [2, 4])
def test_multirank_bootstrap_agreement(n):
    scenarios = ["ok", "owner", "device", "envmismatch", "heap"]
    rc, out, err = torchrun(n, *scenarios)
    assert rc == 0, out[-4000:] + err[-4000:]
    for r in range(n):
        for s in scenarios:
            assert f"rank {r}/{n}: {s} OK" in out, (r, s, out[-4000:])
        assert (f"rank {r}: owner raised AgreedOwnershipError: NVSHMEM bootstrap over global ranks "
                f"{tuple(range(n))} failed on rank 1 (global 1)") in out, out[-4000:]
