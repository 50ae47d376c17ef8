"""The SM100 (W4A16 NVFP4) and SM120 (MXFP8) drops as moe_ep sees them, on CPU: three drop trees in
one process, the collision guard between them, the shim's compile keys and mirrored constants,
the backends' refusals (never a crash) and the AOT prebuild for sm_100a / sm_120a (no GPU needed).
Kernel numerics of the drops themselves: tests/test_sm100_w4a16_drop.py, test_sm120_mxfp8_drop.py.
On an H200 the GPU test checks that both backends refuse with UnsupportedBackendError naming the
arch they need."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from moe_ep.api import EPGroup, MoEConfig, MoELayer  # noqa: E402
from moe_ep.backends import UnsupportedBackendError, explain  # noqa: E402

NEMOTRON = dict(num_experts=128, hidden=2688, intermediate=1856, top_k=6, max_tokens_per_rank=128)
QWEN = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8, max_tokens_per_rank=128)


def test_three_drops_import_in_one_process():
    """Each drop has its own top-level package; all three load side by side (a fresh interpreter,
    so nothing this test process imported earlier hides a clash)."""
    code = (
        "from moe_ep.shim import drop_contracts\n"
        "import importlib\n"
        "cs = drop_contracts()\n"
        "for c in cs:\n"
        "    c.activate(); c.constants.ensure_checked()\n"
        "    for p in c.packages: importlib.import_module(p)\n"
        "import sm90_megamoe, sm100_w4a16, sm120_mxfp8\n"
        "print(sorted(c.key for c in cs), sm90_megamoe.DROP_VERSION, sm100_w4a16.DROP_VERSION,"
        " sm120_mxfp8.DROP_VERSION)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    from moe_ep.shim.drops import sm90_megamoe, sm100_w4a16, sm120_mxfp8

    # the shim's mirrors of the drops' versions
    versions = [m.CONSTANTS.value(m.PKG, "DROP_VERSION") for m in (sm90_megamoe, sm100_w4a16, sm120_mxfp8)]
    assert "['sm100/w4a16', 'sm120/mxfp8', 'sm90/megamoe'] {} {} {}".format(*versions) in p.stdout


def test_a_fourth_drop_reusing_a_name_trips_the_guard(tmp_path):
    """A synthetic drop tree whose top-level package is named like a real drop's is refused,
    naming both trees."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from moe_ep.shim import DropCollisionError, drop_contracts, register_drop\n"
        "for c in drop_contracts(): c.activate()\n"
        f"fake = Path({str(tmp_path)!r}) / 'src'\n"
        "(fake / 'sm120_mxfp8').mkdir(parents=True)\n"
        "(fake / 'sm120_mxfp8' / '__init__.py').write_text('DROP_VERSION = 99')\n"
        "try:\n"
        "    register_drop(fake)\n"
        "except DropCollisionError as e:\n"
        "    print('REFUSED', e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "REFUSED" in p.stdout and "sm120_mxfp8" in p.stdout and "kernel_src/sm120/mxfp8/src" in p.stdout


def test_mirrored_constants_match_the_blackwell_drops():
    from moe_ep.shim.drops import sm100_w4a16, sm120_mxfp8

    for mod in (sm100_w4a16, sm120_mxfp8):
        mod.CONTRACT.activate()
        assert mod.CONSTANTS.drift() == []


def test_compile_keys_carry_every_static_value():
    from moe_ep.shim.drops import sm100_w4a16, sm120_mxfp8

    k = sm120_mxfp8._key("gemm", "swiglu", 1536, 2048, 128, 16)
    assert (k.arch, k.epilogue, k.n, k.k, k.num_experts, k.tile_tokens, k.drop_version) == \
        ("sm_120a", "swiglu", 1536, 2048, 128, 16, 2)
    assert k != sm120_mxfp8._key("gemm", "swiglu", 1536, 2048, 128, 32)
    fields = set(sm100_w4a16.W4A16Key.__dataclass_fields__)
    assert {"drop_version", "abi_version", "cutlass_version", "arch", "epilogue", "n", "k", "num_experts"} <= fields


