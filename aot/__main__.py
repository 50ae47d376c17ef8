"""Prebuilt kernels: ``python -m moe_ep.aot build|list|verify``.

    python -m moe_ep.aot build --arch sm_90a --model qwen3 [--max-tokens 8192] [--ep 1] --out DIR
    python -m moe_ep.aot build --arch sm_90a --quant fp8_block128 --model qwen3 --out DIR  # FP8 layers (H100/H200)
    python -m moe_ep.aot build --arch sm_90a --model mixtral --gpu "NVIDIA H100 80GB HBM3" --out DIR  # per-GPU picks
    python -m moe_ep.aot build --arch sm_100a --model nemotron --out DIR   # NVFP4 W4A16 layers (B200)
    python -m moe_ep.aot build --arch sm_120a --model qwen3 --out DIR      # MXFP8 layers (RTX PRO 6000)
    python -m moe_ep.aot list   [--dir DIR]
    python -m moe_ep.aot verify [--dir DIR]
    python -m moe_ep.aot manifest [--dir DIR] [--merge F] --out FILE  # the keys of a cache's kernels, merged into FILE
    python -m moe_ep.aot replay FILE [--out DIR] [--jobs N]  # compile the kernels a manifest lists

``build`` compiles every kernel a layer of that model needs (FC1, FC2, the EP and expert-layout
kernels) for the given EP size and token capacity, on any machine (CPU only is fine), and stores
them in DIR (default: the cache in use, ``MOE_EP_CACHE_DIR`` or ``~/.cache/moe_ep``). A layer
whose process points ``MOE_EP_CACHE_DIR`` at DIR (or calls
``moe_ep.api.set_compile_cache_dir(DIR)``) loads them instead of compiling: its warm-up says, per
kernel, ``loaded`` or ``compiled`` and how long it took. Kernels are keyed by everything they
were compiled from, so a layer never loads a kernel built for other values; building twice is
all hits; several processes building into one DIR at once compile each kernel once.

``manifest`` writes the keys of every kernel in a cache (a GPU run's, say) to a JSON file, merged
with what the file already lists; ``replay`` compiles every kernel a manifest lists into DIR on
any machine, with this checkout's drops (see :mod:`moe_ep.shim.kernel_replay`). The GPU suite's
manifest (``bench/suite_kernels.json``) rebuilds, on the CPU machine, the kernels the suite compiled
on its last GPU run, so the next GPU machine loads them.
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


def manifest(args) -> int:
    from pathlib import Path

    from moe_ep.backends import cache_manifest, merge_cache_manifests, read_cache_manifest, write_cache_manifest

    found, where = [], []
    if args.dir or not args.merge:  # a cache's entries (the one in use unless --dir)
        root = _root(args)
        found, where = (cache_manifest(root) if root is not None else []), [str(root)]
    try:
        for f in args.merge or ():  # manifests written elsewhere (a GPU run's suite_kernels.json)
            found, where = merge_cache_manifests(found, read_cache_manifest(f)), where + [f]
        old = read_cache_manifest(args.out) if Path(args.out).exists() else []
    except (OSError, ValueError) as e:
        print(f"moe_ep.aot manifest: {e}", file=sys.stderr)
        return 2
    merged = merge_cache_manifests(old, found)
    write_cache_manifest(args.out, merged)
    print(f"{len(found)} kernels in {', '.join(where)}; {args.out}: {len(old)} -> {len(merged)} entries")
    return 0


def replay(args) -> int:
    import os
    import subprocess

    from moe_ep.backends import compile_cache_root, read_cache_manifest, replay_cache_manifest

    if args.out:
        os.environ["MOE_EP_CACHE_DIR"] = args.out  # the child processes too
    try:
        entries = read_cache_manifest(args.manifest)
    except (OSError, ValueError) as e:
        print(f"moe_ep.aot replay: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.jobs > 1 and args.part is None:  # one child per job, each every jobs-th entry, one shared cache
        cmd = [sys.executable, "-m", "moe_ep.aot", "replay", args.manifest]
        kids = [subprocess.Popen(cmd + ["--part", f"{i}/{args.jobs}"]) for i in range(args.jobs)]
        rcs = [k.wait() for k in kids]
        print(f"replay: {len(entries)} entries in {args.jobs} processes, {time.perf_counter() - t0:.1f} s")
        return max(rcs)
    part = (0, 1)
    if args.part is not None:
        i, n = args.part.split("/")
        part = (int(i), int(n))
    try:
        counts = replay_cache_manifest(entries, part, log=lambda line: print("  " + line, flush=True))
    except ValueError as e:
        print(f"moe_ep.aot replay: {e}", file=sys.stderr)
        return 2
    print(f"replay {part[0]}/{part[1]}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f" in {time.perf_counter() - t0:.1f} s ({compile_cache_root()})", flush=True)
    return 1 if counts["failed"] else 0


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
    m = sub.add_parser("manifest", help="write the keys of a cache's kernels to a JSON manifest")
    m.add_argument("--dir", default=None, help="cache directory (default: the one in use, unless --merge is given)")
    m.add_argument("--merge", action="append", help="a manifest file to merge in as well (repeatable)")
    m.add_argument("--out", required=True, help="manifest file (merged with its entries when it exists)")
    r = sub.add_parser("replay", help="compile every kernel a manifest lists into a cache (no GPU needed)")
    r.add_argument("manifest")
    r.add_argument("--out", default=None, help="cache directory (default: MOE_EP_CACHE_DIR or ~/.cache/moe_ep)")
    r.add_argument("--jobs", type=int, default=1, help="processes compiling at once (default 1)")
    r.add_argument("--part", default=None, help=argparse.SUPPRESS)  # i/n: a child's share
    args = p.parse_args(argv)
    return {"build": build, "list": list_, "verify": verify, "manifest": manifest, "replay": replay}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
