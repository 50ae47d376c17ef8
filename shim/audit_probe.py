"""The audit's import-time half, run in a fresh interpreter: ``python audit_probe.py ROOT OUT.json``.

:mod:`moe_ep.shim.audit` never imports drop code itself. It starts this script in a subprocess,
which loads the checkout ``ROOT`` as the package ``moe_ep`` (whatever ``moe_ep`` is installed is
ignored), reads the contracts that checkout's shim declares (``moe_ep.shim.drops.drop_contracts()``),
puts each contract's drop ``src/`` on ``sys.path``, imports the drop modules the contract names
(importing a real drop imports CuTeDSL; nothing is compiled) and writes plain facts as JSON:
signatures, constant drift, whether declared imports resolve, and the declared attribute uses
(as data: the audit checks those statically). The audit judges those facts.

Why a subprocess: importing drops and a second ``moe_ep`` must not pollute the caller's
``sys.path``/``sys.modules``, and ``--root`` must see *that* checkout's shim, not ours.

This file is standard library only and is run as a script (not as ``moe_ep.shim.audit_probe``),
so that it works for any checkout, including one whose own shim has no audit.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def load_root_as_moe_ep(root: Path) -> Any:
    """Import ``root/__init__.py`` as the package ``moe_ep`` (submodules found under ``root``)."""
    init = root / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location("moe_ep", init, submodule_search_locations=[str(root)])
    else:  # a checkout without a top-level __init__.py still works as a namespace-like package
        spec = importlib.util.spec_from_loader("moe_ep", loader=None, is_package=True)
        spec.submodule_search_locations = [str(root)]
    mod = importlib.util.module_from_spec(spec)
    sys.modules["moe_ep"] = mod  # before exec: submodule imports must resolve to root, not site-packages
    if spec.loader is not None:
        spec.loader.exec_module(mod)
    return mod


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _file(obj: Any) -> tuple[str | None, int | None]:
    """(source file, first line) of a module/class/function, unwrapping decorators."""
    try:
        target = inspect.unwrap(obj) if callable(obj) else obj
        f = inspect.getsourcefile(target) or inspect.getfile(target)
    except (TypeError, OSError):
        return None, None
    try:
        line = inspect.getsourcelines(target)[1] if not inspect.ismodule(target) else None
    except (TypeError, OSError):
        line = None
    return f, line


def _import(modname: str) -> tuple[Any, str | None]:
    """(module, None) or (None, 'missing') / (None, 'ExcType: message')."""
    try:
        return importlib.import_module(modname), None
    except ModuleNotFoundError as e:
        # only "this module (or a parent) is gone" is 'missing'; a dependency it lacks is an error
        if e.name and (modname == e.name or modname.startswith(e.name + ".")):
            return None, "missing"
        return None, _err(e)
    except Exception as e:  # noqa: BLE001 - any import failure is a fact to report
        return None, _err(e)


def probe_callable(target: str, params: tuple[str, ...]) -> dict:
    """Resolve ``pkg.mod:Qual.name`` and describe its signature as the caller sees it (no self)."""
    out: dict = {"target": target, "params": list(params), "module": target.split(":")[0],
                 "file": None, "line": None, "signature": None, "error": None}
    modname, _, qual = target.partition(":")
    mod, err = _import(modname)
    if mod is None:
        out["error"] = "module missing" if err == "missing" else f"import failed: {err}"
        return out
    out["file"] = getattr(mod, "__file__", None)
    obj, owner = mod, None
    for part in qual.split("."):
        if not hasattr(obj, part):
            out["error"] = f"no attribute {part!r}"
            return out
        owner, obj = obj, getattr(obj, part)
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as e:
        out["error"] = f"no signature: {_err(e)}"
        return out
    ps = list(sig.parameters.values())
    # a plain function looked up on a class (Class.__call__) still lists `self`: the shim never passes it
    if inspect.isclass(owner) and inspect.isfunction(obj) and ps:
        if not isinstance(inspect.getattr_static(owner, qual.split(".")[-1]), staticmethod):
            ps = ps[1:]
    out["signature"] = [[p.name, p.kind.name, p.default is not inspect.Parameter.empty] for p in ps]
    f, line = _file(obj)
    if f:
        out["file"], out["line"] = f, line
    return out


def probe_contract(c: Any, root: Path) -> dict:
    src = root / "kernel_src" / c.arch / c.drop / "src"
    rec: dict = {"key": f"{c.arch}/{c.drop}", "arch": c.arch, "drop": c.drop,
                 "version": getattr(c, "version", None), "packages": list(getattr(c, "packages", ())),
                 "consumers": list(getattr(c, "consumers", ())), "src": str(src), "src_exists": src.is_dir(),
                 "callables": [], "drift": [], "constants_errors": [], "constant_files": {},
                 "n_constants": 0, "imports": [],
                 # declarations only: the audit checks them statically (audit_seam), never by import
                 "attributes": [{"target": u.target, "attrs": [u.attrs] if isinstance(u.attrs, str) else list(u.attrs)}
                                for u in getattr(c, "attributes", ())]}
    if not src.is_dir():
        return rec
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    for use in getattr(c, "callables", ()):
        rec["callables"].append(probe_callable(use.target, tuple(use.params)))
    consts = getattr(c, "constants", None)
    if consts is not None:
        rec["n_constants"] = sum(len(v) for v in consts.table.values())
        for modname in consts.table:
            mod, err = _import(modname)
            rec["constant_files"][modname] = getattr(mod, "__file__", None) if mod else None
            if mod is None:
                rec["constants_errors"].append([modname, "module missing" if err == "missing" else err])
        if not rec["constants_errors"]:
            # the shim's own drift check (so the audit and the first compile agree), resolving on
            # the sys.path set up above rather than through the contract's activate hook
            try:
                for m, n, mirrored, found in consts.drift(importlib.import_module):
                    missing = isinstance(found, str) and found == "<missing>"
                    rec["drift"].append([m, n, repr(mirrored), None if missing else repr(found)])
            except Exception as e:  # noqa: BLE001
                rec["constants_errors"].append([None, _err(e)])
    for use in getattr(c, "imports", ()):
        mod, err = _import(use.module)
        item = {"module": use.module, "symbol": use.symbol, "consumer": use.consumer,
                "file": getattr(mod, "__file__", None) if mod else None, "error": None}
        if mod is None:
            item["error"] = "module missing" if err == "missing" else f"import failed: {err}"
        elif not hasattr(mod, use.symbol):
            item["error"] = "symbol missing"
        rec["imports"].append(item)
    return rec


def main(argv: list[str]) -> int:
    root, out_path = Path(argv[0]).resolve(), Path(argv[1])
    facts: dict = {"root": str(root), "error": None, "contracts": []}
    try:
        load_root_as_moe_ep(root)
        contracts = list(importlib.import_module("moe_ep.shim.drops").drop_contracts())
    except BaseException:  # noqa: BLE001 - report, do not crash: the audit turns this into a finding
        facts["error"] = traceback.format_exc(limit=3).strip()
        contracts = []
    for c in contracts:
        try:
            facts["contracts"].append(probe_contract(c, root))
        except Exception:  # noqa: BLE001
            facts["contracts"].append({"key": f"{getattr(c, 'arch', '?')}/{getattr(c, 'drop', '?')}",
                                       "fatal": traceback.format_exc(limit=3).strip()})
    out_path.write_text(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.dont_write_bytecode = True  # the audit is read-only: no __pycache__ inside drops
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # our own folder (shim/) must not become a top-level import location
    sys.exit(main(sys.argv[1:]))