def test_sm100_activation_constants_reach_the_kernel():
    """sm100/w4a16 v3: the config's clamped_swiglu / softcapped_swiglu constants go into FC1's spec, the
    shim's compile key and the PTX; bad or unknown ones are refused by name."""
    from moe_ep.backends.sm100.w4a16_cutedsl.backend import _gemm_specs
    from moe_ep.shim import sm100_check_w4a16_gemm, sm100_compile_w4a16_ptx
    from moe_ep.shim.drops import sm100_w4a16

    cfg = MoEConfig(activation="clamped_swiglu", quant="nvfp4_w4a16", swiglu_beta=0.0, swiglu_limit=10.0,
                    **NEMOTRON)
    (args, consts, _), (_, fc2_consts, _) = _gemm_specs(cfg, 8)["fc1"], _gemm_specs(cfg, 8)["fc2"]
    assert args[0] == "clamped_swiglu" and fc2_consts == {}
    assert consts["swiglu_beta"] == 0.0 and consts["swiglu_limit"] == 10.0
    full = sm100_w4a16.activation_constants("clamped_swiglu", **consts)
    assert full == dict(swiglu_alpha=1.702, swiglu_limit=10.0, swiglu_beta=0.0, swiglu_limit_after_act=False)
    assert sm100_w4a16.activation_constants("softcapped_swiglu", up_softcap=30) == dict(gate_softcap=4.0,
                                                                                        up_softcap=30.0)
    assert sm100_w4a16.activation_constants("swiglu", swiglu_limit=3.0) == {}
    soft = MoEConfig(activation="softcapped_swiglu", quant="nvfp4_w4a16", gate_softcap=3.0, **NEMOTRON)
    assert _gemm_specs(soft, 8)["fc1"][1] == dict(gate_softcap=3.0, up_softcap=25.0)
    with pytest.raises(ValueError, match="swiglu_limit > 0"):
        sm100_check_w4a16_gemm("clamped_swiglu", 2 * 256, 512, 4, swiglu_limit=-1.0)
    with pytest.raises(TypeError, match="swiglu_gamma"):
        sm100_check_w4a16_gemm("clamped_swiglu", 2 * 256, 512, 4, swiglu_gamma=1.0)
    assert (sm100_compile_w4a16_ptx("clamped_swiglu", 2 * 256, 512, 4, swiglu_beta=0.0)
            != sm100_compile_w4a16_ptx("clamped_swiglu", 2 * 256, 512, 4))
    # drop v4: the bias dtype is part of FC1's and FC2's spec and of the compile key
    biased = MoEConfig(activation="clamped_swiglu", quant="nvfp4_w4a16", bias_dtype=torch.bfloat16, **NEMOTRON)
    assert [spec[2] for spec in _gemm_specs(biased, 8).values()] == [torch.bfloat16] * 2
    assert [spec[2] for spec in _gemm_specs(cfg, 8).values()] == [None, None]
    ptx = sm100_compile_w4a16_ptx("row_scale", 256, 512, 4, bias_dtype=torch.float32)
    assert ptx != sm100_compile_w4a16_ptx("row_scale", 256, 512, 4)
    with pytest.raises(ValueError, match="bias_dtype"):
        sm100_compile_w4a16_ptx("row_scale", 256, 512, 4, bias_dtype=torch.float16)


@pytest.mark.parametrize("quant,backend", [("nvfp4_w4a16", "sm100_w4a16_cutedsl"), ("mxfp8", "sm120_mxfp8_cutedsl")])
def test_backends_refuse_without_their_gpu(quant, backend):
    cfg = MoEConfig(activation="squared_relu" if quant == "nvfp4_w4a16" else "swiglu", quant=quant,
                    **(NEMOTRON if quant == "nvfp4_w4a16" else QWEN))
    with pytest.raises(UnsupportedBackendError, match="needs a CUDA device"):
        MoELayer(cfg, EPGroup.single(), backend=backend, device="cpu")
    verdicts = {v.name: v for v in explain(cfg, EPGroup.single(), torch.device("cpu"))}
    assert not verdicts[backend].ok and verdicts["reference"].ok


