"""The layer rules, checked by parsing sources with :mod:`ast` (shared by the tests and the audit).

moe_ep's layers import only downwards::

    api/ -> backends/ -> shim/ -> kernel_src/<arch>/<drop>/src (drops)

* a drop never imports ``moe_ep``;
* only ``shim/`` imports drop code (any top-level name a drop's ``src/`` provides);
* ``backends/`` may import only the names ``moe_ep.shim`` exports in ``__all__``
  (``moe_ep.shim.<submodule>`` is an internal);
* ``api/`` (and downstream code in this repository: ``bench/``, ``aot/``) imports neither ``shim``
  nor drops; ``integrations/`` (adapters for other libraries) imports ``moe_ep.api`` only;
* lower layers never import upper ones (shim -> backends/api, backends -> api), nor the downstream
  code (``bench/``, ``aot/``, ``integrations/``) from ``api/``, ``backends/`` or ``shim/``.

An import by a literal string (``importlib.import_module("m")``, ``import_module("m")``,
``__import__("m")``) counts as an import of ``m``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PKG = "moe_ep"
LAYERS = ("api", "backends", "shim", "kernel_src", "bench", "aot", "integrations")
SKIP_DIRS = {".git", ".device", ".whl", "build", "dist", "tests", ".ci", "docs"}  # top-level folders only
DOWNSTREAM = ("bench", "aot", "integrations")  # this repository's users of moe_ep.api


@dataclass(frozen=True)
class Violation:
    file: str  # path relative to the checked root
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}"


def drop_src_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "kernel_src").glob("*/*/src") if p.is_dir())


def drop_top_names(root: Path) -> dict[str, Path]:
    """Top-level name -> drop src folder, for every drop under ``root/kernel_src``."""
    out: dict[str, Path] = {}
    for src in drop_src_dirs(root):
        for p in sorted(src.iterdir()):
            if p.is_dir() and (p / "__init__.py").is_file():
                out.setdefault(p.name, src)
            elif p.suffix == ".py":
                out.setdefault(p.stem, src)
    return out


def shim_public_names(root: Path) -> set[str]:
    """Names in ``shim/__init__.py``'s ``__all__`` (parsed, not imported)."""
    init = root / "shim" / "__init__.py"
    if not init.is_file():
        return set()
    tree = ast.parse(init.read_text(), str(init))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def layer_of(rel: Path) -> str:
    parts = rel.parts
    if parts[0] == "kernel_src":
        return "drop" if "src" in parts[1:] else "kernel_src"
    return parts[0] if parts[0] in LAYERS else "root"


def _module_of(rel: Path) -> list[str]:
    """Dotted package path of a file as installed (``moe_ep.backends.reference.backend``)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if layer_of(rel) == "drop":  # drops are imported by their own top-level names
        return parts[parts.index("src", 1) + 1:]
    return [PKG, *parts]


def iter_imports(path: Path, rel: Path, strings: bool = False) -> Iterator[tuple[int, str, tuple[str, ...]]]:
    """Yield ``(line, absolute_module, imported_names)`` for every import statement in a file; with
    ``strings``, also every import by a literal string (the layer rules count those; the audit's seam
    scan reports them as string loads of its own)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif strings and (hit := literal_import(node)) is not None and hit[1] and not hit[1].startswith("."):
            yield node.lineno, hit[1], ()
        elif isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level:
                base = _module_of(rel)
                if not is_pkg:
                    base = base[:-1]
                up = node.level - 1
                base = base[: len(base) - up] if up else base
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod, names


