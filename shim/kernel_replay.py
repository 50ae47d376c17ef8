"""Rebuild a disk compile cache from a manifest of its keys, on any machine (no GPU needed).

Every entry of the disk cache (:mod:`.disk_cache`) records the ``repr`` of the frozen key it was
compiled from, and that key holds every value the kernel depends on. So the list of a cache's
keys (a *manifest*: :func:`manifest`) is enough to compile the same kernels again elsewhere:
:func:`replay` compiles each listed kernel into the cache in use, with the drops of this
checkout. The use: a GPU machine starts empty each session, and the GPU test suite spends most
of its device time compiling; a manifest of the last suite run's cache, replayed on the CPU
machine and carried, lets the next GPU machine load those kernels instead.

A manifest recorded at another drop version is still useful: the version fields of each key
(drop, ABI and cutlass-dsl versions) are replaced by this checkout's, so the kernel compiled is
the one a test asking the same question gets today. An entry whose key class has changed
fields, or whose drop or launch mode this process cannot build, is skipped with the reason.

Manifest entries (JSON objects): ``namespace`` (the cache folder it came from), ``name`` (the
file label, e.g. ``gemm_swiglu``) and ``key`` (the key's ``repr``). Replayed: the SM90 drop's
BF16 and FP8 GEMMs, FP8 row quantisers, EP and layout kernels; the SM100 drop's W4A16 GEMMs; the
SM120 drop's MXFP8 GEMMs and row quantisers.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from . import disk_cache

def manifest(root: str | Path | None = None) -> list[dict]:
    """The manifest of the cache at ``root`` (default: the one in use): one entry per committed
    kernel, sorted, without the object files' checksums or times."""
    return merge([{"namespace": e["namespace"], "name": Path(e["path"]).stem.rsplit("-", 1)[0],  # "<name>-<kid>.o"
                   "key": e["key"]}
                  for e in disk_cache.list_entries(root) if "error" not in e and e.get("key") and e.get("namespace")])


def merge(*manifests: list[dict]) -> list[dict]:
    """The union of manifests, sorted (one entry per namespace, name and key)."""
    out = {(e["namespace"], e["name"], e["key"]): e for m in manifests for e in m}
    return [out[k] for k in sorted(out)]


def write_manifest(path: str | Path, entries: list[dict]) -> None:
    Path(path).write_text(json.dumps(entries, indent=0) + "\n")


def read_manifest(path: str | Path) -> list[dict]:
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list) or not all(isinstance(e, dict) and {"namespace", "name", "key"} <= e.keys()
                                                for e in entries):
        raise ValueError(f"{path}: not a kernel manifest (a JSON list of objects with namespace, name and key)")
    return entries


#: the drops whose kernels are replayed: cache-folder prefix -> shim module (under ``.drops``)
DROPS = {"sm90-megamoe-": "sm90_megamoe", "sm100-w4a16-": "sm100_w4a16", "sm120-mxfp8-": "sm120_mxfp8"}


def _key_classes() -> dict:
    from .drops.sm90_megamoe import GemmKey
    from .drops.sm90_megamoe_ep import EpKey
    from .drops.sm90_megamoe_fp8 import Fp8Key
    from .drops.sm90_megamoe_layout import LayoutKey
    from .drops.sm100_w4a16 import W4A16Key
    from .drops.sm120_mxfp8 import Mxfp8Key

    return {c.__name__: c for c in (GemmKey, EpKey, Fp8Key, LayoutKey, W4A16Key, Mxfp8Key)}


def _literal(node: ast.AST) -> Any:
    """A constant (numbers, strings, booleans, None, negative numbers) or a tuple of them (the
    activation constants' (name, value) pairs), else ValueError."""
    value = ast.literal_eval(node)

    def plain(v):
        return isinstance(v, (int, float, str, bool, type(None))) or (isinstance(v, tuple) and all(map(plain, v)))

    if not plain(value):
        raise ValueError(f"not a plain constant: {ast.unparse(node)}")
    return value


def parse_key(text: str) -> tuple[Any, str | None]:
    """``repr`` of a recorded key -> (key, kind): ``Key(...)`` gives kind None, ``(Key(...), 'kind')``
    (the EP and layout kernels) gives the kind. Only the known key classes with constant fields
    are accepted (no code is evaluated); ValueError otherwise, naming what is wrong."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:  # a truncated or hand-edited manifest: that entry is skipped, not the run
        raise ValueError(f"not a key repr ({e.msg}): {text[:80]}") from None
    kind = None
    if isinstance(node, ast.Tuple):
        if len(node.elts) != 2:
            raise ValueError(f"a (key, kind) pair was expected: {text[:80]}")
        node, kind = node.elts[0], _literal(node.elts[1])
        if not isinstance(kind, str):
            raise ValueError(f"the kind must be a string: {text[:80]}")
    classes = _key_classes()
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in classes):
        raise ValueError(f"not one of the replayed key classes {sorted(classes)}: {text[:80]}")
    if node.args:
        raise ValueError(f"positional fields in a key repr: {text[:80]}")
    cls = classes[node.func.id]
    fields = {kw.arg: _literal(kw.value) for kw in node.keywords}
    known = {f.name for f in dataclasses.fields(cls)}
    if fields.keys() - known:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(fields.keys() - known)} today (the key changed)")
    try:
        return cls(**fields), kind
    except TypeError as e:  # a field added since without a default
        raise ValueError(f"{cls.__name__} needs fields the recorded key lacks ({e})") from None


def current_versions(drop: str) -> dict:
    """This checkout's version fields (drop, ABI and cutlass-dsl versions) for ``drop`` (a :data:`DROPS`
    value): what a recorded key's versions are replaced with."""
    import importlib

    m = importlib.import_module(f"{__package__}.drops.{drop}")
    versions = {"drop_version": m.CONSTANTS.value(m.PKG, "DROP_VERSION"), "abi_version": m._C["ABI_VERSION"],
                "cutlass_version": disk_cache.cutlass_version()}
    if drop == "sm90_megamoe":  # its EP and layout kernels have ABI versions of their own
        versions.update(ep_abi_version=m._E["EP_ABI_VERSION"], layout_abi_version=m._L["LAYOUT_ABI_VERSION"])
    return versions


