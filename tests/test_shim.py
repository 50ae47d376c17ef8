"""Shim: drop paths and collisions, compile cache, mirrored constants, NVSHMEM runtime logic,
counter contract. GPU-free: NVSHMEM is driven through a fake ops object."""

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from moe_ep.shim import (COMPILE_CACHE, CaptureError, CompileCache, ConstantDriftError, CounterContract,
                         DropCollisionError, MirroredConstants, NvshmemOwnershipError, register_drop,
                         zero_counter_regions)
from moe_ep.shim import cache as shim_cache
from moe_ep.shim import nvshmem_boot


def _mkdrop(root, pkg, body="X = 1\n"):
    src = root / "src"
    (src / pkg).mkdir(parents=True)
    (src / pkg / "__init__.py").write_text(body)
    return src


def test_register_drop_idempotent_and_importable(tmp_path):
    src = _mkdrop(tmp_path / "a", "shimtest_pkg_a", "VALUE = 41 + 1\n")
    assert register_drop(src) == ("shimtest_pkg_a",)
    n = sys.path.count(str(src.resolve()))
    register_drop(src)
    assert sys.path.count(str(src.resolve())) == n == 1
    import shimtest_pkg_a

    assert shimtest_pkg_a.VALUE == 42


def test_register_drop_collision_names_both_trees(tmp_path):
    a = _mkdrop(tmp_path / "a", "shimtest_clash")
    b = _mkdrop(tmp_path / "b", "shimtest_clash")
    register_drop(a)
    with pytest.raises(DropCollisionError) as ei:
        register_drop(b)
    assert str(a.resolve()) in str(ei.value) and str(b.resolve()) in str(ei.value)


def test_register_drop_collision_with_imported_module(tmp_path):
    src = _mkdrop(tmp_path / "c", "json")  # 'json' is already imported from the stdlib
    import json  # noqa: F401

    with pytest.raises(DropCollisionError, match="already imported from"):
        register_drop(src)


@dataclass(frozen=True)
class Key:
    kernel: str
    n: int


@dataclass
class MutableKey:
    kernel: str


def test_compile_cache_hits_misses():
    c = CompileCache()
    calls = []
    f = lambda: calls.append(1) or object()  # noqa: E731
    a = c.get_or_compile(Key("fc1", 128), f)
    b = c.get_or_compile(Key("fc1", 128), f)
    d = c.get_or_compile(Key("fc1", 256), f)
    assert a is b and a is not d and len(calls) == 2
    assert c.stats() == {"entries": 2, "hits": 1, "misses": 2}
    with pytest.raises(TypeError, match="frozen dataclass"):
        c.get_or_compile(("fc1", 1), f)
    with pytest.raises(TypeError, match="frozen"):
        c.get_or_compile(MutableKey("x"), f)
    assert isinstance(COMPILE_CACHE, CompileCache)


def test_no_compile_during_capture(monkeypatch):
    monkeypatch.setattr(shim_cache, "is_capturing", lambda: True)
    c, compiled = CompileCache(), []
    with pytest.raises(CaptureError, match="warmup"):
        c.get_or_compile(Key("fc2", 1), lambda: compiled.append(1))
    assert len(c) == 0 and compiled == []  # refused before compiling, not after


def test_mirrored_constants_drift():
    mod = types.SimpleNamespace(TILE_M=128, ALIGN=8)
    ok = MirroredConstants("d", {"m": {"TILE_M": 128, "ALIGN": 8}})
    ok.ensure_checked(lambda name: mod)
    bad = MirroredConstants("d", {"m": {"TILE_M": 64, "GONE": 1}})
    assert bad.drift(lambda name: mod) == [("m", "TILE_M", 64, 128), ("m", "GONE", 1, "<missing>")]
    with pytest.raises(ConstantDriftError, match=r"m.TILE_M: shim mirrors 64, drop has 128"):
        bad.ensure_checked(lambda name: mod)


