"""Recording stand-ins shared by the CPU wiring tests of the SM90 backends (no kernel runs)."""


def rec_layout(calls: list):
    """A recording stand-in for the layout session: the plain call, ``route`` and (drop v58)
    ``prepare_route``, whose run records the ``route`` call it stands for."""
    def prepare_route(self, ep, offsets, idx, ws, pos, xs):
        return lambda x, ids, w, tokens=None: calls.append(("route", (ep, x, ids, w, offsets, idx, ws, pos, xs),
                                                            {"tokens": tokens}))
    return type("L", (), {"__call__": lambda self, *a, **k: calls.append(("layout", a, k)),
                          "route": lambda self, *a, **k: calls.append(("route", a, k)),
                          "prepare_route": prepare_route})()


def rec_gemm(calls: list, name: str, **attrs):
    """A recording stand-in for a GEMM launcher named ``name`` (with ``attrs``, e.g. ``gather_a``): its
    plain call records ``(name, args, kwargs)``, and its ``prepare`` (drop v61: the prepared launch made
    at bind) returns a run that records the plain call it stands for (drop v91: with ``a=None`` the
    run takes the source rows per call, ``run(b, bias, a=x)``, and records ``idx``)."""
    def prepare(self, a, offsets, out, row_scale=None, max_active_ctas=None, idx=None):
        extra = {} if idx is None else {"idx": idx}

        def run(b, bias=None, **call):
            calls.append((name, (call.get("a", a), b, offsets), dict(
                out=out, row_scale=row_scale, max_active_ctas=max_active_ctas, bias=bias, **extra)))
        return run
    return type(name, (), {"__call__": lambda self, *a, **k: calls.append((name, a, k)), "prepare": prepare,
                           **attrs})()

def record_gemm_builds(monkeypatch) -> tuple:
    """``(built, names)``: the shim's ``compiled_grouped_gemm`` then records what it would build
    instead of compiling -- each ``CompiledGroupedGemm`` keyword set in ``built``, each disk-cache
    kernel name in ``names`` -- with a fresh compile cache (``moe_ep.shim.cache.COMPILE_CACHE``)."""
    import sm90_megamoe.launch as launch

    from moe_ep.shim import cache
    from moe_ep.shim.drops import sm90_megamoe as s

    built, names = [], []

    class Fake:
        def __init__(self, **kw):
            built.append(kw)
            self.compiled = object()

    def get_or_build(ns, name, key, build, tvm_ffi=False):
        names.append(name)
        return build()

    monkeypatch.setattr(launch, "CompiledGroupedGemm", Fake)
    monkeypatch.setattr(s.disk_cache, "get_or_build", get_or_build)
    monkeypatch.setattr(cache, "COMPILE_CACHE", cache.CompileCache())
    monkeypatch.setattr(s, "COMPILE_CACHE", cache.COMPILE_CACHE)
    return built, names


def check_pingpong_switch(monkeypatch, env: str, use, key_field: str) -> None:
    """The shim's opt-in 0/1 switch ``env`` of a pingpong-only GEMM option: ``use(schedule)`` is off
    unset and under "0", on under "1" for "pingpong" only, any other value raises a ValueError
    naming ``env``; ``GemmKey.<key_field>`` defaults to False (drop v79 ``jump_stages``)."""
    import pytest

    from moe_ep.shim.drops import sm90_megamoe as s

    monkeypatch.delenv(env, raising=False)
    assert not use("pingpong")  # opt-in
    monkeypatch.setenv(env, "0")
    assert not use("pingpong")
    monkeypatch.setenv(env, "1")
    assert use("pingpong")
    assert not any(use(x) for x in ("cooperative", "wide", "swapab"))
    for bad in ("2", "yes", "true", " 1"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            use("pingpong")
    assert s.GemmKey.__dataclass_fields__[key_field].default is False


def check_pingpong_only_option(option: str) -> None:
    """A pingpong-only option of the drop's BF16 GEMM (drop v79 ``jump_stages``):
    refused on the cooperative and wide schedules with a ValueError naming it; on pingpong the
    launcher and its kernel carry it."""
    import pytest
    from sm90_megamoe.grouped_gemm import GroupedGemmSm90
    from sm90_megamoe.launch import CompiledGroupedGemm

    for schedule in ("cooperative", "wide"):
        with pytest.raises(ValueError, match=f"{option} is for the pingpong schedule"):
            GroupedGemmSm90("swiglu", schedule=schedule, **{option: True})
    fn = CompiledGroupedGemm("identity", 2048, 768, 16, True, tile_n=192, schedule="pingpong",
                             compiled=object(), **{option: True})
    assert getattr(fn, option) and getattr(fn.kernel, option)


def record_pingpong_switch_builds(monkeypatch, env: str) -> tuple:
    """``(built, names)`` of :func:`record_gemm_builds` after the shim built Qwen3's FC2 (pingpong)
    under ``env`` = 1, then 0, and its FC1 (cooperative) under 1 -- the builds every pingpong-only
    switch's wiring test starts from (drop v79 ``jump_stages``)."""
    from moe_ep.shim.drops import sm90_megamoe as s

    built, names = record_gemm_builds(monkeypatch)
    monkeypatch.delenv("MOE_EP_PINGPONG_MAX_K", raising=False)
    for flag in ("1", "0"):
        monkeypatch.setenv(env, flag)
        s.compiled_grouped_gemm("identity", 2048, 768, 128, scale_rows=True)
    monkeypatch.setenv(env, "1")
    s.compiled_grouped_gemm("swiglu", 1536, 2048, 128)
    return built, names