def literal_import(node: ast.AST, names: tuple[str, ...] = ("import_module", "__import__")
                   ) -> tuple[str, str] | None:
    """``(via, module)`` when ``node`` is ``importlib.import_module("m")`` or a call of a function named in
    ``names`` with a literal string ``m`` (a name built at run time cannot be checked here). The layer
    rules use the default names; the audit's seam scan passes its own (``_load``, ``import_module``)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    a0, f = node.args[0], node.func
    if not (isinstance(a0, ast.Constant) and isinstance(a0.value, str)):
        return None
    if isinstance(f, ast.Name) and f.id in names:
        return f.id, a0.value
    if isinstance(f, ast.Attribute) and f.attr == "import_module" and isinstance(f.value, ast.Name) \
            and f.value.id == "importlib":
        return "importlib.import_module", a0.value
    return None


def _files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in SKIP_DIRS or "__pycache__" in rel.parts:
            continue
        yield p


def check_layers(root: Path) -> list[Violation]:
    """Every layer-rule violation under ``root`` (a moe_ep checkout), naming file and line."""
    root = Path(root).resolve()
    drops = drop_top_names(root)
    public = shim_public_names(root)
    out: list[Violation] = []
    for path in _files(root):
        rel = path.relative_to(root)
        layer = layer_of(rel)
        try:
            imports = list(iter_imports(path, rel, strings=True))
        except SyntaxError as e:
            out.append(Violation(str(rel), e.lineno or 0, "syntax", f"cannot parse: {e.msg}"))
            continue
        own_drop_src = next((s for s in drop_src_dirs(root) if s in path.parents), None)
        for line, mod, names in imports:
            top = mod.split(".")[0]
            sub = mod.split(".")[1] if mod.count(".") >= 1 and top == PKG else None
            v = lambda rule, msg: out.append(Violation(str(rel), line, rule, msg))  # noqa: E731
            if layer == "drop":
                if top == PKG:
                    v("drop-imports-moe_ep", f"drop code imports {mod!r}; drops must be standalone")
                elif top in drops and drops[top] != own_drop_src:
                    v("drop-imports-drop", f"drop imports another drop's package {top!r}")
                continue
            if top in drops and layer != "shim":
                v("drop-import-outside-shim", f"{layer}/ imports drop code {mod!r}; only shim/ may")
            if top != PKG:
                continue
            if mod == PKG and names:  # `from moe_ep import shim`
                for n in names:
                    _check_target(layer, n, f"{PKG}.{n}", v, public)
                continue
            _check_target(layer, sub, mod, v, public, names=names)
    return out


def _check_target(layer, sub, mod, v, public, names=()):
    target = sub
    if target is None:
        return
    if target == "kernel_src" and layer != "shim":
        v("kernel_src-outside-shim", f"{layer}/ imports {mod or 'moe_ep.kernel_src'!r}; only shim/ may")
    if target == "shim":
        if layer in ("api", "bench", "aot", "integrations", "root", "drop"):
            v("shim-from-" + layer, f"{layer}/ imports moe_ep.shim ({mod or 'moe_ep.shim'}); "
              "go through moe_ep.backends")
        elif layer == "backends":
            deeper = mod is not None and mod.count(".") >= 2
            if deeper:
                v("shim-internal", f"backends/ imports shim internal module {mod!r}; "
                  "import only names in moe_ep.shim.__all__")
            else:
                bad = [n for n in names if n not in public]
                if bad:
                    v("shim-internal", f"backends/ imports {bad} from moe_ep.shim, not in its __all__")
    if target in DOWNSTREAM and layer in ("api", "backends", "shim", "kernel_src"):  # (a drop: drop-imports-moe_ep)
        v("upward-import", f"{layer}/ imports moe_ep.{target}, which is downstream code (a user of moe_ep.api)")
    if target in ("backends", "api") and layer in ("shim", "kernel_src"):
        v("upward-import", f"{layer}/ imports moe_ep.{target} (layers import only downwards)")
    if target == "backends" and layer == "integrations":
        v("backends-from-integrations", f"integrations/ imports {mod or 'moe_ep.backends'!r}; "
          "adapters use moe_ep.api only")
    if target == "api" and layer == "backends":
        v("upward-import", "backends/ imports moe_ep.api (layers import only downwards)")
