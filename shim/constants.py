"""Mirrored ABI constants: values the shim relies on, checked against the drop at first compile.

The shim cannot import drop code at module import time (that would compile-time-couple every
import of moe_ep to CuTeDSL), so it keeps its own copy of the few drop constants its validation
and allocation depend on. :class:`MirroredConstants` declares them and verifies them once against
the drop module; drift raises with both values instead of producing silent out-of-bounds writes.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

from .errors import ConstantDriftError


@dataclass
class MirroredConstants:
    """A table ``{module: {NAME: value}}`` of constants mirrored from a drop.

    ``module`` is the drop module's import name (e.g. ``"sm90_megamoe.constants"``).
    """

    drop: str
    table: Mapping[str, Mapping[str, Any]]
    #: called before the drop's modules are resolved (puts the drop on sys.path)
    activate: Callable[[], None] | None = None
    _checked: bool = field(default=False, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def value(self, module: str, name: str) -> Any:
        return self.table[module][name]

    def drift(self, resolve: Any = None) -> list[tuple[str, str, Any, Any]]:
        """``(module, name, mirrored, found)`` for every mismatch; ``found`` is ``"<missing>"``
        when the drop no longer defines the name. ``resolve(module_name) -> module`` defaults
        to :func:`importlib.import_module`."""
        if resolve is None:
            if self.activate is not None:
                self.activate()
            resolve = importlib.import_module
        out = []
        for modname, consts in self.table.items():
            mod: ModuleType = resolve(modname)
            for name, mirrored in consts.items():
                found = getattr(mod, name, "<missing>")
                if found != mirrored:
                    out.append((modname, name, mirrored, found))
        return out

    def check(self, resolve: Any = None) -> None:
        """Raise :class:`ConstantDriftError` naming every drifted constant (both values)."""
        bad = self.drift(resolve)
        if bad:
            lines = "; ".join(f"{m}.{n}: shim mirrors {v!r}, drop has {f!r}" for m, n, v, f in bad)
            raise ConstantDriftError(f"drop {self.drop!r} constants drifted from the shim: {lines}")

    def ensure_checked(self, resolve: Any = None) -> None:
        """:meth:`check` once per process (called at a drop's first compile)."""
        if self._checked:
            return
        with self._lock:
            if not self._checked:
                self.check(resolve)
                self._checked = True
