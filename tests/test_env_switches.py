"""Every environment switch the shim and the SM90 backends read follows one rule (``moe_ep.shim.env``):
unset or empty is the default, a value the switch knows does what it says, anything else raises a
ValueError naming the variable -- a typo (``MOE_EP_FP8_OVERLAP=off``) must not silently keep the
default in an A/B run. CPU only: the switches are read when a kernel is built or a layer bound."""

import pytest

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from moe_ep.backends.sm90.bf16_cutedsl import backend as bb  # noqa: E402
from moe_ep.backends.sm90.fp8_cutedsl import backend as fb  # noqa: E402
from moe_ep.shim import env  # noqa: E402
from moe_ep.shim.drops import sm90_megamoe as s  # noqa: E402
from moe_ep.shim.drops import sm90_megamoe_fp8 as f  # noqa: E402


def test_env_helpers(monkeypatch):
    monkeypatch.delenv("MOE_EP_TEST_SWITCH", raising=False)
    assert env.env_choice("MOE_EP_TEST_SWITCH", ("a", "b"), "a") == "a"
    assert env.env_flag("MOE_EP_TEST_SWITCH", True) and not env.env_flag("MOE_EP_TEST_SWITCH", False)
    assert env.env_forced("MOE_EP_TEST_SWITCH") is None
    monkeypatch.setenv("MOE_EP_TEST_SWITCH", "")  # empty = unset
    assert env.env_flag("MOE_EP_TEST_SWITCH", True) and env.env_forced("MOE_EP_TEST_SWITCH") is None
    for raw, on in (("1", True), ("0", False)):
        monkeypatch.setenv("MOE_EP_TEST_SWITCH", raw)
        assert env.env_flag("MOE_EP_TEST_SWITCH", not on) is on
        assert env.env_forced("MOE_EP_TEST_SWITCH") is on
    monkeypatch.setenv("MOE_EP_TEST_SWITCH", "b")
    assert env.env_choice("MOE_EP_TEST_SWITCH", ("a", "b"), "a") == "b"
    for bad in ("off", "true", "yes", " 1", "2"):
        monkeypatch.setenv("MOE_EP_TEST_SWITCH", bad)
        for read in (lambda: env.env_flag("MOE_EP_TEST_SWITCH", False),
                     lambda: env.env_forced("MOE_EP_TEST_SWITCH")):
            with pytest.raises(ValueError, match=f"MOE_EP_TEST_SWITCH must be one of 0, 1 \\(or unset\\), got {bad!r}"):
                read()


#: (variable, a call that reads it, its value unset) for every on/off or forcing switch
SWITCHES = [
    # the BF16 grouped GEMM (shim, read when a GEMM is built)
    ("MOE_EP_WIDE_GATED", lambda: s.use_wide_gated(), False),
    ("MOE_EP_GATED_PINGPONG", lambda: s.use_gated_pingpong(), False),
    ("MOE_EP_BF16_CLUSTER", lambda: s.use_bf16_cluster("cooperative"), 1),
    ("MOE_EP_BF16_CLUSTER_N", lambda: s.use_bf16_cluster_n("pingpong", gated=False), 1),
    ("MOE_EP_BF16_TANH_SIGMOID", lambda: s.use_bf16_tanh_sigmoid("swiglu"), True),
    ("MOE_EP_JUMP_STAGES", lambda: s.use_jump_stages("pingpong"), False),
    # the FP8 grouped GEMM (shim)
    ("MOE_EP_FP8_OVERLAP", lambda: f.use_fp8_overlap(2048), True),
    ("MOE_EP_FP8_CHUNKED_OVERLAP", lambda: f.use_fp8_overlap(14336), True),
    ("MOE_EP_FP8_WIDE_OVERLAP", lambda: f.use_fp8_overlap(2048, True), True),
    ("MOE_EP_FP8_SMEM_SCALES", lambda: f.use_fp8_smem_scales(True, 2048), True),
    ("MOE_EP_FP8_SCALE_WARP", lambda: f.use_fp8_scale_warp("identity", 14336), True),
    ("MOE_EP_FP8_DEFERRED_EPILOGUE", lambda: f.use_fp8_deferred_epilogue(True, 768), True),
    ("MOE_EP_FP8_WIDE_GATED", lambda: f.use_fp8_wide_gated("swiglu"), True),
    ("MOE_EP_FP8_TANH_SIGMOID", lambda: f.use_fp8_tanh_sigmoid("swiglu"), True),
    # the backends (read when a layer is bound)
    ("MOE_EP_LOCAL_COMBINE", bb.local_combine, True),
    ("MOE_EP_LOCAL_ROUTE", bb.local_route, True),
    ("MOE_EP_GATHER_FC1", bb.gather_fc1, False),
    ("MOE_EP_TOKEN_GRID", bb.token_grid, False),
    ("MOE_EP_FP8_WIRE", fb.fp8_wire, False),
    ("MOE_EP_FP8_FUSED_GATHER", fb.fused_gather_quant, True),
    ("MOE_EP_FP8_SCATTER_QUANT", fb.scatter_quant, True),
]