def test_backends_refuse_configs_by_name():
    from moe_ep.backends.sm100.w4a16_cutedsl import check_config as check100
    from moe_ep.backends.sm120.mxfp8_cutedsl import check_config as check120

    single = EPGroup.single()
    with pytest.raises(UnsupportedBackendError, match="quant='nvfp4_w4a16'"):
        check100(MoEConfig(**NEMOTRON), single)
    # drop v2 takes both GELU gates (Gemma 4's tanh form), drop v3 the clamped and softcapped ones
    for act in ("gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu"):
        check100(MoEConfig(activation=act, quant="nvfp4_w4a16", **NEMOTRON), single)
    # drop v4: gpt-oss's per-expert biases (float32 or bf16); the SM120 drop has none
    for dt in (torch.float32, torch.bfloat16):
        check100(MoEConfig(activation="clamped_swiglu", quant="nvfp4_w4a16", bias_dtype=dt, **NEMOTRON), single)
    with pytest.raises(UnsupportedBackendError, match="biases"):
        check120(MoEConfig(quant="mxfp8", bias_dtype=torch.float32, **QWEN), single)
    with pytest.raises(UnsupportedBackendError, match="multiple of 64"):
        check100(MoEConfig(activation="squared_relu", quant="nvfp4_w4a16",
                           **dict(NEMOTRON, hidden=2688 + 16)), single)
    check100(MoEConfig(activation="squared_relu", quant="nvfp4_w4a16", **NEMOTRON), single)
    with pytest.raises(UnsupportedBackendError, match="quant='mxfp8'"):
        check120(MoEConfig(quant="nvfp4_w4a16", **QWEN), single)
    with pytest.raises(UnsupportedBackendError, match="squared_relu"):
        check120(MoEConfig(activation="squared_relu", quant="mxfp8", **QWEN), single)
    with pytest.raises(UnsupportedBackendError, match="multiple of 128"):  # gpt-oss K = 2880
        check120(MoEConfig(num_experts=128, hidden=2880, intermediate=2880, top_k=4, max_tokens_per_rank=64,
                           quant="mxfp8"), single)
    check120(MoEConfig(quant="mxfp8", **QWEN), single)
    # drop sm120/mxfp8 v2: the GELU gates and the clamped / softcapped SwiGLU, with the config's constants
    from moe_ep.backends.sm120.mxfp8_cutedsl.backend import _gemm_specs as specs120

    for act in ("gelu_glu", "gelu_tanh_glu", "clamped_swiglu", "softcapped_swiglu"):
        check120(MoEConfig(activation=act, quant="mxfp8", **QWEN), single)
    dsv4 = MoEConfig(activation="clamped_swiglu", quant="mxfp8", swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0,
                     **QWEN)
    (args, consts), (_, fc2_consts) = specs120(dsv4, 128, 1)["fc1"], specs120(dsv4, 128, 1)["fc2"]
    assert args[0] == "clamped_swiglu" and fc2_consts == {}
    assert consts == dict(swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0, swiglu_limit_after_act=False)
    from moe_ep.shim.drops import sm120_mxfp8

    k1 = sm120_mxfp8._key("gemm", "clamped_swiglu", 1536, 2048, 128, 16, sm120_mxfp8.activation_constants(
        "clamped_swiglu", **consts))
    k2 = sm120_mxfp8._key("gemm", "clamped_swiglu", 1536, 2048, 128, 16, sm120_mxfp8.activation_constants(
        "clamped_swiglu"))
    assert k1 != k2 and dict(k1.activation)["swiglu_beta"] == 0.0
    from moe_ep.shim import sm120_check_mxfp8_gemm

    with pytest.raises(ValueError, match="up_softcap > 0"):  # MoEConfig refuses it first; the shim too
        sm120_check_mxfp8_gemm("softcapped_swiglu", 1536, 2048, 128, 16, up_softcap=-1.0)
    with pytest.raises(TypeError, match="softcap_gate"):
        sm120_check_mxfp8_gemm("softcapped_swiglu", 1536, 2048, 128, 16, softcap_gate=1.0)


