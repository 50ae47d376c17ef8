"""Prebuilt kernels: ``python -m moe_ep.aot build|list|verify``.

    python -m moe_ep.aot build --arch sm_90a --model qwen3 [--max-tokens 8192] [--ep 1] --out DIR
    python -m moe_ep.aot build --arch sm_90a --quant fp8_block128 --model qwen3 --out DIR  # FP8 layers (H100/H200)
    python -m moe_ep.aot build --arch sm_90a --model mixtral --gpu "NVIDIA H100 80GB HBM3" --out DIR  # per-GPU picks
    python -m moe_ep.aot build --arch sm_100a --model nemotron --out DIR   # NVFP4 W4A16 layers (B200)
    python -m moe_ep.aot build --arch sm_120a --model qwen3 --out DIR      # MXFP8 layers (RTX PRO 6000)
    python -m moe_ep.aot list   [--dir DIR]
    python -m moe_ep.aot verify [--dir DIR]

``build`` compiles every kernel a layer of that model needs (FC1, FC2, the EP and expert-layout
kernels) for the given EP size and token capacity, on any machine (CPU only is fine), and stores
them in DIR (default: the cache in use, ``MOE_EP_CACHE_DIR`` or ``~/.cache/moe_ep``). A layer
whose process points ``MOE_EP_CACHE_DIR`` at DIR (or calls
``moe_ep.api.set_compile_cache_dir(DIR)``) loads them instead of compiling: its warm-up says, per
kernel, ``loaded`` or ``compiled`` and how long it took. Kernels are keyed by everything they
were compiled from, so a layer never loads a kernel built for other values; building twice is
all hits; several processes building into one DIR at once compile each kernel once.
"""

from __future__ import annotations

import argparse
import sys
import time


#: the weight format each Blackwell arch's backend runs (sm_90a: BF16)
ARCH_QUANT = {"sm_100a": "nvfp4_w4a16", "sm_120a": "mxfp8"}


def _models():
    from moe_ep.bench.models import MODELS

    return MODELS


def build(args) -> int:
    from moe_ep.backends import COMPILE_EVENTS, compile_cache_root, prebuild, set_compile_cache_dir

    if args.out:
        set_compile_cache_dir(args.out)
    root = compile_cache_root()
    if root is None:
        print("moe_ep.aot build: the disk cache is disabled (MOE_EP_CACHE_DIR=off); pass --out DIR", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in _models()]
    if unknown:
        print(f"moe_ep.aot build: unknown model(s) {unknown}; known: {sorted(_models())}", file=sys.stderr)
        return 2
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    if args.quant and args.arch != "sm_90a":
        print(f"moe_ep.aot build: --quant {args.quant} is for --arch sm_90a ({args.arch} builds "
              f"{ARCH_QUANT.get(args.arch)} layers)", file=sys.stderr)
        return 2
    t_all = time.perf_counter()
    for key in models:
        for ep in args.ep:
            from moe_ep.bench.models import model_config

            cfg = model_config(key, args.max_tokens, quant=args.quant or ARCH_QUANT.get(args.arch))
            seen = len(COMPILE_EVENTS)
            t0 = time.perf_counter()
            try:
                prebuild(cfg, world_size=ep, arch=args.arch, kernels=kernels, gpu=args.gpu)
            except ValueError as e:
                print(f"moe_ep.aot build: {e}", file=sys.stderr)
                return 2
            evs = COMPILE_EVENTS[seen:]
            for ev in evs:
                print(f"  {ev.name:<28} {ev.action:<9} {ev.seconds:7.3f} s", flush=True)
            n = {a: sum(e.action == a for e in evs) for a in ("compiled", "loaded", "rebuilt")}
            print(f"{key} ep={ep} max_tokens={args.max_tokens} {args.arch}: {len(evs)} kernels "
                  f"({n['compiled']} compiled, {n['loaded']} loaded, {n['rebuilt']} rebuilt) "
                  f"in {time.perf_counter() - t0:.2f} s", flush=True)
    print(f"cache: {root}  total {time.perf_counter() - t_all:.2f} s")
    return 0


def _root(args):
    from moe_ep.backends import compile_cache_root, set_compile_cache_dir

    if args.dir:
        set_compile_cache_dir(args.dir)
    return compile_cache_root()


def list_(args) -> int:
    from moe_ep.backends import list_cache_entries

    root = _root(args)
    entries = list_cache_entries(root) if root is not None else []
    for e in entries:
        print(f"{e.get('namespace', '?')}  {e['path'].rsplit('/', 1)[-1]}  {e.get('bytes', '?')} B  "
              f"compiled in {e.get('compile_seconds', '?')} s  {e.get('created', '?')}")
    print(f"{len(entries)} entries in {root}")
    return 0


def verify(args) -> int:
    from moe_ep.backends import list_cache_entries, verify_cache_entry

    root = _root(args)
    entries = list_cache_entries(root) if root is not None else []
    bad = 0
    for e in entries:
        why = verify_cache_entry(e)
        if why is not None:
            bad += 1
            print(f"BAD  {e['path']}: {why}")
    print(f"{len(entries) - bad} of {len(entries)} entries load ({root})")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_ep.aot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile a layer's kernels into the cache")
    b.add_argument("--arch", default="sm_90a")
    b.add_argument("--model", default="qwen3", help="comma-separated: " + ",".join(sorted(_models())))
    b.add_argument("--max-tokens", type=int, default=8192, help="MoEConfig.max_tokens_per_rank (default 8192)")
    b.add_argument("--ep", type=int, nargs="+", default=[1], help="EP world size(s) (default 1)")
    b.add_argument("--kernels", default="fc1,fc2,ep,layout", help="subset of fc1,fc2,ep,layout")
    b.add_argument("--quant", default=None, choices=("fp8_block128",),
                   help="sm_90a only: the FP8 block-scaled layer (sm90_fp8_cutedsl) instead of BF16")
    b.add_argument("--gpu", default=None, help="the GPU name the layers will run on, as torch.cuda.get_device_name "
                   "gives it (e.g. 'NVIDIA H100 80GB HBM3'): the kernels picked per GPU are built for it "
                   "(default: the H200's picks)")
    b.add_argument("--out", default=None, help="cache directory (default: MOE_EP_CACHE_DIR or ~/.cache/moe_ep)")
    for name in ("list", "verify"):
        s = sub.add_parser(name, help=f"{name} the entries of a cache")
        s.add_argument("--dir", default=None, help="cache directory (default: the one in use)")
    args = p.parse_args(argv)
    return {"build": build, "list": list_, "verify": verify}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
