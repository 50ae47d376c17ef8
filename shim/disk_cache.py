"""Persistent compile cache: compiled kernels exported to object files and loaded back.

Every kernel of a layer is compiled once per machine instead of once per process: the shim asks
:func:`get_or_build` for a kernel by its compile key; a valid entry on disk is loaded with
``cute.runtime.load_module`` (milliseconds), otherwise the kernel is compiled, exported with
``export_to_c`` and stored. The in-memory :data:`~moe_ep.shim.cache.COMPILE_CACHE` stays in
front of this one.

Layout of a cache directory (``MOE_EP_CACHE_DIR``, default ``$XDG_CACHE_HOME/moe_ep`` or
``~/.cache/moe_ep``; ``MOE_EP_CACHE_DIR=off`` disables it)::

    <root>/v1/<namespace>/<name>-<key id>.o      the exported kernel (host launch code + cubin)
    <root>/v1/<namespace>/<name>-<key id>.json   metadata, written last: the entry's commit mark
    <root>/v1/<namespace>/<name>-<key id>.lock   per-entry lock (flock)

``namespace`` = ``<drop>-v<drop version>-<fingerprint of the drop's sources>/cutlass-dsl-<version>/
<arch>``: a changed byte in a drop source, another drop version, cutlass-dsl version or arch
lands in another folder. ``key id`` hashes the full compile key (every compile-time value).

Concurrency: a process takes the entry's lock, then loads it or builds it; others wait on the
lock and load what the first one wrote, so N ranks compile each kernel once. Files are written
into a temporary folder next to the entry and renamed into place (``.o`` first, ``.json`` last),
so a reader never sees a torn entry. An entry whose metadata does not match its key, whose
object's checksum is wrong or that fails to load is reported (:class:`CompileCacheWarning`),
removed and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ENV = "MOE_EP_CACHE_DIR"
FORMAT = "v1"
_OFF = ("0", "off", "none", "false")  # (empty is unset: the default directory, as for every variable)


class CompileCacheWarning(UserWarning):
    """A disk cache entry was unusable (corrupt, stale or unloadable) and is being rebuilt."""


@dataclass(frozen=True)
class CacheEvent:
    """One kernel obtained by the shim: ``action`` is ``compiled`` (no disk cache or a miss),
    ``loaded`` (from disk) or ``rebuilt`` (a bad entry replaced); ``seconds`` of wall time."""

    name: str
    action: str
    seconds: float
    path: str | None


#: every kernel obtained in this process, in order (warmup() reports the new ones)
EVENTS: list[CacheEvent] = []
_EVENTS_LOCK = threading.Lock()
_root_override: Path | None | str = "unset"


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Use ``path`` as the disk cache (None: disable it) for kernels compiled from now on in this
    process, over ``MOE_EP_CACHE_DIR``. ``set_cache_dir("env")`` goes back to the environment."""
    global _root_override
    _root_override = "unset" if path == "env" else (None if path is None else Path(path).expanduser())


def cache_root() -> Path | None:
    """The disk cache directory in use, or None when disabled."""
    if _root_override != "unset":
        return _root_override  # type: ignore[return-value]
    v = os.environ.get(ENV)
    if v:
        return None if v.strip().lower() in _OFF else Path(v).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe_ep"


