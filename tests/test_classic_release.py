"""Drop v113: the classic launch path's conversion caches (one entry per argument role, each
holding its tensor alive) are dropped after a warm-up, so a layer does not keep its throw-away
tokens and routing alive. Without apache-tvm-ffi, 49 Qwen3 layers held 0.61 GiB on an H100 where
one workspace needs 0.41 (the 61st session, ``test_one_workspace_for_48_layers``): each layer's EP
and layout launchers kept the warm-up's last tokens.

CPU: the drop's ``EpRank`` / ``Layout`` caches keep the last tensor of a role alive until
``release()`` (checked with a weak reference, the conversion done on a CPU tensor); the shim's
sessions release every launcher they hold; the BF16 backend's warm-up releases its GEMMs, EP
sessions and layouts."""

import gc
import weakref

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))


@pytest.mark.parametrize("module,cls", [("ep_launch", "EpRank"), ("layout_launch", "Layout")])
def test_drop_cache_holds_the_last_tensor_until_release(module, cls):
    import importlib

    mod = importlib.import_module(f"sm90_megamoe.{module}")
    launcher = object.__new__(getattr(mod, cls))  # only the conversion cache's state
    launcher.ffi, launcher._conv = False, {}
    t = torch.randn(8, 64).to(torch.bfloat16)
    first = launcher._cv("x", t, 16, True)
    assert launcher._cv("x", t, 16, True) is first  # the cache hit the role exists for
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is not None  # the cache keeps the caller's tensor alive
    launcher.release()
    del first
    gc.collect()
    assert ref() is None and launcher._conv == {}


class _Rec:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def release(self):
        self.log.append(self.name)


def test_sessions_release_every_launcher():
    from moe_ep.shim.drops.sm90_megamoe_ep import EpSession
    from moe_ep.shim.drops.sm90_megamoe_layout import LayoutSession

    log = []
    lay = object.__new__(LayoutSession)
    lay._layouts = {132: _Rec(log, "layout132"), 32: _Rec(log, "layout32")}
    lay.release()
    ep = object.__new__(EpSession)
    ep.ep = _Rec(log, "ep")
    ep.release()
    assert sorted(log) == ["ep", "layout132", "layout32"]
    ep.ep = None  # a virtual rank not yet connected
    ep.release()


def test_bf16_warmup_releases_gemms_sessions_and_layouts():
    from moe_ep.backends.sm90.bf16_cutedsl.backend import Sm90CuteDSLBackend

    log, warm = [], []
    b = object.__new__(Sm90CuteDSLBackend)
    b.cfg = type("Cfg", (), {"activation": "swiglu", "max_tokens_per_rank": 256})()
    b.arch, b.W, b.virtual = "sm_90a", 1, False
    b.fc1, b.fc2, b.fc1_decode, b.fc2_decode = _Rec(log, "fc1"), _Rec(log, "fc2"), None, None
    b.ep, b.layout = _Rec(log, "ep"), _Rec(log, "layout")
    b._ensure = lambda: None
    b._warm_forward = lambda T: warm.append((T, list(log)))
    b.check = lambda: None
    b.warmup(lambda msg: None)
    assert warm == [(64, [])]  # the forward first, then the releases
    assert sorted(log) == ["ep", "fc1", "fc2", "layout"]
