"""Compile the W4A16 grouped GEMM for sm_100a WITHOUT a GPU (fake tensors) and inspect the PTX.

    python -m sm100_w4a16.compile_check            # every epilogue, Nemotron shapes, tile variants
    python -m sm100_w4a16.compile_check --quick    # one variant per epilogue

Per variant: the PTX holds the instructions the design relies on (tcgen05.mma / commit / ld,
TMA, the e2m1 -> f16x2 and e4m3 -> f16x2 conversions, the async-proxy fence), no local memory;
if a ptxas is installed it assembles the PTX for sm_100a and reports registers, spill bytes and
the shared memory the launch asks for (<= 227 KB, checked). The fake-tensor signature is also
compared with the one built from real (CPU) torch tensors by ``launch.to_cute_args``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Tuple

from .constants import SMEM_CAPACITY_BYTES
from .launch import compile_options, compile_w4a16_gemm

EXPECT = [
    "tcgen05.mma.cta_group::1.kind::f16",      # UMMA bf16 x bf16 -> f32
    "tcgen05.commit",                         # stage release / accumulator ready
    "tcgen05.ld.sync.aligned.32x32b",         # TMEM -> registers
    "tcgen05.alloc", "tcgen05.dealloc",
    "tcgen05.wait::ld", "tcgen05.fence::after_thread_sync",
    "cp.async.bulk.tensor",                   # TMA: A and packed W (see check_ptx)
    "cvt.rn.f16x2.e2m1x2",                    # dequant: two e2m1 codes -> f16x2
    "cvt.rn.f16x2.e4m3x2",                    # block scales
    "mul.rn.f16x2",                           # value * block scale
    "cvt.rn.bf16x2.f32",
    "fence.proxy.async.shared::cta",          # dequant writes -> UMMA reads
    "st.shared.v4.b32", "st.global.v4.b32",
]
FORBID = ["ld.local", "st.local"]

# (epilogue, N, K, E, tile_n[, bias dtype]): Nemotron FC1 (squared_relu, N=1856, K=2688) and FC2 (row_scale,
# N=2688, K=1856), a gated FC1, and the other tile widths
CASES = [
    ("squared_relu", 1856, 2688, 128, None),
    ("row_scale", 2688, 1856, 128, None),
    ("swiglu", 2 * 1856, 2688, 128, None),
    ("identity", 1856, 2688, 128, None),
    ("squared_relu", 1856, 2688, 128, 64),
    ("row_scale", 2688, 1856, 128, 256),
    ("swiglu", 2 * 1856, 2688, 128, 64),
    ("gelu_glu", 2 * 704, 2816, 128, None),  # drop v2: Gemma 4's FC1 shape (I 704: 5.5 tiles)
    ("gelu_tanh_glu", 2 * 704, 2816, 128, None),
    ("clamped_swiglu", 2 * 2880, 2880, 128, None),  # drop v3: gpt-oss's FC1 shape (K 2880: 45 k-tiles)
    ("softcapped_swiglu", 2 * 1536, 4608, 64, None),  # drop v3: an Inkling2-size FC1 (I 1536, K 4608)
    ("clamped_swiglu", 2 * 2880, 2880, 128, None, "float32"),  # drop v4: gpt-oss's FC1 and FC2 with biases
    ("row_scale", 2880, 2880, 128, None, "bfloat16"),
]


def find_ptxas() -> Optional[str]:
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.exists(cand):
            return cand
    return None


def ptxas_info(ptx: str, arch: str = "sm_100a") -> Optional[Tuple[int, int, int]]:
    """(registers, spill + stack bytes, static smem bytes) from ``ptxas -v``, or None without a
    ptxas. The PTX ISA version is lowered until this ptxas accepts it (CuTeDSL may emit a newer
    .version than the installed ptxas knows; the kernel uses no instruction newer than 8.6).
    Raises RuntimeError if ptxas rejects the PTX for another reason."""
    exe = find_ptxas()
    if exe is None:
        return None
    last = ""
    with tempfile.TemporaryDirectory() as d:
        src, obj = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        for ver in (None, "9.0", "8.8", "8.7", "8.6"):
            txt = ptx if ver is None else re.sub(r"^\.version \d+\.\d+", f".version {ver}", ptx, flags=re.M)
            with open(src, "w") as f:
                f.write(txt)
            r = subprocess.run([exe, f"-arch={arch}", "-v", src, "-o", obj],
                               capture_output=True, text=True)
            if r.returncode == 0:
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill", r.stderr))
                stack = sum(int(x) for x in re.findall(r"(\d+) bytes stack frame", r.stderr))
                smem = re.search(r"(\d+) bytes smem", r.stderr)
                return (int(regs.group(1)) if regs else -1, spills + stack,
                        int(smem.group(1)) if smem else 0)
            last = r.stderr
            if "Unsupported .version" not in r.stderr:
                break
    raise RuntimeError(f"ptxas rejected the PTX:\n{last[-2000:]}")


def check_ptx(ptx: str) -> list:
    """Problems found in the PTX (missing expected / present forbidden instructions)."""
    bad = [f"missing {s}" for s in EXPECT if s not in ptx]
    if ptx.count("cp.async.bulk.tensor") < 2:  # one TMA for A, one for the packed weights
        bad.append("fewer than 2 TMA loads")
    bad += [f"forbidden {s}" for s in FORBID if s in ptx]
    return bad


def _host_signature(compiled) -> str:
    """Argument types of the generated host entry (the dynamic shape / stride words per tensor)."""
    m = re.search(r"llvm\.func @cutlass___call___\S*?\((.*?)\) -> i32", str(compiled.ir_module))
    return re.sub(r"%arg\d+: ", "", m.group(1)).replace("ptr<1>", "ptr") if m else "?"


def _arg_signature(t) -> tuple:
    """(dtype, assumed alignment, shape, stride) of a CuTe runtime / fake tensor, '?' marking
    the dynamic modes: what a compiled kernel specialises on."""
    dyn_shape = tuple(getattr(t, "dynamic_shapes_mask", ()) or ())
    dyn_stride = tuple(getattr(t, "dynamic_strides_mask", ()) or ())
    shape = tuple("?" if (i < len(dyn_shape) and dyn_shape[i]) else int(x) for i, x in enumerate(t.shape))
    stride = tuple("?" if (i < len(dyn_stride) and dyn_stride[i]) else int(x) for i, x in enumerate(t.stride))
    return (str(t.element_type), int(t._assumed_align), shape, stride)


def same_signature_as_torch(epilogue: str, n: int, k: int, num_experts: int, tile_n=None) -> bool:
    """The tensors ``launch.to_cute_args`` builds from contiguous (CPU) torch tensors have the
    structure of ``launch.fake_args`` (dtype, alignment, static shapes / strides, dynamic modes),
    and compiling from them gives the same host argument list: the fake compile is what a real
    launch runs."""
    import torch
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream
    from .launch import fake_args, to_cute_args
    from .grouped_gemm import W4A16GroupedGemmSm100

    kernel = W4A16GroupedGemmSm100(epilogue, tile_n=tile_n)
    n_out, _ = kernel.static_shapes(n, k, num_experts)
    fake = fake_args(kernel, num_experts, n, k)[:7]
    m = 37
    real = to_cute_args(
        torch.zeros(m, k, dtype=torch.bfloat16),
        torch.zeros(num_experts, n, k // 2, dtype=torch.uint8),
        torch.zeros(num_experts, n, k // 16, dtype=torch.float8_e4m3fn),
        torch.ones(num_experts, dtype=torch.float32),
        torch.zeros(num_experts + 1, dtype=torch.int32),
        torch.zeros(m, dtype=torch.float32),
        torch.zeros(m, n_out, dtype=torch.bfloat16),
    )
    for f, r in zip(fake, real):
        if _arg_signature(f) != _arg_signature(r):
            print(f"signature mismatch: fake {_arg_signature(f)} vs torch {_arg_signature(r)}")
            return False
    c_fake = compile_w4a16_gemm(epilogue, n, k, num_experts, tile_n=tile_n)
    c_real = cute.compile(W4A16GroupedGemmSm100(epilogue, tile_n=tile_n), *real, cutlass.Int32(148),
                          make_fake_stream(), options=compile_options("sm_100a"))
    return _host_signature(c_fake) == _host_signature(c_real) != "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one variant per epilogue")
    ap.add_argument("--arch", default="sm_100a")
    args = ap.parse_args(argv)
    firsts = {}  # --quick: the first case of each epilogue
    for case in CASES:
        firsts.setdefault(case[0], case)
    cases = list(firsts.values()) if args.quick else CASES
    if find_ptxas() is None:
        print("ptxas not found (set PTXAS=...): PTX checks only")
    failed = 0
    for epi, n, k, e, tn, *bias in cases:
        import torch

        t0 = time.time()
        compiled, kernel = compile_w4a16_gemm(epi, n, k, e, tile_n=tn, arch=args.arch, return_kernel=True,
                                              bias_dtype=getattr(torch, bias[0]) if bias else None)
        dt = time.time() - t0
        ptx = compiled.__ptx__
        bad = check_ptx(ptx)
        info = ptxas_info(ptx, args.arch)
        smem = kernel.smem_size
        if smem > SMEM_CAPACITY_BYTES:
            bad.append(f"shared memory {smem} B > {SMEM_CAPACITY_BYTES} B")
        sass = "ptxas n/a"
        if info is not None:
            regs, spill, static_smem = info
            sass = f"ptxas: {regs} regs, {spill} B spill/stack"
            if spill:
                bad.append(f"{spill} bytes of spills/stack")
            smem += static_smem
        print(f"{epi + (' +bias ' + bias[0] if bias else ''):12s} N={n:5d} K={k:5d} E={e} tile_n={kernel.tile_n:3d} "
              f"stages A/B={kernel.num_stages} W={kernel.num_w_stages} | compile {dt:4.1f}s | {sass} | "
              f"smem {smem} B ({smem / 1024:.1f} KB) | tcgen05.mma x{ptx.count('tcgen05.mma')} "
              f"cvt.e2m1x2 x{ptx.count('cvt.rn.f16x2.e2m1x2')} | {'OK' if not bad else 'FAIL: ' + '; '.join(bad)}",
              flush=True)
        failed += bool(bad)
    sig = same_signature_as_torch("squared_relu", 1856, 2688, 128)
    print(f"fake-tensor signature == torch-tensor signature: {sig}")
    failed += not sig
    if failed:
        print(f"compile_check: {failed} FAILED")
        return 1
    print("compile_check: all OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
