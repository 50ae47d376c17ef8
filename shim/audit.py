"""``python -m moe_ep.shim.audit``: check that the vendored drops and the shim still agree.

Run it after every drop refresh (SKILL.md) and in CI. One line per finding,
``file[:line]: what: expected ...; found ...``; exit status 1 on any finding, 0 with a one-line
"clean" summary otherwise. It runs on CPU in seconds and never compiles anything.

Checks, for the checkout ``--root`` (default: this repository):

* **vendor record** -- each drop's ``src/`` content hash equals the one recorded in ``VENDOR.md``;
  otherwise the files that were added, removed or changed are named. A drop on disk with no
  record, and a record with no drop on disk, are findings too.
* **signatures** -- every constructor/launch callable a contract declares still accepts the
  parameters the shim passes (removed/renamed/reordered) and needs no new required one (added).
* **mirrored constants** -- :meth:`MirroredConstants.drift` is empty.
* **declared imports** -- every :class:`ImportUse` still resolves (module and symbol).
* **layer rules** -- :func:`moe_ep.shim.layering.check_layers` (the rules the import test enforces).
* **top-level names** -- no two drops (and no drop and an installed module) share a name.
* **shim imports** -- every ``import``/``from ... import`` of drop code in ``shim/`` names a file
  that exists in the drop's ``src/`` and (for ``from``) a name defined at its top level (static,
  with :mod:`ast`).
* **string loads** -- every ``_load("pkg.mod")`` / ``importlib.import_module("pkg.mod")`` with a
  literal string in ``shim/`` (how the shim really imports drops: lazily, by name) names a module
  file that exists in some drop's ``src/``. ``--imports`` prints both kinds (shim import -> src
  file, with the names read through each load).
* **declared attributes** -- every :class:`~moe_ep.shim.contract.AttributeUse` still exists, read
  statically from the drop's files: ``"pkg.mod:Class"`` attributes assigned as ``self.<attr>`` in a
  method of the class (or of a base class in the drop), class-level fields/annotations, methods,
  properties; ``"pkg.mod"`` names bound at the module's top level. A renamed field reads
  ``<drop file>:<class line>: missing attribute: <Class>.<attr> read by the shim: ...``.
* **attribute reads** -- every attribute the shim reads off a string-loaded module (``x =
  _load("m")`` then ``x.Name``, also via ``self.<a> = _load("m")``) or off an instance it builds
  from one (``x.Class(...).attr``, ``obj = x.Class(...)`` / ``self.obj = ...`` then ``obj.attr``)
  exists in the drop and is declared in an ``AttributeUse`` (``undeclared drop attribute read by
  the shim``, at the shim's line). Reads through other objects (e.g. a compiled object passed in
  as a parameter) are not traced: declare them by hand. See :mod:`moe_ep.shim.audit_seam`.

Content hash of a drop (recorded in VENDOR.md as ``hash: sha256:<hex>``): the files under ``src/``
minus :data:`JUNK` (bytecode, compiler outputs), sorted by ``/``-separated relative path; the hash
is SHA-256 of the manifest made of one line ``<sha256 of file bytes, hex>  <relpath>\\n`` per file,
i.e. exactly what ``sha256sum`` prints, so it can be checked by hand (see VENDOR.md).

Contracts are read from the audited checkout itself: the checks that import code run in a fresh
interpreter (:mod:`moe_ep.shim.audit_probe`) that loads ``<root>`` as package ``moe_ep``, so a
``--root`` audit sees that checkout's shim and drops, and nothing leaks into the caller's
``sys.modules``/``sys.path``. The static checks (hashes, layers, names, shim imports, string
loads, attributes) use this module's rules on ``<root>``'s files; the probe only reports the
declared ``AttributeUse``s as data, never imports a module to check them.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .audit_seam import (Finding, SeamRead, ShimImport, _targets, _walk_top, check_attributes, check_reads,
                         scan_shim_imports, scan_string_loads)
from .layering import check_layers, drop_src_dirs
from .paths import top_level_names

REPO_ROOT = Path(__file__).resolve().parent.parent
PROBE = Path(__file__).resolve().parent / "audit_probe.py"
#: Build junk inside a drop's src/: never hashed, never recorded (same spirit as .gitignore).
JUNK_DIRS = ("__pycache__", ".pytest_cache", ".mypy_cache", "*.egg-info")
JUNK = ("*.pyc", "*.pyo", "*.ptx", "*.cubin", "*.sass", "*.fatbin", ".DS_Store")
RECORD_FENCE = "vendor-record"  # info string of the machine-read block in VENDOR.md
SHORT = 12  # hex digits of a per-file hash recorded in VENDOR.md


# --------------------------------------------------------------------------- content hash


def _is_junk(rel: Path) -> bool:
    if any(fnmatch.fnmatch(part, pat) for part in rel.parts[:-1] for pat in JUNK_DIRS):
        return True
    return any(fnmatch.fnmatch(rel.name, pat) for pat in JUNK)


def drop_files(src: Path) -> dict[str, str]:
    """``relpath -> sha256 hex`` of every non-junk file under ``src`` (relpaths ``/``-separated)."""
    out = {}
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_file() and not _is_junk(rel):
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def tree_hash(files: dict[str, str]) -> str:
    """SHA-256 of the ``sha256sum``-style manifest of ``files`` (see module docstring)."""
    manifest = "".join(f"{h}  {rel}\n" for rel, h in sorted(files.items()))
    return hashlib.sha256(manifest.encode()).hexdigest()


# --------------------------------------------------------------------------- VENDOR.md records


@dataclass
class Record:
    """A ``vendor-record`` block of VENDOR.md."""

    drop: str  # "<arch>/<drop>"
    hash: str  # hex, no "sha256:" prefix
    count: int | None
    files: dict[str, str]  # relpath -> first SHORT hex digits
    line: int  # line of the opening fence


def parse_vendor(text: str) -> tuple[list[Record], list[Finding]]:
    """Every ``vendor-record`` block in VENDOR.md, plus findings for malformed ones."""
    recs: list[Record] = []
    bad: list[Finding] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        fence = re.match(r"(`{3,}|~{3,})", s)
        if fence and s != "```" + RECORD_FENCE:
            # any other fenced block (e.g. the format example in VENDOR.md) is skipped whole
            mark = fence.group(1)
            i += 1
            while i < len(lines) and not (lines[i].strip().startswith(mark)
                                          and set(lines[i].strip()) == {mark[0]}):
                i += 1
            i += 1
            continue
        if s != "```" + RECORD_FENCE:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        rec = Record(drop="", hash="", count=None, files={}, line=start)
        in_files = False
        for n, raw in enumerate(body, start + 1):
            s = raw.strip()
            m = re.fullmatch(r"([0-9a-f]{%d})\s+(\S.*)" % SHORT, s) if in_files else None
            if m:
                rec.files[m.group(2)] = m.group(1)
            elif s.startswith("drop:"):
                rec.drop = s[5:].strip()
            elif s.startswith("hash:"):
                rec.hash = s[5:].strip().removeprefix("sha256:")
            elif s.startswith("file-count:") and s[11:].strip().isdigit():
                rec.count = int(s[11:].strip())
            elif s == "files:":
                in_files = True
            elif s:
                bad.append(Finding("VENDOR.md", "malformed vendor record",
                                   "'drop:', 'hash: sha256:<hex>', 'file-count:', 'files:' then "
                                   f"'<sha256-{SHORT}> <relpath>' lines", repr(s), n))
        if not rec.drop or not re.fullmatch(r"[0-9a-f]{64}", rec.hash):
            bad.append(Finding("VENDOR.md", "malformed vendor record",
                               "a 'drop: <arch>/<drop>' line and a 'hash: sha256:<64 hex>' line",
                               f"drop={rec.drop!r} hash={rec.hash!r}", start))
            continue
        if rec.count is not None and rec.count != len(rec.files):
            bad.append(Finding("VENDOR.md", f"vendor record of {rec.drop} is inconsistent",
                               f"file-count {rec.count}", f"{len(rec.files)} file lines", start))
        recs.append(rec)
    return recs, bad


def drop_key(root: Path, src: Path) -> str:
    return src.parent.relative_to(root / "kernel_src").as_posix()


def check_vendor(root: Path) -> list[Finding]:
    """Drops on disk vs VENDOR.md: hashes, file lists, unrecorded and missing drops."""
    vendor = root / "VENDOR.md"
    on_disk = {drop_key(root, s): s for s in drop_src_dirs(root)}
    out: list[Finding] = []
    recs: list[Record] = []
    if vendor.is_file():
        recs, out = parse_vendor(vendor.read_text())
    elif on_disk:
        out.append(Finding("VENDOR.md", "vendor file missing", "VENDOR.md with one record per drop",
                           "no VENDOR.md"))
    by_key: dict[str, Record] = {}
    for r in recs:
        if r.drop in by_key:
            out.append(Finding("VENDOR.md", f"duplicate vendor record for {r.drop}",
                               f"one record (first at line {by_key[r.drop].line})", "a second one", r.line))
        by_key.setdefault(r.drop, r)
    for key, src in on_disk.items():
        rel_src = src.relative_to(root).as_posix()
        files = drop_files(src)
        h = tree_hash(files)
        rec = by_key.get(key)
        if rec is None:
            out.append(Finding(rel_src, "unrecorded drop",
                               f"a vendor-record block for {key} in VENDOR.md",
                               f"a drop on disk ({len(files)} files, sha256:{h}) with no record; "
                               "add one with `python -m moe_ep.shim.audit --print-record`"))
            continue
        if rec.hash == h:
            continue
        added = [f for f in files if f not in rec.files]
        removed = [f for f in rec.files if f not in files]
        changed = [f for f in files if f in rec.files and files[f][:SHORT] != rec.files[f]]
        out.append(Finding(rel_src, "content hash differs from VENDOR.md (unrecorded edit)",
                           f"sha256:{rec.hash} ({len(rec.files)} files)",
                           f"sha256:{h} ({len(files)} files: {len(changed)} changed, {len(added)} added, "
                           f"{len(removed)} removed)"))
        for f in changed:
            out.append(Finding(f"{rel_src}/{f}", "file changed since VENDOR.md",
                               f"sha256 {rec.files[f]}", f"sha256 {files[f][:SHORT]}"))
        for f in added:
            twin = [r for r in removed if rec.files[r] == files[f][:SHORT]]
            note = f", same content as removed {twin[0]}: moved?" if twin else ""
            out.append(Finding(f"{rel_src}/{f}", "file added since VENDOR.md", "no such file in the record",
                               f"a new file (sha256 {files[f][:SHORT]}{note})"))
        for f in removed:
            out.append(Finding(f"{rel_src}/{f}", "file removed since VENDOR.md",
                               f"the recorded file (sha256 {rec.files[f]})", "no such file"))
    for key, rec in by_key.items():
        if key not in on_disk:
            out.append(Finding(f"kernel_src/{key}/src", "recorded drop missing",
                               f"the drop VENDOR.md records at line {rec.line} (sha256:{rec.hash})",
                               "no such folder"))
    return out


def print_record(root: Path, contracts: dict[str, dict], only: str | None = None) -> list[str]:
    """The VENDOR.md section (Markdown bullets + the vendor-record block) of each drop on disk."""
    lines: list[str] = []
    for src in drop_src_dirs(root):
        key = drop_key(root, src)
        if only and key != only:
            continue
        files = drop_files(src)
        c = contracts.get(key, {})
        consumers = ", ".join(f"`{x}`" for x in c.get("consumers", [])) or "TODO (shim modules using it)"
        lines += [f"## {key}", "",
                  f"- arch: {key.split('/')[0]}",
                  "- provenance: TODO author/team, upstream version or commit, date received",
                  f"- drop version: {c.get('version', 'TODO')}",
                  "- vendored subset: TODO what was copied from upstream, what was left out",
                  "- pending local diffs: none",
                  f"- consumers: {consumers}",
                  "", "```" + RECORD_FENCE, f"drop: {key}", f"hash: sha256:{tree_hash(files)}",
                  f"file-count: {len(files)}", "files:"]
        lines += [f"{h[:SHORT]} {rel}" for rel, h in files.items()]
        lines += ["```", ""]
    return lines


# --------------------------------------------------------------------------- names and static imports


def drop_owners(root: Path) -> dict[str, list[Path]]:
    """Top-level name -> every drop src folder providing it (more than one = collision)."""
    owners: dict[str, list[Path]] = {}
    for src in drop_src_dirs(root):
        for name in top_level_names(src):
            owners.setdefault(name, []).append(src)
    return owners


def check_names(root: Path, owners: dict[str, list[Path]]) -> list[Finding]:
    out = []
    srcs = [s.resolve() for s in drop_src_dirs(root)]
    for name, where in sorted(owners.items()):
        rels = [s.relative_to(root).as_posix() for s in where]
        if len(where) > 1:
            for s in rels[1:]:
                out.append(Finding(f"{s}/{name}", "top-level name collision between drops",
                                   f"a top-level name no other drop uses ({name!r})",
                                   f"{name!r} also provided by {rels[0]}"))
            continue
        # a drop shadowing the stdlib or an installed package breaks whichever loses on sys.path
        try:
            spec = None if name == "moe_ep" else importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = getattr(spec, "origin", None)
        origin = Path(origin).resolve() if origin not in (None, "built-in", "frozen") else None
        if origin is not None and any(s in origin.parents for s in srcs):
            origin = None  # found the drop itself (cwd on sys.path)
        other = ("the stdlib" if name in sys.stdlib_module_names else "moe_ep itself" if name == "moe_ep"
                 else f"installed at {origin}" if origin else None)
        if other:
            out.append(Finding(f"{rels[0]}/{name}", "top-level name collides with an installed module",
                               f"a top-level name unused outside the drop ({name!r})", f"{name!r} is {other}"))
    return out


# --------------------------------------------------------------------------- contracts (via the probe)


def run_probe(root: Path, timeout: float = 120.0) -> dict:
    """Facts about ``root``'s contracts, gathered in a fresh interpreter (see audit_probe.py)."""
    with tempfile.TemporaryDirectory(prefix="moe_ep_audit_") as tmp:
        out = Path(tmp) / "facts.json"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        p = subprocess.run([sys.executable, str(PROBE), str(root), str(out)], cwd=tmp, env=env,
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not out.is_file():
            tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
            return {"error": f"probe exited {p.returncode}: " + " | ".join(tail), "contracts": []}
        return json.loads(out.read_text())


def _rel(root: Path, f: str | None, fallback: str) -> str:
    if not f:
        return fallback
    p = Path(f).resolve()
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return str(p)


def _expected_file(root: Path, c: dict, module: str) -> str:
    base = Path(c["src"]).joinpath(*module.split("."))
    return _rel(root, str(base) + ".py", module)


def check_signature(root: Path, c: dict, u: dict) -> list[Finding]:
    """Passed params vs the real signature: removed, renamed, reordered, added-required."""
    f = _rel(root, u["file"], _expected_file(root, c, u["module"]))
    what = f"signature of {u['target']}"
    if u["error"]:
        return [Finding(f, f"callable the shim uses is gone ({u['target']})",
                        f"a callable taking ({', '.join(u['params'])})", u["error"], u["line"])]
    passed = list(u["params"])
    sig = u["signature"]
    names = [n for n, _, _ in sig]
    kinds = {n: k for n, k, _ in sig}
    has_varkw = "VAR_KEYWORD" in kinds.values()
    shown = "(" + ", ".join(n + ("=…" if d else "") if k not in ("VAR_POSITIONAL", "VAR_KEYWORD")
                            else ("*" if k == "VAR_POSITIONAL" else "**") + n for n, k, d in sig) + ")"
    required_new = [n for n, k, d in sig if not d and n not in passed
                    and k not in ("VAR_POSITIONAL", "VAR_KEYWORD")]
    gone = [] if has_varkw else [p for p in passed if kinds.get(p) in (None, "VAR_POSITIONAL", "VAR_KEYWORD")]
    out = []
    # a passed name that vanished while a new required one appeared reads as a rename (paired in order)
    for p, new in zip(gone, required_new):
        out.append(Finding(f, f"{what}: parameter renamed", f"parameter {p!r} (the shim passes it)",
                           f"no {p!r} but a new required {new!r}: {shown}", u["line"]))
    for p in gone[len(required_new):]:
        out.append(Finding(f, f"{what}: parameter removed", f"parameter {p!r} (the shim passes it)",
                           f"no such parameter: {shown}", u["line"]))
    for n in required_new[len(gone):]:
        out.append(Finding(f, f"{what}: required parameter added",
                           f"only parameters the shim passes ({', '.join(passed)}) to be required",
                           f"new required {n!r}: {shown}", u["line"]))
    positional = [n for n in names if kinds[n] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    common = [n for n in passed if n in positional]
    if common != [n for n in positional if n in common]:
        out.append(Finding(f, f"{what}: parameters reordered", f"order ({', '.join(common)})",
                           f"order ({', '.join(n for n in positional if n in common)}): {shown}", u["line"]))
    return out


def _def_line(path: Path | None, name: str) -> int | None:
    if path is None or not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return None
    for s in _walk_top(tree.body):
        if isinstance(s, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            tgts = s.targets if isinstance(s, ast.Assign) else [s.target]
            if any(name in _targets(t) for t in tgts):
                return s.lineno
    return None


def check_contracts(root: Path, facts: dict) -> list[Finding]:
    out: list[Finding] = []
    if facts.get("error"):
        out.append(Finding("shim/drops/__init__.py", "cannot load the shim's drop contracts",
                           "moe_ep.shim.drops.drop_contracts() to import and return contracts",
                           facts["error"].replace("\n", " | ")))
    for c in facts.get("contracts", []):
        if "fatal" in c:
            out.append(Finding("shim/drops", f"cannot probe contract {c['key']}", "a well-formed DropContract",
                               c["fatal"].replace("\n", " | ")))
            continue
        if not c["src_exists"]:
            out.append(Finding(f"kernel_src/{c['key']}/src", "contract names a drop that is not on disk",
                               f"the drop {c['key']} (shim consumers: {', '.join(c['consumers']) or '?'})",
                               "no such folder"))
            continue
        for u in c["callables"]:
            out += check_signature(root, c, u)
        for m, err in c["constants_errors"]:
            f = _expected_file(root, c, m) if m else f"kernel_src/{c['key']}/src"
            out.append(Finding(f, "mirrored constants cannot be checked",
                               f"module {m or '(each)'} the shim mirrors constants from to import", err))
        for m, n, mirrored, found in c["drift"]:
            fpath = c["constant_files"].get(m)
            f = _rel(root, fpath, _expected_file(root, c, m))
            out.append(Finding(f, f"mirrored constant drifted ({m}.{n})", f"{mirrored} (mirrored by the shim)",
                               "no such name" if found is None else found,
                               _def_line(Path(fpath) if fpath else None, n)))
        for im in c["imports"]:
            if im["error"]:
                f = _rel(root, im["file"], _expected_file(root, c, im["module"]))
                out.append(Finding(f, f"shim import gone (from {im['module']} import {im['symbol']}, "
                                      f"used by {im['consumer']})",
                                   f"module {im['module']!r} defining {im['symbol']!r}", im["error"]))
    return out


# --------------------------------------------------------------------------- driver

_LAYER_EXPECT = {
    "drop-imports-moe_ep": "drop code standalone (never importing moe_ep)",
    "drop-imports-drop": "a drop importing only its own packages",
    "drop-import-outside-shim": "drop code imported only by shim/",
    "kernel_src-outside-shim": "moe_ep.kernel_src imported only by shim/",
    "shim-internal": "backends/ importing only names in moe_ep.shim.__all__",
    "upward-import": "imports only downwards (api -> backends -> shim -> drops)",
    "syntax": "a parseable Python file",
}


@dataclass
class Report:
    root: Path
    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    shim_imports: list[ShimImport] = field(default_factory=list)  # static imports and string loads
    seam_reads: list[SeamRead] = field(default_factory=list)
    n_drops: int = 0

    @property
    def clean(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        cs = [c for c in self.facts.get("contracts", []) if "fatal" not in c]
        n_call = sum(len(c["callables"]) for c in cs)
        n_const = sum(c["n_constants"] for c in cs)
        n_imp = sum(len(c["imports"]) for c in cs)
        n_attr = sum(len(u["attrs"]) for c in cs for u in c.get("attributes", []))
        n_load = sum(r.via != "import" for r in self.shim_imports)
        n_reads = len({(r.module, r.name, r.attr) for r in self.seam_reads})
        return (f"moe-ep audit: clean ({self.root}): {self.n_drops} drop(s) match VENDOR.md; "
                f"{len(cs)} contract(s): {n_call} signature(s), {n_const} mirrored constant(s), "
                f"{n_imp} declared import(s), {n_attr} declared attribute(s); "
                f"{len(self.shim_imports) - n_load} shim import(s) and {n_load} string load(s) of drop code, "
                f"{n_reads} attribute(s) read through them; layer rules and top-level names OK")


def audit(root: Path | str = REPO_ROOT, facts: dict | None = None) -> Report:
    """Run every check on the checkout ``root``; ``facts`` (from :func:`run_probe`) may be reused."""
    root = Path(root).resolve()
    rep = Report(root, n_drops=len(drop_src_dirs(root)))
    rep.findings += check_vendor(root)
    rep.facts = facts if facts is not None else run_probe(root)
    rep.findings += check_contracts(root, rep.facts)
    for v in check_layers(root):
        rep.findings.append(Finding(v.file, f"layer rule broken [{v.rule}]",
                                    _LAYER_EXPECT.get(v.rule, "the layer rules of moe_ep.shim.layering"),
                                    v.message, v.line))
    owners = drop_owners(root)
    rep.findings += check_names(root, owners)
    rep.shim_imports, bad = scan_shim_imports(root, owners)
    rep.findings += bad
    loads, rep.seam_reads, bad = scan_string_loads(root, owners)
    rep.shim_imports = sorted(rep.shim_imports + loads, key=lambda r: (r.shim_file, r.line))
    rep.findings += bad
    contracts = [c for c in rep.facts.get("contracts", []) if "fatal" not in c]
    rep.findings += check_attributes(root, contracts)
    # undeclared reads are judged only when the contracts loaded (else: existence only)
    rep.findings += check_reads(root, owners, rep.seam_reads, None if rep.facts.get("error") else contracts)
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-ep-audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=REPO_ROOT,
                    help="moe_ep checkout to audit (default: this repository, %(default)s)")
    ap.add_argument("--print-record", nargs="?", const="", metavar="ARCH/DROP",
                    help="print the VENDOR.md section of each drop on disk (or just ARCH/DROP) and exit 0")
    ap.add_argument("--imports", action="store_true",
                    help="print the table 'shim import -> src file' (static imports and string loads, "
                         "with the names read through each load) before the findings")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if not (root / "shim").is_dir() and not (root / "kernel_src").is_dir():
        ap.error(f"{root} does not look like a moe_ep checkout (no shim/ or kernel_src/)")
    if args.print_record is not None:
        facts = run_probe(root)  # only for the drop version and consumers each contract declares
        contracts = {c["key"]: c for c in facts.get("contracts", []) if "fatal" not in c}
        lines = print_record(root, contracts, args.print_record or None)
        if args.print_record and not lines:
            print(f"no drop {args.print_record!r} under {root / 'kernel_src'}", file=sys.stderr)
            return 1
        print("\n".join(lines).rstrip())
        return 0
    rep = audit(root)
    if args.imports:
        print("shim import -> src file")
        for r in rep.shim_imports:
            print(f"  {r.shim_file}:{r.line}  {r.describe()}")
        print()
    for f in rep.findings:
        print(f)
    if rep.clean:
        print(rep.summary())
        return 0
    print(f"moe-ep audit: {len(rep.findings)} finding(s) in {root}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