class FakeOps:
    def __init__(self, initialized=False):
        self.initialized = initialized
        self.log = []

    def status_initialized(self):
        return self.initialized

    def make_uid(self, root):
        return b"ROOTUID!" if root else b"\0" * 8

    def uid_to_bytes(self, uid):
        return uid

    def uid_from_bytes(self, raw):
        return raw

    def init(self, dev, uid, rank, nranks):
        self.log.append(("init", dev, uid, rank, nranks))

    def finalize(self):
        self.log.append(("finalize",))

    def tensor(self, shape, dtype):
        self.log.append(("tensor", tuple(shape)))
        return torch.zeros(shape, dtype=dtype)

    def free(self, t):
        self.log.append(("free", tuple(t.shape)))

    def peer(self, t, pe):
        return ("peer", pe)

    def barrier(self, stream):
        self.log.append(("barrier",))


@pytest.fixture(autouse=False)
def clean_runtime(monkeypatch):
    assert nvshmem_boot.current() is None
    monkeypatch.setenv(nvshmem_boot.SIZE_ENV, "0")  # recorded, so acquire's setting is undone too
    monkeypatch.delenv(nvshmem_boot.SIZE_ENV)
    yield
    nvshmem_boot._RUNTIME = None
    nvshmem_boot._BUSY = False


def peers_agree(nranks):
    """Verdict exchange for one simulated rank of ``nranks``: the others answer like this one."""
    import dataclasses

    return lambda v: [v if r == v.rank else dataclasses.replace(v, rank=r) for r in range(nranks)]


def test_nvshmem_refcount_uid_broadcast_finalize(clean_runtime):
    ops = FakeOps()
    seen = []

    def exchange(raw, size):  # rank 1: receives rank 0's uid
        seen.append((raw, size))
        return b"ROOTUID!"

    rt = nvshmem_boot.acquire(ops=ops, group_info=(1, [4, 5]), uid_exchange=exchange, device_index=1,
                              agree=peers_agree(2))
    assert seen == [(None, 8)]
    assert ops.log == [("init", 1, b"ROOTUID!", 1, 2)]
    rt2 = nvshmem_boot.acquire(ops=ops, group_info=(1, [4, 5]), uid_exchange=exchange, agree=peers_agree(2))
    assert rt2 is rt and rt.refs == 2 and len(seen) == 1
    t = rt.tensor((3, 4), torch.float32)
    assert rt.peers(t)[1] is t and rt.peers(t)[0] == ("peer", 0)
    with pytest.raises(NvshmemOwnershipError, match="second group"):
        nvshmem_boot.acquire(ops=ops, group_info=(0, [0, 1]), uid_exchange=exchange, agree=peers_agree(2))
    rt.release()
    assert ("finalize",) not in ops.log
    rt.release()
    assert ops.log[-2:] == [("free", (3, 4)), ("finalize",)]
    assert nvshmem_boot.current() is None
    with pytest.raises(RuntimeError, match="finalised"):
        rt.tensor((1,), torch.float32)
    with pytest.raises(RuntimeError, match="released more often"):
        rt.release()


def test_nvshmem_refuses_foreign_runtime(clean_runtime):
    with pytest.raises(NvshmemOwnershipError, match="another library"):
        nvshmem_boot.acquire(ops=FakeOps(initialized=True), group_info=(0, [0]), uid_exchange=lambda r, s: r)


def test_nvshmem_no_alloc_during_capture(clean_runtime, monkeypatch):
    ops = FakeOps()
    rt = nvshmem_boot.acquire(ops=ops, group_info=(0, [0]), uid_exchange=lambda r, s: r)
    monkeypatch.setattr(shim_cache, "is_capturing", lambda: True)
    before = rt.allocated
    with pytest.raises(CaptureError, match="symmetric-memory allocation"):
        rt.tensor((2,), torch.int32)
    assert rt.allocated == before and not [e for e in ops.log if e[0] == "tensor"]  # refused before allocating
    monkeypatch.undo()
    rt.release()


