"""Per-drop contracts: what the shim relies on in a drop, declared as data.

Each drop's shim module declares one :class:`DropContract`: where the drop lives, its top-level
packages, its version, the constants the shim mirrors, the callables it calls with the parameter
names it passes, and the symbols it imports. The first compile checks the constants; the audit
(``python -m moe_ep.shim.audit``) checks all of it statically, so a drop refresh that changes a
signature fails loudly before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .constants import MirroredConstants
from .paths import drop_src, register_drop


@dataclass(frozen=True)
class CallableUse:
    """A drop callable the shim calls: ``"pkg.module:Class.method"`` and the parameter names the
    shim passes (positionally in this order, or by keyword). ``self`` is not listed."""

    target: str
    params: tuple[str, ...]

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":")[1]


@dataclass(frozen=True)
class ImportUse:
    """``from <module> import <symbol>`` done by the shim module ``consumer``."""

    module: str
    symbol: str
    consumer: str


@dataclass(frozen=True)
class DropContract:
    arch: str
    drop: str
    version: int
    packages: tuple[str, ...]
    constants: MirroredConstants
    callables: tuple[CallableUse, ...] = ()
    imports: tuple[ImportUse, ...] = ()
    consumers: tuple[str, ...] = field(default=())

    @property
    def key(self) -> str:
        return f"{self.arch}/{self.drop}"

    def src(self, root: Path | None = None) -> Path:
        return drop_src(self.arch, self.drop, root)

    def activate(self) -> None:
        """Put the drop on ``sys.path`` (collision-checked) so its packages import."""
        register_drop(self.src())