def source_fingerprint(src: str | os.PathLike) -> str:
    """sha256 over the relative paths and bytes of every file under ``src`` (``__pycache__`` and
    ``*.pyc`` skipped), in sorted order: any changed byte changes it."""
    src = Path(src)
    h = hashlib.sha256()
    for p in sorted(src.rglob("*")):
        if not p.is_file() or "__pycache__" in p.parts or p.suffix == ".pyc":
            continue
        h.update(p.relative_to(src).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def cutlass_version() -> str:
    """The installed nvidia-cutlass-dsl version (part of every compile key and namespace). Raises
    when it cannot be determined: a compile key with an unknown version could serve stale code."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError as e:
        raise RuntimeError("moe_ep: cannot determine the nvidia-cutlass-dsl version (is it installed "
                           "as a package?); it is part of every compile key") from e


def drop_namespace(arch_dir: str, drop: str, version: int, target: str) -> str:
    """Disk-cache folder of drop ``arch_dir/drop`` (version ``version``) for compile target
    ``target``: drop, version, a fingerprint of its sources, the cutlass-dsl version, the target.
    The fingerprint is computed once per process and drop."""
    fp = _FINGERPRINTS.get((arch_dir, drop))
    if fp is None:
        from .paths import drop_src

        fp = _FINGERPRINTS[(arch_dir, drop)] = source_fingerprint(drop_src(arch_dir, drop))[:16]
    return f"{arch_dir}-{drop}-v{version}-{fp}/cutlass-dsl-{cutlass_version()}/{target}"


_FINGERPRINTS: dict = {}


def key_id(namespace: str, key: Any) -> str:
    """20 hex digits naming one compile key inside a namespace (repr of the frozen key)."""
    return hashlib.sha256(f"{namespace}\0{key!r}".encode()).hexdigest()[:20]


def _sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive flock on ``path`` (created if needed); released on exit."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


_RUNTIME_LOADED: bool | None = None


def _load_cute_runtime(tvm_ffi: bool = False) -> None:
    """Exported objects call CuTeDSL's runtime wrappers (``_cudaLaunchKernelEx``, ...), which
    live in its ``libcute_dsl_runtime.so``. Export resolves them in this process, so load that
    library globally first; it needs no GPU, which is what lets a CPU machine prebuild."""
    global _RUNTIME_LOADED
    if _RUNTIME_LOADED is True or _RUNTIME_LOADED == tvm_ffi:
        return
    import ctypes

    from cutlass.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=tvm_ffi):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    # True: everything (TVM-FFI's library too) is loaded; False: CuTeDSL's runtime only
    _RUNTIME_LOADED = True if tvm_ffi else False


def _record(name: str, action: str, seconds: float, path: Path | None) -> None:
    with _EVENTS_LOCK:
        EVENTS.append(CacheEvent(name, action, seconds, None if path is None else str(path)))


def _entry_paths(root: Path, namespace: str, name: str, key: Any) -> tuple[Path, Path, Path, str]:
    kid = key_id(namespace, key)
    d = root / FORMAT / namespace
    stem = f"{name}-{kid}"
    return d / f"{stem}.o", d / f"{stem}.json", d / f"{stem}.lock", f"moe_ep_{kid}"


def _try_load(obj: Path, meta: Path, namespace: str, key: Any, prefix: str) -> tuple[Any, str | None]:
    """(loaded kernel, None) or (None, why the entry is unusable); (None, None) = no entry."""
    if not meta.exists():
        return None, None
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        return None, f"unreadable metadata ({e})"
    if m.get("key") != repr(key) or m.get("namespace") != namespace or m.get("prefix") != prefix:
        return None, "metadata of another key (stale entry)"
    if not obj.exists():
        return None, "object file missing"
    if _sha256_file(obj) != m.get("sha256"):
        return None, "object file checksum mismatch (corrupt)"
    try:
        return _load_object(obj, prefix, bool(m.get("tvm_ffi", False))), None
    except Exception as e:  # noqa: BLE001 - any failure to load means: rebuild
        return None, f"failed to load ({type(e).__name__}: {e})"


def _load_object(obj: Path, prefix: str, tvm_ffi: bool) -> Any:
    """The kernel exported as ``prefix`` in ``obj`` (a ``tvm_ffi.Function`` for TVM-FFI kernels)."""
    import cutlass.cute as cute

    _load_cute_runtime(tvm_ffi)
    return cute.runtime.load_module(str(obj), enable_tvm_ffi=tvm_ffi)[prefix]


def _store(fn: Any, obj: Path, meta: Path, namespace: str, key: Any, prefix: str, seconds: float,
           tvm_ffi: bool) -> None:
    """Export ``fn`` and move it into place atomically (object first, metadata last)."""
    _load_cute_runtime(tvm_ffi)
    obj.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=obj.parent))
    try:
        tobj = tmp / f"{prefix}.o"
        if tvm_ffi:  # TVM-FFI functions export to an object path under a function name
            fn.export_to_c(str(tobj), prefix)
        else:
            fn.export_to_c(str(tmp), prefix, function_prefix=prefix)
        m = {"format": FORMAT, "namespace": namespace, "key": repr(key), "prefix": prefix, "tvm_ffi": tvm_ffi,
             "sha256": _sha256_file(tobj), "bytes": tobj.stat().st_size, "compile_seconds": round(seconds, 3),
             "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid()}
        (tmp / "meta.json").write_text(json.dumps(m, indent=1))
        os.replace(tobj, obj)
        os.replace(tmp / "meta.json", meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def get_or_build(namespace: str, name: str, key: Any, build: Callable[[], Any], tvm_ffi: bool = False) -> Any:
    """The compiled kernel for ``key``: from the disk cache when it holds a valid entry, else
    ``build()`` (a ``cute.compile`` result), stored for next time. Without a cache directory this
    is ``build()``. ``name`` (a short label such as ``gemm_swiglu``) names the files and events.
    ``tvm_ffi``: ``build()`` compiles with ``--enable-tvm-ffi`` (exported and loaded as such; a
    loaded entry is a ``tvm_ffi.Function``). It must be part of ``key``."""
    root = cache_root()
    if root is None:
        t0 = time.perf_counter()
        fn = build()
        _record(name, "compiled", time.perf_counter() - t0, None)
        return fn
    obj, meta, lock, prefix = _entry_paths(root, namespace, name, key)
    with _locked(lock):
        t0 = time.perf_counter()
        fn, why = _try_load(obj, meta, namespace, key, prefix)
        if fn is not None:
            _record(name, "loaded", time.perf_counter() - t0, obj)
            return fn
        if why is not None:
            warnings.warn(f"moe_ep compile cache: {obj.name}: {why}; rebuilding it", CompileCacheWarning,
                          stacklevel=2)
            for p in (meta, obj):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        t0 = time.perf_counter()
        fn = build()
        seconds = time.perf_counter() - t0
        _store(fn, obj, meta, namespace, key, prefix, seconds, tvm_ffi)
        _record(name, "rebuilt" if why is not None else "compiled", seconds, obj)
        return fn


def list_entries(root: str | os.PathLike | None = None) -> list[dict]:
    """Metadata of every committed entry under ``root`` (default: :func:`cache_root`), each with
    ``path`` (the object file) and ``namespace``."""
    r = Path(root) if root is not None else cache_root()
    if r is None or not (r / FORMAT).is_dir():
        return []
    out = []
    for meta in sorted((r / FORMAT).rglob("*.json")):
        try:
            m = json.loads(meta.read_text())
        except (OSError, ValueError):
            m = {"namespace": "?", "key": "?", "error": "unreadable metadata"}
        m["path"] = str(meta.with_suffix(".o"))
        out.append(m)
    return out


def verify_entry(entry: dict) -> str | None:
    """None when the entry's object matches its checksum and loads, else why not."""
    obj = Path(entry["path"])
    if "error" in entry:
        return entry["error"]
    if not obj.exists():
        return "object file missing"
    if _sha256_file(obj) != entry.get("sha256"):
        return "object file checksum mismatch (corrupt)"
    try:
        _load_object(obj, entry["prefix"], bool(entry.get("tvm_ffi", False)))
    except Exception as e:  # noqa: BLE001
        return f"failed to load ({type(e).__name__}: {e})"
    return None