def test_counter_contract():
    bufs = {"counts": torch.randint(1, 9, (4, 8), dtype=torch.int32), "flags": torch.ones(3, dtype=torch.int64),
            "data": torch.ones(5)}
    CounterContract("k", tail_clean=False, regions=("counts", "flags")).prepare(bufs)
    assert (bufs["counts"] == 0).all() and (bufs["flags"] == 0).all() and (bufs["data"] == 1).all()
    CounterContract("k", tail_clean=True).prepare({"x": torch.ones(1)})
    with pytest.raises(ValueError, match="must list"):
        CounterContract("k", tail_clean=False)
    with pytest.raises(ValueError, match="no regions"):
        CounterContract("k", tail_clean=True, regions=("a",))
    with pytest.raises(KeyError, match="missing|not among"):
        CounterContract("k", tail_clean=False, regions=("nope",)).prepare(bufs)
    t = torch.arange(1, 5)
    zero_counter_regions([t])
    assert (t == 0).all()


def test_decode_kernels_are_a_static_per_shape_choice():
    """The shim picks swap-AB (decode) GEMMs from the mean rows per expert a layer expects, never
    from routing; a large-capacity layer also gets decode variants, chosen per call from T."""
    import torch

    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import _gemm_specs
    from moe_ep.shim import SM90_DECODE_MAX_ROWS_PER_EXPERT, sm90_pick_schedule

    assert SM90_DECODE_MAX_ROWS_PER_EXPERT == 32
    assert sm90_pick_schedule("swiglu", 2048, 0.06) == ("swapab", 8)
    assert sm90_pick_schedule("swiglu", 2048, 8) == ("swapab", 16)
    assert sm90_pick_schedule("identity", 768, 32) == ("swapab", 64)
    assert sm90_pick_schedule("swiglu", 2048, 33)[0] == "cooperative"
    assert sm90_pick_schedule("identity", 768, 33)[0] == "pingpong"  # FC2 past decode (drop v71)
    assert sm90_pick_schedule("identity", 768, None)[0] == "pingpong"
    qwen = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8, dtype=torch.bfloat16)
    small = _gemm_specs(MoEConfig(max_tokens_per_rank=256, **qwen), 128)
    assert set(small) == {"fc1", "fc2"} and small["fc1"]["rows_per_expert"] == 16
    big = _gemm_specs(MoEConfig(max_tokens_per_rank=8192, **qwen), 64, world=2)
    assert set(big) == {"fc1", "fc2", "fc1_decode", "fc2_decode"}
    assert big["fc1"]["rows_per_expert"] == 1024 and big["fc2_decode"]["rows_per_expert"] == 32
    assert big["fc1_decode"]["num_experts"] == 64 and big["fc2_decode"]["scale_rows"]


def test_single_rank_combine_kernel_compiles_only_for_one_rank():
    """combine_local (drop v14) is built on request for W = 1 only: sm_90a PTX with the vectorised row sum and
    no flag traffic (no release stores, fences or atomics), same host signature as the launcher's
    real tensors; W = 2 neither builds nor accepts it."""
    pytest.importorskip("cutlass")
    from moe_ep.shim import drop_src, register_drop

    register_drop(drop_src("sm90", "megamoe"))
    from sm90_megamoe.ep_compile_check import check
    from sm90_megamoe.ep_launch import EpConfig, kinds_for, make_kernel

    one, two = EpConfig(2048, 8, 1, 256, 128), EpConfig(2048, 8, 2, 256, 128)
    assert "combine_local" not in kinds_for(one)  # built only when asked for
    assert "combine_local" in kinds_for(one, local_combine=True) and "combine_local" not in kinds_for(two, True)
    with pytest.raises(ValueError, match="W = 1"):
        make_kernel("combine_local", two)
    assert check(one, verbose=False) == []


