"""Path setup for kernel drops, with a guard against top-level name collisions.

A drop lives in ``kernel_src/<arch>/<drop>/src`` and is imported by its own top-level package
name. :func:`register_drop` puts that ``src`` on ``sys.path`` (idempotently) after checking that
none of its top-level names is already provided by another tree: two SM90/SM100 trees that both
shipped a package called ``kernels`` would otherwise silently shadow one another.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from .errors import DropCollisionError

_KERNEL_SRC = Path(__file__).resolve().parent.parent / "kernel_src"
_LOCK = threading.Lock()
# top-level module name -> src folder that provides it (for every registered drop)
_OWNER: dict[str, Path] = {}


def kernel_src_root() -> Path:
    """Folder holding ``<arch>/<drop>/src`` trees."""
    return _KERNEL_SRC


def drop_src(arch: str, drop: str, root: Path | None = None) -> Path:
    """``<root>/<arch>/<drop>/src``; raises ``FileNotFoundError`` naming what exists."""
    base = Path(root) if root is not None else _KERNEL_SRC
    src = base / arch / drop / "src"
    if not src.is_dir():
        have = sorted(str(p.relative_to(base)) for p in base.glob("*/*/src") if p.is_dir())
        raise FileNotFoundError(f"no kernel drop at {src}; drops present: {have or 'none'}")
    return src


def top_level_names(src: Path) -> tuple[str, ...]:
    """Top-level importable names a ``src`` folder provides (packages and modules)."""
    names = []
    for p in sorted(Path(src).iterdir()):
        if p.is_dir() and (p / "__init__.py").is_file():
            names.append(p.name)
        elif p.is_file() and p.suffix == ".py":
            names.append(p.stem)
    return tuple(names)


def _module_origin(name: str) -> Path | None:
    mod = sys.modules.get(name)
    if mod is None:
        return None
    f = getattr(mod, "__file__", None)
    if f is None:
        paths = list(getattr(mod, "__path__", []) or [])
        return Path(paths[0]).resolve() if paths else Path("<namespace>")
    return Path(f).resolve()


def register_drop(src: Path) -> tuple[str, ...]:
    """Make a drop importable: check collisions, then prepend ``src`` to ``sys.path`` once.

    Returns the drop's top-level names. Raises :class:`DropCollisionError` naming both trees
    when a name is already owned by another registered drop or already imported from elsewhere.
    """
    src = Path(src).resolve()
    names = top_level_names(src)
    with _LOCK:
        for name in names:
            owner = _OWNER.get(name)
            if owner is not None and owner != src:
                raise DropCollisionError(
                    f"top-level module {name!r} of drop tree {src} collides with the one "
                    f"already registered from {owner}; drops need unique top-level names")
            origin = _module_origin(name)
            if origin is not None and src not in origin.parents and origin != src:
                raise DropCollisionError(
                    f"top-level module {name!r} of drop tree {src} is already imported from "
                    f"{origin}; drops need unique top-level names")
        for name in names:
            _OWNER[name] = src
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    return names


def registered() -> dict[str, Path]:
    """Top-level name -> src folder, for every drop registered in this process."""
    with _LOCK:
        return dict(_OWNER)