@pytest.mark.parametrize("var,read,default", SWITCHES, ids=[v for v, _, _ in SWITCHES])
def test_every_switch_refuses_an_unknown_value(monkeypatch, var, read, default):
    monkeypatch.delenv(var, raising=False)
    assert read() == default
    monkeypatch.setenv(var, "")
    assert read() == default
    for bad in ("off", "true", "2"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            read()


def test_switches_with_more_values(monkeypatch):
    """The switches that take more than on/off keep their own choices, by the same rule."""
    for var, read, good, bad in (
        ("MOE_EP_FP8_CLUSTER", lambda: f.use_fp8_cluster("identity", 4096, 14336), ("0", "1"), ("2", "on", "4")),
        ("MOE_EP_FP8_UNIT_SCALES", lambda: f.use_fp8_unit_scales(4096), ("auto", "0", "1"), ("on", "AUTO")),
        ("MOE_EP_FP8_PLACE_FC1", lambda: fb.place_fc1(1), ("0", "copy"), ("1", "on", "Copy", "quant")),
    ):
        for raw in good:
            monkeypatch.setenv(var, raw)
            read()
        for raw in bad:
            monkeypatch.setenv(var, raw)
            with pytest.raises(ValueError, match=var):
                read()
        monkeypatch.delenv(var)
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "0")
    assert f.use_fp8_cluster("identity", 4096, 14336) == 1
    monkeypatch.setenv("MOE_EP_FP8_CLUSTER", "")
    assert f.use_fp8_cluster("identity", 4096, 14336) == 2  # unset: K >= 4096 pairs up
    for raw, want in (("", 1), ("3", 3)):  # the integer switch: empty is its default too
        monkeypatch.setenv("MOE_EP_FP8_QUANT_ITEMS", raw)
        assert f.use_fp8_quant_items() == want
    for raw in ("0", "5", " 2"):
        monkeypatch.setenv("MOE_EP_FP8_QUANT_ITEMS", raw)
        with pytest.raises(ValueError, match=r"MOE_EP_FP8_QUANT_ITEMS must be an integer in 1 \.\.\. 4"):
            f.use_fp8_quant_items()


@pytest.mark.parametrize("var", sorted(env.REMOVED))
def test_removed_switches_raise_where_kernels_are_built(monkeypatch, var):
    """Drops v84-v94 removed the variants behind these switches (measured slower or no faster on the
    H200): set to anything but their old default, both SM90 GEMM builders (BF16 and FP8) refuse with a
    ValueError naming the variable and the drop version -- before any compile -- instead of quietly
    building the default; their old default and unset build as before."""
    default, _ = env.REMOVED[var]
    for var_ in env.REMOVED:
        monkeypatch.delenv(var_, raising=False)
    monkeypatch.setenv(var, "4" if default == "1" else "1")
    with pytest.raises(ValueError, match=rf"{var}='.': drop v(8[4-9]|9[0-4]) removed"):
        s.compiled_grouped_gemm("swiglu", 1536, 2048, 128, gather_a=True)
    with pytest.raises(ValueError, match=rf"{var}='.': drop v(8[4-9]|9[0-4]) removed"):
        f._gemm_key("swiglu", 1536, 2048, 128, False)
    monkeypatch.setenv(var, default)
    env.check_removed()
    monkeypatch.delenv(var)
    env.check_removed()
    assert f._gemm_key("swiglu", 1536, 2048, 128, False).cluster_n == 2