def refreshed(key: Any, versions: dict) -> Any:
    """``key`` with this checkout's version fields (those of ``versions`` it has)."""
    names = {f.name for f in dataclasses.fields(key)}
    return dataclasses.replace(key, **{f: v for f, v in versions.items() if f in names})


def _builder(key: Any, kind: str | None) -> Callable[[], Any]:
    from .drops.sm90_megamoe import GemmKey, build_grouped_gemm
    from .drops.sm90_megamoe_ep import EpKey, build_ep_kernel
    from .drops.sm90_megamoe_fp8 import QUANTIZER_NAMES, Fp8Key, build_fp8_quantizer, compiled_gemm_of_key
    from .drops.sm90_megamoe_layout import LayoutKey, build_layout_kernel
    from .drops.sm100_w4a16 import W4A16Key, build_w4a16_gemm
    from .drops.sm120_mxfp8 import Mxfp8Key, build_mxfp8_kernel

    if isinstance(key, W4A16Key) and kind is None:
        return lambda: build_w4a16_gemm(key)
    if isinstance(key, Mxfp8Key) and kind is None and key.kind in ("gemm", "quantize"):
        return lambda: build_mxfp8_kernel(key)
    if isinstance(key, GemmKey) and kind is None:
        return lambda: build_grouped_gemm(key)
    if isinstance(key, Fp8Key) and kind is None and key.kind == "gemm":
        return lambda: compiled_gemm_of_key(key)
    if isinstance(key, Fp8Key) and kind is None and key.kind in QUANTIZER_NAMES:
        return lambda: build_fp8_quantizer(key)
    if isinstance(key, EpKey) and kind is not None:
        return lambda: build_ep_kernel(key, kind)
    if isinstance(key, LayoutKey) and kind is not None:
        return lambda: build_layout_kernel(key, kind)
    raise ValueError(f"no builder for {type(key).__name__} with kind {kind!r}")


def _pdl(namespace: str) -> bool:
    """Whether a namespace holds PDL-launched kernels (``.../sm_90a-pdl``)."""
    return namespace.rsplit("/", 1)[-1].endswith("-pdl")


def replay_entry(entry: dict, versions: dict) -> tuple[str, str]:
    """Compile (or find) one manifest entry in the cache in use: (outcome, detail), outcome one
    of ``loaded`` (already there), ``compiled``, ``skipped`` (cannot be built here; detail says
    why) or ``failed`` (the build raised; detail is the error). ``versions``: drop -> its
    :func:`current_versions`, filled as drops are met."""
    from .drops.sm90_megamoe import pdl_launches

    drop = next((d for prefix, d in DROPS.items() if entry["namespace"].startswith(prefix)), None)
    if drop is None:
        return "skipped", (f"drop {entry['namespace'].split('/', 1)[0]} is not replayed (replayed: "
                           f"{', '.join(p.rstrip('-') for p in DROPS)})")
    if drop not in versions:
        versions[drop] = current_versions(drop)
    if drop == "sm90_megamoe" and _pdl(entry["namespace"]) != pdl_launches():
        want = "1" if _pdl(entry["namespace"]) else "0"
        return "skipped", f"compiled with PDL launches {'on' if want == '1' else 'off'}: replay with SM90_MEGAMOE_PDL={want}"
    try:
        key, kind = parse_key(entry["key"])
        if not type(key).__module__.rsplit(".", 1)[-1].startswith(drop):
            raise ValueError(f"a {type(key).__name__} in drop {drop}'s folder")
        key = refreshed(key, versions[drop])
        build = _builder(key, kind)
    except ValueError as e:
        return "skipped", str(e)
    seen = len(disk_cache.EVENTS)
    try:
        build()
    except Exception as e:  # noqa: BLE001 - one entry's failure is reported, the rest go on
        return "failed", f"{type(e).__name__}: {e}"
    actions = {ev.action for ev in disk_cache.EVENTS[seen:]}
    return ("compiled", "") if actions & {"compiled", "rebuilt"} else ("loaded", "")


def replay(entries: list[dict], part: tuple[int, int] = (0, 1),
           log: Callable[[str], None] | None = None) -> dict:
    """Replay ``entries`` (every ``part[1]``-th, from ``part[0]``: for several processes sharing
    one cache) into the cache in use; returns the count of each outcome. ``log`` gets one line
    per entry that was not simply loaded."""
    if disk_cache.cache_root() is None:
        raise ValueError("kernel replay: the disk cache is disabled (MOE_EP_CACHE_DIR=off); set a folder")
    i, n = part
    if not 0 <= i < n:
        raise ValueError(f"kernel replay: part {i}/{n} is not one of 0/{n} ... {n - 1}/{n}")
    versions: dict = {}
    counts = {"loaded": 0, "compiled": 0, "skipped": 0, "failed": 0}
    for entry in entries[i::n]:
        outcome, detail = replay_entry(entry, versions)
        counts[outcome] += 1
        if log is not None and outcome != "loaded":
            log(f"{outcome:<8} {entry['name']}" + (f": {detail}" if detail else ""))
    return counts
