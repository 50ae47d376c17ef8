"""Per-drop contracts: what the shim relies on in a drop, declared as data.

Each drop's shim module declares one :class:`DropContract`: where the drop lives, its top-level
packages, its version, the constants the shim mirrors, the callables it calls with the parameter
names it passes, the symbols it imports and the attributes it reads off drop modules and objects
(:class:`AttributeUse`). The first compile checks the constants; the audit
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
class AttributeUse:
    """Attributes the shim reads off drop objects.

    ``target`` ``"pkg.module:Class"``: attributes read from instances (or the class itself); each
    must be assigned as ``self.<attr> = ...`` / ``self.<attr>: T = ...`` in a method of the class
    (or of a base class defined in the drop), or be a class-level field/annotation (dataclass
    fields), a method, a property or a nested class. ``target`` ``"pkg.module"``: module-level
    names (assigned, imported or defined at the module's top level, or a submodule). The audit
    checks them statically (``python -m moe_ep.shim.audit``), and requires every attribute the shim
    reads off a string-loaded drop module (``x = _load("m")`` then ``x.Name``) or off an instance it
    constructs from one to be listed here."""

    target: str
    attrs: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.attrs, str):  # ("x") instead of ("x",)
            object.__setattr__(self, "attrs", (self.attrs,))
        else:
            object.__setattr__(self, "attrs", tuple(self.attrs))

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def qualname(self) -> str | None:
        """The class (``"Class"`` or ``"Outer.Inner"``), None for module-level names."""
        return self.target.split(":")[1] if ":" in self.target else None


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
    attributes: tuple[AttributeUse, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.arch}/{self.drop}"

    def src(self, root: Path | None = None) -> Path:
        return drop_src(self.arch, self.drop, root)

    def activate(self) -> None:
        """Put the drop on ``sys.path`` (collision-checked) so its packages import."""
        register_drop(self.src())