def test_single_rank_combine_is_built_only_when_asked_for(monkeypatch, tmp_path):
    """A one-rank layer's prebuild adds combine_local to the 7 EP kernels (the default);
    MOE_EP_LOCAL_COMBINE=0 leaves the 7."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import prebuild
    from moe_ep.shim import COMPILE_EVENTS

    cfg = MoEConfig(num_experts=16, hidden=256, intermediate=128, top_k=2, max_tokens_per_rank=32)
    for flag, want in (("0", False), (None, True)):
        if flag is None:
            monkeypatch.delenv("MOE_EP_LOCAL_COMBINE", raising=False)
        else:
            monkeypatch.setenv("MOE_EP_LOCAL_COMBINE", flag)
        seen = len(COMPILE_EVENTS)
        prebuild(cfg, 1, kernels=("ep",))
        names = [e.name for e in COMPILE_EVENTS[seen:]]
        assert ("ep_combine_local" in names) == want, names
        assert len(names) == (8 if want else 7), names


def test_single_rank_route_is_the_default(monkeypatch, tmp_path):
    """A one-rank layer's prebuild adds drop v19's LocalRoute kernels to the layout kernels (the
    default); MOE_EP_LOCAL_ROUTE=0 leaves them out, and a two-rank layer never builds them."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("MOE_EP_CACHE_DIR", str(tmp_path))
    from moe_ep.api import MoEConfig
    from moe_ep.backends.sm90.bf16_cutedsl.backend import prebuild
    from moe_ep.shim import COMPILE_EVENTS

    cfg = MoEConfig(num_experts=16, hidden=256, intermediate=128, top_k=2, max_tokens_per_rank=32)
    for flag, world, want in (("0", 1, False), (None, 1, True), (None, 2, False)):
        if flag is None:
            monkeypatch.delenv("MOE_EP_LOCAL_ROUTE", raising=False)
        else:
            monkeypatch.setenv("MOE_EP_LOCAL_ROUTE", flag)
        seen = len(COMPILE_EVENTS)
        prebuild(cfg, world, kernels=("layout",))
        names = [e.name for e in COMPILE_EVENTS[seen:]]
        assert ("layout_route" in names) == want and ("layout_route_i64" in names) == want, names


def test_layout_chunks_knob(monkeypatch):
    """MOE_EP_LAYOUT_CHUNKS caps the layout kernels' chunks (never above the default); bad values
    raise a ValueError naming the variable."""
    from moe_ep.backends.sm90.bf16_cutedsl.backend import layout_chunks

    monkeypatch.delenv("MOE_EP_LAYOUT_CHUNKS", raising=False)
    assert layout_chunks(132) is None and layout_chunks(None) is None  # unset: token-adaptive
    monkeypatch.setenv("MOE_EP_LAYOUT_CHUNKS", "16")
    assert layout_chunks(132) == 16 and layout_chunks(8) == 8
    assert layout_chunks(None) == 16  # the default grid (None: every SM), capped
    for bad in ("0", "-3", "x", "1.5"):
        monkeypatch.setenv("MOE_EP_LAYOUT_CHUNKS", bad)
        with pytest.raises(ValueError, match="MOE_EP_LAYOUT_CHUNKS"):
            layout_chunks(132)


def test_layout_chunks_follow_the_tokens():
    """The adaptive layout grid: 4 chunks up to 16 tokens, doubling per doubling of tokens, the
    full grid past 256 tokens (and never more than the full grid)."""
    from moe_ep.shim.drops.sm90_megamoe import layout_chunks_for

    got = {t: layout_chunks_for(t, 132) for t in (0, 1, 16, 17, 32, 33, 128, 129, 256, 257, 8192)}
    assert got == {0: 4, 1: 4, 16: 4, 17: 8, 32: 8, 33: 16, 128: 32, 129: 64, 256: 64, 257: 132, 8192: 132}
    assert layout_chunks_for(1, 3) == 3 and layout_chunks_for(100, 16) == 16  # a small grid caps it
    assert layout_chunks_for(40, 32) == 16