def test_ep_and_layout_kernels_build_for_blackwell():
    """The arch-neutral EP/layout kernels of sm90/megamoe compile for sm_100a and sm_120a (no copy
    in the Blackwell drops), keyed by arch."""
    from moe_ep.shim import sm90_compile_ep_ptx

    for arch in ("sm_100a", "sm_120a"):
        ptx = sm90_compile_ep_ptx("combine_reduce", 2688, 6, 2, 128, 128, arch=arch)
        assert f".target {arch}" in ptx
        ptx = sm90_compile_ep_ptx("layout_place", 2048, 8, 2, 128, 128, arch=arch)
        assert f".target {arch}" in ptx


# a one-rank layer: its GEMMs and quantisers, 8 EP kernels, 5 layout kernels (LocalRoute's 2 included)
@pytest.mark.parametrize("arch,model,kernels", [("sm_100a", "nemotron", 15), ("sm_120a", "qwen3", 17),
                                                ("sm_100a", "dsv4_shard", 15),  # sm100/w4a16 v3: clamped gate
                                                ("sm_120a", "inkling2_shard", 17)])  # sm120/mxfp8 v2: softcaps
def test_aot_prebuild_for_blackwell(tmp_path, arch, model, kernels):
    """``python -m moe_ep.aot build --arch sm_100a|sm_120a`` compiles a whole layer's kernels on
    this CPU machine, and a second build loads them all."""
    env = dict(os.environ, MOE_EP_CACHE_DIR=str(tmp_path))
    args = [sys.executable, "-m", "moe_ep.aot", "build", "--arch", arch, "--model", model, "--max-tokens", "64"]
    for want in (f"({kernels} compiled, 0 loaded", f"(0 compiled, {kernels} loaded"):
        p = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert f"{kernels} kernels {want}" in p.stdout, p.stdout
    p = subprocess.run([sys.executable, "-m", "moe_ep.aot", "build", "--arch", "sm_120a", "--model", "gpt_oss",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 2 and "K=2880" in p.stderr  # sm120/mxfp8 v2 has its gate; K % 128 != 0


def test_gemm_ptx_through_the_shim():
    from moe_ep.shim import sm100_compile_w4a16_ptx, sm120_compile_mxfp8_ptx

    assert "tcgen05.mma" in sm100_compile_w4a16_ptx("squared_relu", 1856, 2688, 128)
    assert "kind::mxf8f6f4.block_scale" in sm120_compile_mxfp8_ptx("swiglu", 1536, 2048, 128, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("quant,backend,need", [("nvfp4_w4a16", "sm100_w4a16_cutedsl", "SM100"),
                                                ("mxfp8", "sm120_mxfp8_cutedsl", "SM120")])
def test_blackwell_backends_refuse_on_the_h200(quant, backend, need):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] in (10, 12):
        pytest.skip("needs a non-Blackwell CUDA GPU")
    cfg = MoEConfig(activation="squared_relu" if quant == "nvfp4_w4a16" else "swiglu", quant=quant,
                    **(NEMOTRON if quant == "nvfp4_w4a16" else QWEN))
    with pytest.raises(UnsupportedBackendError, match=need):
        MoELayer(cfg, EPGroup.single(), backend=backend)
    with pytest.warns(Warning):  # auto passes over the refused fast backends, to the reference backend
        layer = MoELayer(cfg, EPGroup.single(), backend="auto")
    assert layer.backend_name == "reference"
    layer.destroy()


@pytest.mark.parametrize("module,cls", [("moe_ep.backends.sm100.w4a16_cutedsl.backend", "Sm100W4A16Backend"),
                                        ("moe_ep.backends.sm120.mxfp8_cutedsl.backend", "Sm120Mxfp8Backend")])
def test_blackwell_backends_bind_without_prepared_gemms(module, cls):
    """The Blackwell backends reuse the SM90 backend's bind, which prepares its own GEMM launches
    (drop v61): theirs have no prepared form, so they prepare none and step 3-4 call them plainly."""
    import importlib
    from types import SimpleNamespace

    b = object.__new__(getattr(importlib.import_module(module), cls))
    b.local_route = b.local_combine = False
    b.fc1 = b.fc2 = SimpleNamespace()  # no prepare(): binding must not ask for one
    b.fc1_decode = b.fc2_decode = None
    b._prepare_launches()
    assert b._expert_runs == {} and b._route_run == {} and b._combine_run is None


# ---- the Blackwell drops' gate math on silicon we have ---------------------------------------------
# The epilogue functions of sm100/w4a16 v3 (clamped, softcapped) and sm120/mxfp8 v2 (every gated one)
# are arch-neutral fp32 code: a probe kernel evaluates them element by element on an SM90 GPU, against
# float64 from the definitions. (The Blackwell GEMMs around them are not run: no such GPU here.)
_PROBE_N = 128 * 160
_PROBE_CONSTS = [
    ("swiglu", {}), ("gelu_glu", {}), ("gelu_tanh_glu", {}),
    ("clamped_swiglu", {}),  # gpt-oss's: alpha 1.702, limit 7, beta 1
    ("clamped_swiglu", dict(swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0)),  # DeepSeek-V4's
    ("clamped_swiglu", dict(swiglu_limit_after_act=True)),  # Step-3.7's order
    ("softcapped_swiglu", {}), ("softcapped_swiglu", dict(gate_softcap=2.0, up_softcap=5.0)),
]


def _gate_fn(drop: str, activation: str, consts: dict):
    """The drop's device function for ``activation`` as ``f(gate, up)`` (sm100: only its v3 helpers)."""
    import importlib

    from moe_ep.shim import drop_src, register_drop

    if drop == "sm120":
        register_drop(drop_src("sm120", "mxfp8"))
        gg = importlib.import_module("sm120_mxfp8.grouped_gemm")
        full = dict(importlib.import_module("sm120_mxfp8.constants").ACTIVATION_CONSTANT_DEFAULTS, **consts)
        return lambda g, u: gg.gated_activation(activation, g, u, full)
    register_drop(drop_src("sm100", "w4a16"))
    gg = importlib.import_module("sm100_w4a16.grouped_gemm")
    c = dict(importlib.import_module("sm100_w4a16.constants").ACTIVATION_CONSTANT_DEFAULTS, **consts)
    if activation == "clamped_swiglu":
        return lambda g, u: gg._clamped_swiglu(g, u, c["swiglu_alpha"], c["swiglu_limit"], c["swiglu_beta"],
                                               c["swiglu_limit_after_act"])
    return lambda g, u: gg._softcapped_swiglu(g, u, c["gate_softcap"], c["up_softcap"])


class _GateProbe:
    """``mO[i] = fn(mG[i], mU[i])`` in fp32, one thread per element (``_PROBE_N`` elements)."""

    def __init__(self, fn):
        self.fn = fn

    @cute.jit
    def __call__(self, mG: cute.Tensor, mU: cute.Tensor, mO: cute.Tensor, stream):
        self.kernel(mG, mU, mO).launch(grid=[_PROBE_N // 128, 1, 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mG: cute.Tensor, mU: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        mO[i] = self.fn(mG[i], mU[i])


def _probe_cases():
    return [("sm120", a, c) for a, c in _PROBE_CONSTS] + [("sm100", a, c) for a, c in _PROBE_CONSTS
                                                          if a in ("clamped_swiglu", "softcapped_swiglu")]


def _compile_probe(drop, activation, consts, arch):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    fake = [make_fake_compact_tensor(cutlass.Float32, (_PROBE_N,), assumed_align=16) for _ in range(3)]
    return cute.compile(_GateProbe(_gate_fn(drop, activation, consts)), *fake, make_fake_stream(),
                        options=f"--gpu-arch {arch} --keep-ptx")


def test_gate_probe_compiles_the_drops_gate_code(tmp_path, monkeypatch):
    """CPU: the probe traces each drop's gate function for sm_90a; the tanh-based gates use tanh.approx,
    the others ex2 (so the GPU test below exercises the instructions the Blackwell epilogues use)."""
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes beside the working directory
    for drop, act, consts in (("sm120", "gelu_tanh_glu", {}), ("sm100", "softcapped_swiglu", {}),
                              ("sm100", "clamped_swiglu", {})):
        ptx = _compile_probe(drop, act, consts, "sm_90a").__ptx__
        assert ("tanh.approx.f32" in ptx) == (act == "softcapped_swiglu"), (drop, act)
        assert ("ex2.approx" in ptx) == (act != "softcapped_swiglu"), (drop, act)


@pytest.mark.gpu
@pytest.mark.parametrize("drop,activation,consts", _probe_cases())
def test_blackwell_gate_math_on_an_sm90_gpu(drop, activation, consts, tmp_path, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU (the probe is compiled for sm_90a)")
    from cutlass.cute.runtime import from_dlpack
    import cuda.bindings.driver as cuda
    from moe_oracle import gated_f64

    monkeypatch.chdir(tmp_path)
    compiled = _compile_probe(drop, activation, consts, "sm_90a")
    gen = torch.Generator().manual_seed(11)
    # gates over [-16, 16] (past every limit, deep in each sigmoid's tails), ups over [-40, 40]
    g = torch.linspace(-16.0, 16.0, _PROBE_N, dtype=torch.float32)
    u = (torch.rand(_PROBE_N, generator=gen) * 80.0 - 40.0).float()
    dg, du = g.cuda(), u.cuda()
    out = torch.full_like(dg, float("nan"))
    compiled(*(from_dlpack(t, assumed_align=16) for t in (dg, du, out)),
             cuda.CUstream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    defaults = dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_beta=1.0, swiglu_limit_after_act=False,
                    gate_softcap=4.0, up_softcap=25.0)
    want = gated_f64(activation, g, u, dict(defaults, **consts))
    got = out.cpu().double()
    assert torch.isfinite(got).all()
    # Floor: 1e-4 of the output's range. ex2 / rcp are good to ~1e-6 relative. Two gates cancel in fp32
    # where the output is tiny: the erf GELU's 1 + erf(g / sqrt 2) (as torch's fp32 GELU does) and the
    # softcapped gate's sigmoid (1 + tanh(g / 2)) / 2, whose tanh.approx near -1 carries its ~2^-11
    # error as an absolute one (measured on an H100: 5.3e-5 and 4.7e-3 of this measure at most)
    rtol = {"softcapped_swiglu": 1e-2, "gelu_glu": 2e-4}.get(activation, 2e-5)
    err = (got - want).abs() / (want.abs() + 1e-4 * want.abs().max())
    assert float(err.max()) < rtol, (float(err.max()), int(err.argmax()))
    if activation == "clamped_swiglu":  # the limit binds on these inputs: the unclamped SwiGLU differs
        assert float((got - gated_f64("swiglu", g, u, {})).abs().max()) > 1.0


def test_reference_backend_runs_nvfp4_with_biases():
    """What sm100_w4a16_cutedsl's biases (drop v4) must compute, on the reference backend (CPU): a gpt-oss
    style layer (clamped SwiGLU, b13 before the activation, b2 before the router weight) on NVFP4 weights
    equals the float64 oracle on the dequantised weights."""
    from moe_ep.api.quant import dequantize_nvfp4, quantize_nvfp4
    from moe_oracle import oracle_f64, rel_err

    E, H, I, K, T = 4, 128, 64, 2, 24
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=I, top_k=K, max_tokens_per_rank=T, quant="nvfp4_w4a16",
                    activation="clamped_swiglu", bias_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    w13 = quantize_nvfp4(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5 * 4)
    w2 = quantize_nvfp4(torch.randn(E, H, I, generator=g) * I ** -0.5)
    b13, b2 = torch.randn(E, 2 * I, generator=g) * 3, torch.randn(E, H, generator=g)
    with MoELayer(cfg, EPGroup.single(), backend="reference", device="cpu") as layer:
        got = layer.forward(x, ids, w, w13, w2, b13=b13, b2=b2)
    want = oracle_f64(x, ids, w, dequantize_nvfp4(w13), dequantize_nvfp4(w2), "clamped_swiglu", I, b13=b13, b2=b2)
    assert rel_err(got, want) < 1e-2
    plain = oracle_f64(x, ids, w, dequantize_nvfp4(w13), dequantize_nvfp4(w2), "clamped_swiglu", I)
    assert rel_err(plain, want) > 0.1  # the biases matter on these inputs
