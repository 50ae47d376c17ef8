"""The PTX of every kernel a layer compiles, saved and compared: the proof that a refactor-only drop
version changes no kernel (SKILL.md, "Proving the verified kernels unchanged"). CPU only.

    python -m moe_ep.bench.ptx_snapshot save /tmp/old -- --arch sm_90a --model qwen3,mixtral
    MOE_EP_BF16_CLUSTER=1 python -m moe_ep.bench.ptx_snapshot save /tmp/old -- --model qwen3 --kernels fc1
    ... edit the drop ...
    python -m moe_ep.bench.ptx_snapshot save /tmp/new -- --arch sm_90a --model qwen3,mixtral
    python -m moe_ep.bench.ptx_snapshot compare /tmp/old /tmp/new      # exit 0: byte-identical

``save`` runs ``python -m moe_ep.aot build`` (the arguments after ``--``) into a fresh, empty
cache, so every kernel is compiled rather than loaded (one ``save`` per process: a second one in
the same process would find them built and fails), with ``--keep-ptx`` added to each
``cute.compile`` and, unless a call names its own, a ``--dump-dir`` of this process (CuTeDSL reads a
kernel's PTX back from a file named after the kernel, by default in the working directory: two
``save`` runs at once there overwrote each other's files, and one snapshot held another kernel's
PTX). Each kernel's PTX, less its comment, ``.file`` and ``.loc`` lines (source paths
and line numbers, which any edit moves), is written to ``DIR/<entry>.<sha256[:16]>.ptx``; several
``save`` runs into one DIR add to it. ``compare`` checks that two DIRs hold the same set of
kernels, byte for byte, and names the entries that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import tempfile
from pathlib import Path

_DROPPED = re.compile(r"^\s*(//|\.file\b|\.loc\b)")
_ENTRY = re.compile(r"\.entry\s+([A-Za-z0-9_$]+)")


def strip_ptx(ptx: str) -> str:
    """``ptx`` without comment, ``.file`` and ``.loc`` lines (what an edit elsewhere in a file moves)."""
    return "\n".join(line for line in ptx.splitlines() if not _DROPPED.match(line))


def snapshot_name(ptx: str) -> str:
    """``<entry name, at most 60 characters>.<first 16 hex of the sha256>.ptx`` of stripped PTX."""
    m = _ENTRY.search(ptx)
    entry = (m.group(1) if m else "no_entry")[:60]
    return f"{entry}.{hashlib.sha256(ptx.encode()).hexdigest()[:16]}.ptx"


def save(out: Path, build_argv: list) -> int:
    """Compile what ``moe_ep.aot build build_argv`` compiles, into a fresh cache, writing each
    kernel's stripped PTX under ``out``. Returns the build's exit code."""
    import cutlass.cute as cute

    from moe_ep.aot.__main__ import main as aot_main

    if "--out" in build_argv:
        raise SystemExit("ptx_snapshot save: pass no --out (the build goes to a fresh cache, so nothing loads)")
    out.mkdir(parents=True, exist_ok=True)
    compile_ = cute.compile
    written = []

    def compile_keeping_ptx(*args, **kwargs):
        opts = f"{kwargs.get('options', '')} --keep-ptx"
        if "--dump-dir" not in opts:
            opts += f" --dump-dir={dump_dir}"
        kwargs["options"] = opts.strip()
        compiled = compile_(*args, **kwargs)
        ptx = strip_ptx(compiled.__ptx__)
        path = out / snapshot_name(ptx)
        path.write_text(ptx)
        written.append(path)
        return compiled

    cute.compile = compile_keeping_ptx  # the drops call it as cute.compile(...), looked up at each call
    try:
        with tempfile.TemporaryDirectory(prefix="moe_ep_ptx_") as cache, \
                tempfile.TemporaryDirectory(prefix="moe_ep_ptx_dump_") as dump_dir:
            rc = aot_main(["build", *build_argv, "--out", cache])
    finally:
        cute.compile = compile_
    print(f"ptx_snapshot: {len(written)} kernels compiled, {len(set(written))} distinct PTX written to {out}")
    if not written:  # the shim's in-process cache had them: nothing was compiled, nothing to show
        print("ptx_snapshot save: no kernel was compiled (this process had built them already); run each "
              "save in a fresh process", file=sys.stderr)
        return rc or 3
    return rc


def compare(old: Path, new: Path) -> int:
    """0 when ``old`` and ``new`` hold the same stripped PTX files, else 1 with what differs."""
    a = {p.name for p in old.glob("*.ptx")}
    b = {p.name for p in new.glob("*.ptx")}
    if not a or not b:
        print(f"ptx_snapshot compare: no PTX in {old if not a else new}", file=sys.stderr)
        return 2
    if a == b:
        print(f"ptx_snapshot: identical, {len(a)} kernels")
        return 0
    for where, names in ((old, sorted(a - b)), (new, sorted(b - a))):
        for name in names[:20]:
            print(f"  only in {where}: {name}")
        if len(names) > 20:
            print(f"  ... and {len(names) - 20} more only in {where}")
    print(f"ptx_snapshot: DIFFERENT: {len(a - b)} kernels only in {old}, {len(b - a)} only in {new}, "
          f"{len(a & b)} in both")
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench.ptx_snapshot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="compile into a fresh cache and write each kernel's stripped PTX")
    s.add_argument("dir", type=Path)
    s.add_argument("build_args", nargs=argparse.REMAINDER, help="-- then the arguments of moe_ep.aot build")
    c = sub.add_parser("compare", help="are two snapshots the same kernels, byte for byte")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.old, args.new)
    build_argv = args.build_args[1:] if args.build_args[:1] == ["--"] else args.build_args
    return save(args.dir, build_argv)


if __name__ == "__main__":
    sys.exit(main())