def test_pdl_launches_are_the_default_and_cached_apart(tmp_path):
    """Drop v20: PDL launches unless SM90_MEGAMOE_PDL=0 (read when the drop is imported); the disk
    cache keeps kernels built with them in their own folder."""
    pytest.importorskip("cutlass")
    import os
    import subprocess
    import sys

    code = ("from moe_ep.shim.drops.sm90_megamoe import cache_namespace, pdl_launches; "
            "print(pdl_launches(), cache_namespace())")
    outs = {}
    for flag in ("0", "1", None):
        env = dict(os.environ, MOE_EP_CACHE_DIR=str(tmp_path))
        env.pop("SM90_MEGAMOE_PDL", None)
        if flag is not None:
            env["SM90_MEGAMOE_PDL"] = flag
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        outs[flag] = p.stdout.split()
    assert outs["0"][0] == "False" and outs["1"][0] == "True" and outs[None] == outs["1"]
    assert outs["1"][1] == outs["0"][1] + "-pdl"


def test_token_grid_of_the_per_token_kernels():
    """EpSession.token_ctas: one warp per token, within [1, the session's grid]."""
    from types import SimpleNamespace

    from moe_ep.shim.drops.sm90_megamoe import EpSession

    s = object.__new__(EpSession)
    s.cfg, s.ep = SimpleNamespace(threads=256), SimpleNamespace(num_ctas=132)
    assert [s.token_ctas(t) for t in (0, 1, 8, 9, 128, 1056, 1057, 8192)] == [1, 1, 1, 2, 16, 132, 132, 132]
    s.ep = SimpleNamespace(num_ctas=16)  # virtual ranks: a smaller grid stays the cap
    assert s.token_ctas(8192) == 16


def test_early_weights_is_the_plain_kernel_without_pdl(tmp_path):
    """Without PDL launches (SM90_MEGAMOE_PDL=0) FC2's ``early_weights`` asks for nothing new: the
    same compiled kernel as without it (one cache entry); other schedules ignore it. In a
    subprocess, because the drop reads the switch when it is imported."""
    pytest.importorskip("cutlass")
    import os
    import subprocess
    import sys

    code = ("from moe_ep.shim import sm90_compiled_grouped_gemm as g\n"
            "from moe_ep.shim.drops.sm90_megamoe import pdl_launches\n"
            "assert not pdl_launches()\n"
            "a = g('identity', 512, 256, 8, True, schedule='swapab', early_weights=True)\n"
            "b = g('identity', 512, 256, 8, True, schedule='swapab')\n"
            "print(a is b, a.early_weights)\n")
    env = dict(os.environ, SM90_MEGAMOE_PDL="0", MOE_EP_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "False"]


def test_local_route_is_for_one_rank_only():
    """Drop v19's LocalRoute replaces the dispatch only with one rank: the shim's layout session
    and the drop's kernel kinds refuse it for world > 1, naming the world size."""
    pytest.importorskip("cutlass")
    from moe_ep.shim import Sm90LayoutSession, drop_src, register_drop

    with pytest.raises(ValueError, match="world=2"):
        Sm90LayoutSession(2048, 8, 2, 64, 64, "cpu", counts=None, route=True)
    register_drop(drop_src("sm90", "megamoe"))
    from sm90_megamoe.layout_launch import KINDS, ROUTE_KINDS, LayoutConfig, kinds_for

    assert kinds_for(LayoutConfig(2048, 8, 1, 64, 128), route=True) == KINDS + ROUTE_KINDS
    assert kinds_for(LayoutConfig(2048, 8, 2, 64, 64)) == KINDS
    with pytest.raises(ValueError, match="world == 1"):
        kinds_for(LayoutConfig(2048, 8, 2, 64, 64), route=True)
