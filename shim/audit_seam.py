"""The audit's static half: the seam between the shim and its drops, read with :mod:`ast` only.

Part of :mod:`moe_ep.shim.audit` (which runs these checks and prints their findings); nothing
here imports or compiles drop code:

* :func:`scan_shim_imports` -- every ``import``/``from ... import`` of drop code under ``shim/``
  names a file the drop has and (for ``from``) a name defined at its top level;
* :func:`scan_string_loads` -- every call ``_load("pkg.mod")`` / ``importlib.import_module("pkg.mod")``
  with a literal string under ``shim/`` names a module file some drop's ``src/`` has; and the
  attributes the shim reads off what it loaded: ``x = _load("m")`` then ``x.Name`` (also through
  ``self.<attr> = _load("m")`` in a class, and ``_load("m").Name`` directly), and
  ``x.Class(...).attr`` / ``obj = x.Class(...)`` then ``obj.attr`` (also ``self.obj``);
* :func:`check_attributes` -- every :class:`~moe_ep.shim.contract.AttributeUse` a contract
  declares exists in the drop: a class attribute is assigned as ``self.<attr>`` in a method of the
  class (or of a base class defined in the drop), or is a class-level field/annotation, a method,
  a property or a nested class; a module attribute is bound at the module's top level;
* :func:`check_reads` -- every attribute read found by :func:`scan_string_loads` exists in the
  drop and is declared by an ``AttributeUse`` of some contract.

"Cannot tell statically" is never a finding: a class with a base outside the drop (or a
``__getattr__``, or a non-literal ``setattr(self, ...)``), a module with a ``__getattr__`` or a
``*``-import from outside the drop, a name bound by a plain assignment rather than a ``class``.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from .layering import iter_imports, literal_import


@dataclass(frozen=True, order=True)
class Finding:
    """One problem: where (``file``, path relative to the root, and ``line``), what, both sides."""

    file: str
    what: str
    expected: str
    found: str
    line: int | None = None

    def __str__(self) -> str:
        loc = f"{self.file}:{self.line}" if self.line else self.file
        return f"{loc}: {self.what}: expected {self.expected}; found {self.found}"


def rel_to(root: Path, p: Path) -> str:
    try:
        return p.resolve().relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _similar(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(names), n=3, cutoff=0.6)
    return f" (similar: {', '.join(close)})" if close else ""


# --------------------------------------------------------------------------- module-level names


@lru_cache(maxsize=256)
def _parse_cached(path: str, text: str) -> ast.Module | None:
    try:
        return ast.parse(text, path)
    except (SyntaxError, ValueError):
        return None


def parse(path: Path) -> ast.Module | None:
    """The parsed file (cached by content: one audit asks for the same file many times); None
    when it does not parse."""
    try:
        return _parse_cached(str(path), path.read_text())
    except (OSError, UnicodeDecodeError):
        return None


def _walk_top(stmts: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """Module-level statements, descending into if/try/with/for blocks but not into defs."""
    for s in stmts:
        yield s
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for attr in ("body", "orelse", "finalbody"):
            yield from _walk_top(getattr(s, attr, []) or [])
        for h in getattr(s, "handlers", []) or []:
            yield from _walk_top(h.body)


def _targets(t: ast.expr) -> Iterable[str]:
    if isinstance(t, ast.Name):
        yield t.id
    elif isinstance(t, (ast.Tuple, ast.List)):
        for e in t.elts:
            yield from _targets(e)
    elif isinstance(t, ast.Starred):
        yield from _targets(t.value)


def module_file(src: Path, mod: str) -> Path | None:
    """The file defining dotted module ``mod`` inside a drop ``src`` folder, or None."""
    base = src.joinpath(*mod.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _from_module(src: Path, path: Path, s: ast.ImportFrom) -> str:
    """The absolute dotted module an ``ImportFrom`` in ``path`` (inside ``src``) names."""
    if not s.level:
        return s.module or ""
    pkg = path.relative_to(src).parent.parts
    base = list(pkg[: len(pkg) - (s.level - 1)])
    return ".".join(base + ([s.module] if s.module else []))


def top_level_defs(src: Path, path: Path, _seen: set | None = None) -> dict[str, int] | None:
    """``name -> line`` for every name a module binds at top level; None if unknowable statically
    (a module ``__getattr__``, a ``*`` import from outside the drop, a file that does not parse)."""
    seen = _seen if _seen is not None else set()
    if path in seen:
        return {}
    seen.add(path)
    tree = parse(path)
    if tree is None:
        return None
    names: dict[str, int] = {}
    for s in _walk_top(tree.body):
        found: list[str] = []
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [s.name]
            if s.name == "__getattr__":
                return None
        elif isinstance(s, ast.Assign):
            found = [n for t in s.targets for n in _targets(t)]
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            found = list(_targets(s.target))
        elif isinstance(s, ast.Import):
            found = [a.asname or a.name.split(".")[0] for a in s.names]
        elif isinstance(s, ast.ImportFrom):
            found = [a.asname or a.name for a in s.names if a.name != "*"]
            if any(a.name == "*" for a in s.names):
                target = module_file(src, _from_module(src, path, s))
                sub = top_level_defs(src, target, seen) if target else None
                if sub is None:
                    return None
                for n in sub:
                    names.setdefault(n, s.lineno)
        for n in found:
            names.setdefault(n, s.lineno)
    return names


def module_has(src: Path, mod: str, path: Path, name: str) -> tuple[bool | None, dict[str, int]]:
    """(whether module ``mod`` (file ``path``) has top-level ``name`` or a submodule of that name
    (None: cannot tell), its top-level names)."""
    if module_file(src, f"{mod}.{name}"):
        return True, {}
    defs = top_level_defs(src, path)
    if defs is None:
        return None, {}
    return name in defs, defs


# --------------------------------------------------------------------------- class attributes

#: bases that add no attribute the shim could read (anything else outside the drop: cannot tell)
PLAIN_BASES = {"object", "Generic", "Protocol", "ABC", "NamedTuple"}


def find_class(src: Path, path: Path, qual: str, _seen: set | None = None
               ) -> tuple[str, Path | None, ast.ClassDef | None]:
    """Where class ``qual`` (``A`` or ``A.B``) of module file ``path`` is defined, following
    ``from ... import`` inside the drop: ``("class", file, node)``, ``("gone", None, None)`` when
    the module binds no such name, ``("other", file, None)`` when it is bound but not (statically)
    as a class."""
    seen = _seen if _seen is not None else set()
    head, _, rest = qual.partition(".")
    if (path, head) in seen:
        return "other", path, None
    seen.add((path, head))
    tree = parse(path)
    if tree is None:
        return "other", path, None
    star: list[Path] = []
    for s in _walk_top(tree.body):
        if isinstance(s, ast.ClassDef) and s.name == head:
            node = s
            for part in rest.split(".") if rest else []:
                node = next((c for c in _walk_top(node.body) if isinstance(c, ast.ClassDef) and c.name == part),
                            None)
                if node is None:
                    return "gone", None, None
            return "class", path, node
        if isinstance(s, ast.ImportFrom):
            mod = _from_module(src, path, s)
            for a in s.names:
                if a.name == "*":
                    target = module_file(src, mod)
                    if target:
                        star.append(target)
                    continue
                if (a.asname or a.name) != head:
                    continue
                target = module_file(src, mod)
                if target is None:
                    return "other", path, None  # imported from outside the drop
                if module_file(src, f"{mod}.{a.name}"):
                    return "other", path, None  # a submodule
                sub = f"{a.name}.{rest}" if rest else a.name
                return find_class(src, target, sub, seen)
        bound: list[str] = []
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            bound = [s.name]
        elif isinstance(s, ast.Assign):
            bound = [n for t in s.targets for n in _targets(t)]
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            bound = list(_targets(s.target))
        elif isinstance(s, ast.Import):
            bound = [a.asname or a.name.split(".")[0] for a in s.names]
        if head in bound:
            return "other", path, None
    for target in star:
        kind, f, node = find_class(src, target, qual, seen)
        if kind != "gone":
            return kind, f, node
    return "gone", None, None


def _first_arg(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list):
        return None
    args = fn.args.posonlyargs + fn.args.args
    return args[0].arg if args else None


def _self_stores(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str] | None:
    """Attributes a method assigns on its first argument (``self.x = ...``, ``self.a, self.b = ...``,
    ``setattr(self, "x", v)``, ``object.__setattr__(self, "x", v)``); None: not knowable."""
    me = _first_arg(fn)
    out: set[str] = set()
    if me is None:
        return out
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
            if isinstance(node.ctx, ast.Store):
                out.add(node.attr)
            elif node.attr == "__dict__":
                return None
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            f = node.func
            setter = (isinstance(f, ast.Name) and f.id == "setattr") or \
                     (isinstance(f, ast.Attribute) and f.attr == "__setattr__")
            if setter and isinstance(node.args[0], ast.Name) and node.args[0].id == me:
                name = node.args[1]
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    return None
                out.add(name.value)
    return out


def class_members(src: Path, path: Path, cls: ast.ClassDef, _seen: set | None = None) -> set[str] | None:
    """Every attribute instances of ``cls`` have, statically; None when it cannot be told."""
    seen = _seen if _seen is not None else set()
    if (path, cls.lineno) in seen:
        return set()
    seen.add((path, cls.lineno))
    names: set[str] = set()
    for s in _walk_top(cls.body):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if s.name in ("__getattr__", "__getattribute__"):
                return None
            names.add(s.name)
            stores = _self_stores(s)
            if stores is None:
                return None
            names |= stores
        elif isinstance(s, ast.ClassDef):
            names.add(s.name)
        elif isinstance(s, ast.Assign):
            for t in s.targets:
                names.update(_targets(t))
            if any("__slots__" in _targets(t) for t in s.targets):
                names.update(e.value for e in ast.walk(s.value)
                             if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(s.target))
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in s.names)
    for base in cls.bases:
        b = base.value if isinstance(base, ast.Subscript) else base
        last = b.attr if isinstance(b, ast.Attribute) else b.id if isinstance(b, ast.Name) else None
        if last in PLAIN_BASES:
            continue
        if not isinstance(b, ast.Name):
            return None
        kind, f, node = find_class(src, path, b.id)
        if kind != "class":
            return None  # a base outside the drop (or not a class statically): cannot tell
        sub = class_members(src, f, node, seen)
        if sub is None:
            return None
        names |= sub
    return names


# --------------------------------------------------------------------------- declared attributes


def _expected(root: Path, src: Path, module: str) -> str:
    return rel_to(root, src.joinpath(*module.split("."))) + ".py"


def check_attributes(root: Path, contracts: list[dict]) -> list[Finding]:
    """Every declared ``AttributeUse`` (from the probe's facts) against the drop's sources."""
    out: list[Finding] = []
    for c in contracts:
        if "fatal" in c or not c.get("src_exists"):
            continue
        src = Path(c["src"])
        for use in c.get("attributes", []):
            module, _, qual = use["target"].partition(":")
            attrs = list(use["attrs"])
            path = module_file(src, module)
            if path is None:
                out.append(Finding(_expected(root, src, module),
                                   f"module the shim reads attributes from is gone ({module})",
                                   f"module {module!r} (the shim reads {', '.join(attrs)})", "no such file"))
                continue
            rel = rel_to(root, path)
            if not qual:
                for a in attrs:
                    has, defs = module_has(src, module, path, a)
                    if has is False:
                        out.append(Finding(rel, f"missing attribute: {module}.{a} read by the shim",
                                           f"{a!r} bound at top level of {module} (assigned, imported or defined)",
                                           f"no such name{_similar(a, defs)}"))
                continue
            kind, f, node = find_class(src, path, qual)
            if kind == "gone":
                defs = top_level_defs(src, path) or {}
                out.append(Finding(rel, f"class the shim reads attributes from is gone ({use['target']})",
                                   f"class {qual} defined in (or imported into) {module} "
                                   f"(the shim reads {', '.join(attrs)})",
                                   f"no such name{_similar(qual.split('.')[0], defs)}"))
                continue
            if kind != "class":
                continue
            members = class_members(src, f, node)
            if members is None:
                continue
            for a in attrs:
                if a not in members:
                    out.append(Finding(rel_to(root, f), f"missing attribute: {qual}.{a} read by the shim",
                                       f"{a!r} assigned as self.{a} in a method of {qual} (or of a base "
                                       "class in the drop), or a class-level field, method or property",
                                       f"no such attribute{_similar(a, members)}", node.lineno))
    return out


def declared_keys(contracts: list[dict]) -> set[tuple]:
    """``("mod", module, name)`` and ``("cls", class file, class line, attr)`` for every declared
    AttributeUse whose target resolves (re-exported classes match where they are defined)."""
    keys: set[tuple] = set()
    for c in contracts:
        if "fatal" in c or not c.get("src_exists"):
            continue
        src = Path(c["src"])
        for use in c.get("attributes", []):
            module, _, qual = use["target"].partition(":")
            path = module_file(src, module)
            if not qual:
                keys.update(("mod", module, a) for a in use["attrs"])
            elif path is not None:
                kind, f, node = find_class(src, path, qual)
                if kind == "class":
                    keys.update(("cls", str(f), node.lineno, a) for a in use["attrs"])
    return keys


# --------------------------------------------------------------------------- shim imports and loads


@dataclass
class ShimImport:
    """A static import (``via`` "import") or a string load (``via`` ``_load`` or
    ``importlib.import_module``) of drop code by a shim file."""

    shim_file: str
    line: int
    module: str
    names: tuple[str, ...]  # imported names; for a load: the names/attributes read through it
    src_file: str | None  # relative to root; None when the module is gone
    via: str = "import"

    def describe(self) -> str:
        if self.via != "import":
            reads = f"  (reads {', '.join(self.names)})" if self.names else ""
            return f'{self.via}("{self.module}")  ->  {self.src_file or "MISSING"}{reads}'
        what = f"from {self.module} import {', '.join(self.names)}" if self.names else f"import {self.module}"
        return f"{what}  ->  {self.src_file or 'MISSING'}"


def _shim_files(root: Path) -> Iterable[tuple[Path, Path]]:
    for path in sorted((root / "shim").rglob("*.py")):
        rel = path.relative_to(root)
        if "__pycache__" not in rel.parts:
            yield path, rel


def _owner_src(owners: dict[str, list[Path]], mod: str) -> Path:
    """With colliding drops (reported apart) the first that has the module."""
    top = owners[mod.split(".")[0]]
    return next((s for s in top if module_file(s, mod)), top[0])


def _missing_module(root: Path, src: Path, mod: str, here: str, line: int, kind: str) -> Finding:
    want = rel_to(root, src.joinpath(*mod.split(".")))
    return Finding(here, f"shim {kind} names a module the drop no longer has",
                   f"module {mod!r} at {want}.py or {want}/__init__.py", "no such file", line)


def scan_shim_imports(root: Path, owners: dict[str, list[Path]]) -> tuple[list[ShimImport], list[Finding]]:
    """Every static import of drop code under ``<root>/shim`` and whether its target still exists."""
    rows: list[ShimImport] = []
    out: list[Finding] = []
    for path, rel in _shim_files(root):
        try:
            imports = list(iter_imports(path, rel))
        except SyntaxError:
            continue  # check_layers reports it
        for line, mod, names in imports:
            if mod.split(".")[0] not in owners:
                continue
            src = _owner_src(owners, mod)
            target = module_file(src, mod)
            here = rel.as_posix()
            rows.append(ShimImport(here, line, mod, names, rel_to(root, target) if target else None))
            if target is None:
                out.append(_missing_module(root, src, mod, here, line, "import"))
                continue
            wanted = [n for n in names if n != "*" and not module_file(src, f"{mod}.{n}")]  # not submodules
            defs = top_level_defs(src, target) if wanted else {}
            if defs is None:
                continue  # module __getattr__ or a foreign *-import: cannot tell statically
            for n in wanted:
                if n not in defs:
                    out.append(Finding(here, "shim import names a symbol the drop no longer has",
                                       f"{n!r} defined at top level of {rel_to(root, target)}",
                                       "no such name", line))
    return rows, out


#: shim helpers that import a drop module named by their first argument (besides import_module)
LOADERS = ("_load",)


def load_call(node: ast.AST) -> tuple[str, str] | None:
    """``(via, module)`` when ``node`` is ``_load("m")`` / ``importlib.import_module("m")`` /
    ``import_module("m")`` with a literal string."""
    return literal_import(node, (*LOADERS, "import_module"))


@dataclass(frozen=True)
class SeamRead:
    """An attribute the shim reads off a string-loaded drop module: ``module.name`` (``attr``
    None), or ``attr`` of an instance of class ``module.name`` (or of what calling it returned)."""

    shim_file: str
    line: int
    module: str
    name: str
    attr: str | None
    load_line: int  # line of the load call the value came from

    def describe(self) -> str:
        return self.name if self.attr is None else f"{self.name}().{self.attr}"


_OTHER = ("other",)  # a name bound to something the scan does not follow (or to several things)


def _value(e: ast.AST, env: dict, me: str | None, selfattrs: dict) -> tuple | None:
    """What an expression holds: ``("mod", m, line)`` a loaded module, ``("name", m, line, N)``
    its attribute ``N``, ``("call", m, line, N)`` the result of calling that; else None."""
    lc = load_call(e)
    if lc:
        return "mod", lc[1], e.lineno
    if isinstance(e, ast.Name):
        v = env.get(e.id)
        return None if v in (None, _OTHER) else v
    if isinstance(e, ast.Attribute):
        if me and isinstance(e.value, ast.Name) and e.value.id == me:
            v = selfattrs.get(e.attr)
            return None if v in (None, _OTHER) else v
        base = _value(e.value, env, me, selfattrs)
        return ("name", base[1], base[2], e.attr) if base and base[0] == "mod" else None
    if isinstance(e, ast.Call):
        f = _value(e.func, env, me, selfattrs)
        return ("call", f[1], f[2], f[3]) if f and f[0] == "name" else None
    return None


def _same(a: tuple, b: tuple) -> bool:
    """The same drop object (two loads of one module count as one)."""
    return (a[0], a[1], a[3:]) == (b[0], b[1], b[3:])


def _bind(table: dict, key: str, v: tuple | None) -> None:
    cur = table.get(key)
    if v is None:
        table[key] = _OTHER
    elif cur is None:
        table[key] = v
    elif cur is not _OTHER and not _same(cur, v):
        table[key] = _OTHER  # bound to two different things: not followed


def _is_none(e: ast.AST | None) -> bool:
    return isinstance(e, ast.Constant) and e.value is None


def _assigns(scope: ast.AST) -> list[tuple[list[ast.expr], ast.expr]]:
    """``(targets, value)`` of every assignment in ``scope`` (nested defs included), in source order."""
    found = []
    for n in ast.walk(scope):
        if isinstance(n, ast.Assign):
            found.append((n.lineno, n.col_offset, n.targets, n.value))
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            found.append((n.lineno, n.col_offset, [n.target], n.value))
    return [(t, v) for _, _, t, v in sorted(found, key=lambda x: (x[0], x[1]))]


def _scope_env(scope: ast.AST, me: str | None, selfattrs: dict) -> dict:
    """Local names of a function (nested functions and lambdas folded in) -> what they hold."""
    env: dict = {}
    direct = set()
    for targets, value in _assigns(scope):
        for t in targets:
            if isinstance(t, ast.Name):
                direct.add(id(t))
    for n in ast.walk(scope):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and id(n) not in direct:
            env[n.id] = _OTHER
        elif isinstance(n, ast.arg) and n.arg != me:
            env[n.arg] = _OTHER
    for targets, value in _assigns(scope):
        if _is_none(value):
            continue
        v = _value(value, env, me, selfattrs)
        for t in targets:
            if isinstance(t, ast.Name):
                _bind(env, t.id, v)
    return env


def _class_selfattrs(cls: ast.ClassDef) -> dict:
    """``self.<attr>`` -> what it holds, over every method of the class (a fixed point: a method
    may read ``self.x`` that another one bound)."""
    methods = [s for s in _walk_top(cls.body) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
    table: dict = {}
    for _ in range(3):
        new: dict = {}
        for m in methods:
            me = _first_arg(m)
            if me is None:
                continue
            env = _scope_env(m, me, table)
            direct = set()
            for targets, value in _assigns(m):
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == me:
                        direct.add(id(t))
                        if not _is_none(value):
                            _bind(new, t.attr, _value(value, env, me, table))
            for n in ast.walk(m):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and id(n) not in direct \
                        and isinstance(n.value, ast.Name) and n.value.id == me:
                    new[n.attr] = _OTHER
        if new == table:
            break
        table = new
    return table


def _reads_in(scope: ast.AST, here: str, me: str | None, selfattrs: dict) -> list[SeamRead]:
    env = _scope_env(scope, me, selfattrs)
    out = []
    for n in ast.walk(scope):
        if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)):
            continue
        v = _value(n.value, env, me, selfattrs)
        if v is None:
            continue
        if v[0] == "mod":
            out.append(SeamRead(here, n.lineno, v[1], n.attr, None, v[2]))
        else:  # an attribute of the drop object ("name") or of what calling it returned ("call")
            out.append(SeamRead(here, n.lineno, v[1], v[3], n.attr, v[2]))
    return out


def scan_string_loads(root: Path, owners: dict[str, list[Path]]
                      ) -> tuple[list[ShimImport], list[SeamRead], list[Finding]]:
    """Every string load of drop code under ``<root>/shim`` (checked against the drops' files) and
    every attribute read off what was loaded."""
    rows: list[ShimImport] = []
    reads: list[SeamRead] = []
    out: list[Finding] = []
    for path, rel in _shim_files(root):
        tree = parse(path)
        if tree is None:
            continue  # check_layers reports it
        here = rel.as_posix()
        for n in ast.walk(tree):
            lc = load_call(n)
            if lc is None:
                continue
            via, mod = lc
            top = mod.split(".")[0]
            if top not in owners:
                if via in LOADERS:
                    out.append(Finding(here, f"shim string load names no drop's module ({via})",
                                       f"a module of a drop under kernel_src/*/*/src "
                                       f"(top-level names: {', '.join(sorted(owners)) or 'none'})",
                                       f"{mod!r}: no drop provides {top!r}", n.lineno))
                continue
            src = _owner_src(owners, mod)
            target = module_file(src, mod)
            rows.append(ShimImport(here, n.lineno, mod, (), rel_to(root, target) if target else None, via))
            if target is None:
                out.append(_missing_module(root, src, mod, here, n.lineno, "string load"))
        found: list[SeamRead] = []
        top_stmts = [s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef))]
        found += _reads_in(ast.Module(body=top_stmts, type_ignores=[]), here, None, {})
        for s in _walk_top(tree.body):
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += _reads_in(s, here, None, {})
            elif isinstance(s, ast.ClassDef):
                selfattrs = _class_selfattrs(s)
                for m in _walk_top(s.body):
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        found += _reads_in(m, here, _first_arg(m), selfattrs)
        reads += [r for r in found if r.module.split(".")[0] in owners]
    reads = sorted(set(reads), key=lambda r: (r.shim_file, r.line, r.module, r.name, r.attr or ""))
    for row in rows:
        if row.via != "import":
            row.names = tuple(sorted({r.describe() for r in reads
                                      if r.shim_file == row.shim_file and r.load_line == row.line}))
    return rows, reads, out


def check_reads(root: Path, owners: dict[str, list[Path]], reads: list[SeamRead],
                contracts: list[dict] | None) -> list[Finding]:
    """Each attribute the shim reads off loaded drop code exists in the drop and (when the
    contracts are known) is declared by an AttributeUse. A declared read whose attribute is gone
    is reported once, at the drop file, by :func:`check_attributes`."""
    declared = declared_keys(contracts) if contracts is not None else None
    groups: dict[tuple, list[SeamRead]] = {}
    for r in reads:
        groups.setdefault((r.shim_file, r.module, r.name, r.attr), []).append(r)
    out: list[Finding] = []
    for (here, mod, name, attr), rs in groups.items():
        src = _owner_src(owners, mod)
        path = module_file(src, mod)
        if path is None:
            continue  # the load itself is reported
        more = f" (and {len(rs) - 1} more read(s) in this file)" if len(rs) > 1 else ""
        if attr is None:
            has, defs = module_has(src, mod, path, name)
            key: tuple = ("mod", mod, name)
            desc, target, where = f"{mod}.{name}", mod, f"at top level of {rel_to(root, path)}"
            names = defs
        else:
            kind, f, node = find_class(src, path, name)
            if kind != "class":
                continue  # a function's result (or gone: the module read reports it)
            members = class_members(src, f, node)
            has = None if members is None else attr in members
            key = ("cls", str(f), node.lineno, attr)
            desc, target = f"{name}.{attr}", f"{mod}:{name}"
            where, names = f"on class {name} ({rel_to(root, f)}:{node.lineno})", members or ()
        gone = f"; and no such attribute {where}{_similar(attr or name, names)}" if has is False else ""
        if declared is not None and key not in declared:
            out.append(Finding(here, f"undeclared drop attribute read by the shim ({desc})",
                               f"{(attr or name)!r} listed in an AttributeUse({target!r}, ...) of the "
                               "drop's DropContract", f"not declared{gone}{more}", rs[0].line))
        elif declared is None and has is False:
            out.append(Finding(here, f"shim reads an attribute the drop no longer has ({desc})",
                               f"{(attr or name)!r} {where}", f"no such attribute{more}", rs[0].line))
    return out
