"""The drop audit (moe_ep.shim.audit) on synthetic checkouts, one per finding, and on this repository.

Each synthetic checkout is a tiny moe_ep tree in a temporary folder: a copy of the real shim's
contract/constants/paths/... modules, a ``shim/drops/toy.py`` contract, and a drop
``kernel_src/sm90/toy/src/<toydrop_uuid>/`` shaped like a real one. The audit loads the checkout's
own contracts in a subprocess, so every test uses a unique drop package name only for clarity.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from moe_ep.shim import audit

REPO = Path(__file__).resolve().parent.parent
REAL_SHIM = ("contract.py", "constants.py", "paths.py", "errors.py", "cache.py", "layering.py")

KERNEL = '''\
"""Toy kernel with the shape of a real drop's kernel class."""

from .constants import TILE_M


class ToyKernel:
    def __init__(self, activation, tile_m=TILE_M):
        self.activation, self.tile_m = activation, tile_m

    def __call__(self, a, b, out, stream=None):
        return out


def helper(x):
    return x


def launch(kernel, a, b):
    return kernel(a, b, None)
'''

CONTRACT = '''\
from ..constants import MirroredConstants
from ..contract import CallableUse, DropContract, ImportUse

PKG = "{pkg}"
CONTRACT = DropContract(
    arch="sm90", drop="toy", version=3, packages=(PKG,),
    constants=MirroredConstants("sm90/toy", {{
        "{pkg}.constants": {{"TILE_M": 128, "ACTIVATIONS": ("identity", "swiglu")}},
    }}),
    callables=(
        CallableUse("{pkg}.kernel:ToyKernel.__init__", ("activation", "tile_m")),
        CallableUse("{pkg}.kernel:ToyKernel.__call__", ("a", "b", "out")),
        CallableUse("{pkg}.kernel:launch", ("kernel", "a", "b")),
    ),
    imports=(ImportUse("{pkg}.kernel", "ToyKernel", "shim/drops/toy.py"),),
    consumers=("shim/drops/toy.py",),
)


def run(a, b):
    CONTRACT.activate()
    import {pkg}.constants
    from {pkg}.kernel import ToyKernel, helper
    return helper(ToyKernel("identity", tile_m={pkg}.constants.TILE_M)(a, b, None))
'''


def _write(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


def run_audit(capsys, root: Path, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = audit.main(["--root", str(root), *args])
    return rc, capsys.readouterr().out.splitlines()


def record(capsys, root: Path) -> None:
    """(Re)write VENDOR.md from ``--print-record``, as a maintainer does after a refresh."""
    rc, lines = run_audit(capsys, root, "--print-record")
    assert rc == 0
    (root / "VENDOR.md").write_text("# Vendored kernel drops\n\n# Drops\n\n" + "\n".join(lines) + "\n")


@pytest.fixture
def checkout(tmp_path, capsys):
    """A clean synthetic checkout with VENDOR.md recorded; yields (root, drop package, drop dir)."""
    root = tmp_path / "checkout"
    pkg = f"toydrop_{uuid.uuid4().hex[:10]}"
    for name in REAL_SHIM:
        _write(root, f"shim/{name}", (REPO / "shim" / name).read_text())
    _write(root, "__init__.py", '"""synthetic moe_ep checkout"""\n')
    _write(root, "shim/__init__.py", """\
        from .constants import MirroredConstants
        from .contract import CallableUse, DropContract, ImportUse
        from .drops import drop_contracts
        __all__ = ["CallableUse", "DropContract", "ImportUse", "MirroredConstants", "drop_contracts"]
        """)
    _write(root, "shim/drops/__init__.py", "from . import toy\n\n\ndef drop_contracts():\n    return [toy.CONTRACT]\n")
    _write(root, "shim/drops/toy.py", CONTRACT.format(pkg=pkg))
    _write(root, "backends/__init__.py", "from moe_ep.shim import drop_contracts\n")
    _write(root, "api/__init__.py", "from .. import backends\n")
    d = root / "kernel_src/sm90/toy/src" / pkg
    _write(root, "kernel_src/__init__.py", "")
    _write(d, "__init__.py", "from .constants import TILE_M\n\nVERSION = 3\n")
    _write(d, "constants.py", "TILE_M = 128\nACTIVATIONS = ('identity', 'swiglu')\n")
    _write(d, "kernel.py", KERNEL)
    _write(d, "build/out.ptx", "// build junk: never hashed\n")
    record(capsys, root)
    return root, pkg, d


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def _only(lines: list[str], needle: str) -> list[str]:
    return [ln for ln in lines if needle in ln]


def test_clean_checkout_passes(checkout, capsys):
    root, pkg, d = checkout
    rc, out = run_audit(capsys, root, "--imports")
    assert rc == 0, out
    assert out[-1].startswith("moe-ep audit: clean") and "3 signature(s)" in out[-1] and "2 mirrored" in out[-1]
    table = "\n".join(out)
    assert f"shim/drops/toy.py:23  from {pkg}.kernel import ToyKernel, helper  ->  " \
           f"kernel_src/sm90/toy/src/{pkg}/kernel.py" in table
    assert f"import {pkg}.constants  ->  kernel_src/sm90/toy/src/{pkg}/constants.py" in table
    # the probe imported the drop in another interpreter: nothing leaked into this one
    assert pkg not in sys.modules and not [p for p in sys.path if pkg in p or "checkout" in p]
    assert not list(d.rglob("__pycache__")), "the audit must not write bytecode into a drop"


def test_record_format_and_hash_match_sha256sum(checkout, capsys):
    root, pkg, d = checkout
    text = (root / "VENDOR.md").read_text()
    assert "```vendor-record\ndrop: sm90/toy\nhash: sha256:" in text and "file-count: 3\nfiles:\n" in text
    assert "- drop version: 3" in text and "`shim/drops/toy.py`" in text and ".ptx" not in text
    recs, bad = audit.parse_vendor(text)
    assert not bad and [r.drop for r in recs] == ["sm90/toy"]
    assert sorted(recs[0].files) == [f"{pkg}/__init__.py", f"{pkg}/constants.py", f"{pkg}/kernel.py"]
    if shutil.which("sha256sum") and shutil.which("find"):  # the documented by-hand check agrees
        sh = subprocess.run("find . -type f ! -name '*.ptx' -printf '%P\\n' | LC_ALL=C sort "
                            "| xargs -d '\\n' sha256sum | sha256sum", shell=True, cwd=d.parent,
                            capture_output=True, text=True, check=True)
        assert sh.stdout.split()[0] == recs[0].hash


def test_signature_required_parameter_added(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def __init__(self, activation, tile_m=TILE_M):",
          "def __init__(self, activation, num_warps, tile_m=TILE_M):")
    record(capsys, root)  # isolate the signature finding from the (expected) hash finding
    rc, out = run_audit(capsys, root)
    assert rc == 1
    assert out == [f"kernel_src/sm90/toy/src/{pkg}/kernel.py:7: signature of {pkg}.kernel:ToyKernel.__init__: "
                   "required parameter added: expected only parameters the shim passes (activation, tile_m) "
                   "to be required; found new required 'num_warps': (activation, num_warps, tile_m=…)"]


def test_signature_parameter_removed(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def __call__(self, a, b, out, stream=None):", "def __call__(self, a, b, stream=None):")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1, out
    assert out[0].startswith(f"kernel_src/sm90/toy/src/{pkg}/kernel.py:10: signature of {pkg}.kernel:"
                             "ToyKernel.__call__: parameter removed: expected parameter 'out'")


def test_signature_parameter_renamed(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def launch(kernel, a, b):", "def launch(kern, a, b):")
    _edit(d / "kernel.py", "return kernel(a, b, None)", "return kern(a, b, None)")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1, out
    assert out[0] == (f"kernel_src/sm90/toy/src/{pkg}/kernel.py:18: signature of {pkg}.kernel:launch: "
                      "parameter renamed: expected parameter 'kernel' (the shim passes it); "
                      "found no 'kernel' but a new required 'kern': (kern, a, b)")


def test_signature_reordered_and_callable_gone(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def __call__(self, a, b, out, stream=None):", "def __call__(self, b, a, out, stream=None):")
    _edit(d / "kernel.py", "def launch(kernel, a, b):", "def launch_v2(kernel, a, b):")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 2, out
    assert _only(out, "ToyKernel.__call__: parameters reordered: expected order (a, b, out); found order (b, a, out)")
    gone = _only(out, f"callable the shim uses is gone ({pkg}.kernel:launch)")
    assert gone and gone[0].startswith(f"kernel_src/sm90/toy/src/{pkg}/kernel.py: ")
    assert "found no attribute 'launch'" in gone[0]


def test_constant_drift(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "constants.py", "ACTIVATIONS = ('identity', 'swiglu')", "ACTIVATIONS = ('identity',)")
    _edit(d / "constants.py", "TILE_M = 128", "TILE_M = 64")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1
    f = f"kernel_src/sm90/toy/src/{pkg}/constants.py"
    assert sorted(out) == sorted([
        f"{f}:1: mirrored constant drifted ({pkg}.constants.TILE_M): expected 128 (mirrored by the shim); found 64",
        f"{f}:2: mirrored constant drifted ({pkg}.constants.ACTIVATIONS): "
        "expected ('identity', 'swiglu') (mirrored by the shim); found ('identity',)",
    ])


def test_unrecorded_edit_names_changed_added_removed_files(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def helper(x):", "def helper(x):  # local hotfix")
    _write(d, "notes.txt", "new\n")
    _write(d, "__pycache__/kernel.cpython-311.pyc", "junk")  # junk never counts
    rc, out = run_audit(capsys, root)
    assert rc == 1
    src = "kernel_src/sm90/toy/src"
    assert out[0].startswith(f"{src}: content hash differs from VENDOR.md (unrecorded edit): expected sha256:")
    assert "(4 files: 1 changed, 1 added, 0 removed)" in out[0]
    assert _only(out, f"{src}/{pkg}/kernel.py: file changed since VENDOR.md: expected sha256 ")
    assert _only(out, f"{src}/{pkg}/notes.txt: file added since VENDOR.md")
    assert len(out) == 3, out
    (d / "notes.txt").unlink()
    (d / "constants.py").rename(d / "consts.py")
    rc, out = run_audit(capsys, root)
    assert _only(out, f"{src}/{pkg}/constants.py: file removed since VENDOR.md")
    assert _only(out, f"{src}/{pkg}/consts.py: file added since VENDOR.md")[0].endswith(
        f"same content as removed {pkg}/constants.py: moved?)")


def test_unrecorded_new_drop_and_missing_recorded_drop(checkout, capsys):
    root, pkg, d = checkout
    _write(root, f"kernel_src/sm100/fresh/src/fresh_{pkg}/__init__.py", "X = 1\n")
    vendor = root / "VENDOR.md"
    vendor.write_text(vendor.read_text() + "\n## sm90/gone\n\n```vendor-record\ndrop: sm90/gone\n"
                      f"hash: sha256:{'0' * 64}\nfile-count: 0\nfiles:\n```\n")
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 2, out
    assert out[0].startswith("kernel_src/sm100/fresh/src: unrecorded drop: expected a vendor-record block for "
                             "sm100/fresh in VENDOR.md; found a drop on disk (1 files, sha256:")
    assert out[1].startswith("kernel_src/sm90/gone/src: recorded drop missing: expected the drop VENDOR.md records")


@pytest.mark.parametrize("rel,text,rule", [
    ("shim/bad.py", "from moe_ep.backends import x\n", "upward-import"),
    ("backends/bad.py", "import {pkg}.kernel\n", "drop-import-outside-shim"),
    ("api/bad.py", "from moe_ep.shim import drop_contracts\n", "shim-from-api"),
])
def test_layer_violation(checkout, capsys, rel, text, rule):
    root, pkg, d = checkout
    _write(root, rel, "\n" + text.format(pkg=pkg))
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1, out
    assert out[0].startswith(f"{rel}:2: layer rule broken [{rule}]: expected ")


def test_top_level_name_collision(checkout, capsys):
    root, pkg, d = checkout
    _write(root, f"kernel_src/sm100/toy2/src/{pkg}/__init__.py", "X = 2\n")
    _write(root, "kernel_src/sm100/toy3/src/json/__init__.py", "X = 3\n")  # shadows the stdlib
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1
    assert _only(out, f"kernel_src/sm90/toy/src/{pkg}: top-level name collision between drops: expected a top-level "
                      f"name no other drop uses ('{pkg}'); found '{pkg}' also provided by kernel_src/sm100/toy2/src")
    assert _only(out, "kernel_src/sm100/toy3/src/json: top-level name collides with an installed module")
    # knock-on: with two trees providing the name, the layer check sees one drop importing the other
    assert not [ln for ln in out if "collision" not in ln and "collides" not in ln and "drop-imports-drop" not in ln]


def test_vanished_symbol_and_module(checkout, capsys):
    root, pkg, d = checkout
    _edit(d / "kernel.py", "def helper(x):", "def helper_v2(x):")
    (d / "constants.py").rename(d / "consts.py")
    _edit(d / "__init__.py", "from .constants import", "from .consts import")
    _edit(d / "kernel.py", "from .constants import", "from .consts import")
    record(capsys, root)
    rc, out = run_audit(capsys, root, "--imports")
    assert rc == 1
    src = f"kernel_src/sm90/toy/src/{pkg}"
    assert f"  shim/drops/toy.py:22  import {pkg}.constants  ->  MISSING" in out
    assert _only(out, f"shim/drops/toy.py:22: shim import names a module the drop no longer has: expected module "
                      f"'{pkg}.constants' at {src}/constants.py or {src}/constants/__init__.py; found no such file")
    assert _only(out, f"shim/drops/toy.py:23: shim import names a symbol the drop no longer has: expected 'helper' "
                      f"defined at top level of {src}/kernel.py; found no such name")
    assert _only(out, f"{src}/constants.py: mirrored constants cannot be checked: expected module {pkg}.constants "
                      "the shim mirrors constants from to import; found module missing")


def test_declared_import_gone(checkout, capsys):
    root, pkg, d = checkout
    _edit(root / "shim/drops/toy.py", 'ImportUse("{0}.kernel", "ToyKernel"'.format(pkg),
          'ImportUse("{0}.kernel", "ToyKernel", "shim/drops/toy.py"), ImportUse("{0}.kernel", "Gone"'.format(pkg))
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1, out
    assert out[0] == (f"kernel_src/sm90/toy/src/{pkg}/kernel.py: shim import gone (from {pkg}.kernel import Gone, "
                      f"used by shim/drops/toy.py): expected module '{pkg}.kernel' defining 'Gone'; found symbol missing")


def test_broken_contracts_are_a_finding(checkout, capsys):
    root, pkg, d = checkout
    _write(root, "shim/drops/__init__.py", "def drop_contracts(:\n")
    rc, out = run_audit(capsys, root)
    assert rc == 1
    assert _only(out, "shim/drops/__init__.py: cannot load the shim's drop contracts")
    assert _only(out, "shim/drops/__init__.py:1: layer rule broken [syntax]")


def test_real_repository_audit_clean():
    """The repository's own drops, VENDOR.md and shim agree: ``python -m moe_ep.shim.audit`` exits 0.

    This fails with "unrecorded drop" / "content hash differs" whenever a drop under kernel_src/
    has no (or an out-of-date) VENDOR.md record: record it with
    ``python -m moe_ep.shim.audit --print-record`` (SKILL.md, step 4). Never weaken this test.
    """
    p = subprocess.run([sys.executable, "-m", "moe_ep.shim.audit"], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().splitlines()[-1].startswith("moe-ep audit: clean")


# --------------------------------------------------------------------------- the seam (AttributeUse, string loads)

SEAM = '''

import importlib


def _load(module):
    CONTRACT.activate()
    return importlib.import_module(module)


class Runner:
    def __init__(self):
        k = self._k = _load("{pkg}.kernel")
        self.kern = k.ToyKernel("identity")

    def tile(self):
        return self.kern.tile_m, self._k.helper


def version():
    return _load("{pkg}").VERSION
'''

SEAM_ATTRS = '''    attributes=(
        AttributeUse("{pkg}.kernel", ("ToyKernel", "helper")),
        AttributeUse("{pkg}.kernel:ToyKernel", ("activation", "tile_m", "__call__")),
        AttributeUse("{pkg}", ("VERSION",)),
    ),
    consumers=("shim/drops/toy.py",),'''


@pytest.fixture
def seam(checkout):
    """The toy checkout whose shim also loads drop modules by name and declares what it reads."""
    root, pkg, d = checkout
    toy = root / "shim/drops/toy.py"
    _edit(toy, "import CallableUse, DropContract, ImportUse",
          "import AttributeUse, CallableUse, DropContract, ImportUse")
    _edit(toy, '    consumers=("shim/drops/toy.py",),', SEAM_ATTRS.format(pkg=pkg))
    toy.write_text(toy.read_text() + SEAM.format(pkg=pkg))
    return root, pkg, d, toy


def _line(path: Path, needle: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if needle in ln)


def _drop_versions(markdown: str) -> dict[str, str]:
    """{"arch/drop": version} from the ``## arch/drop`` sections' "- drop version:" bullets."""
    out, drop = {}, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            drop = line[3:].strip()
        elif line.startswith("- drop version:") and drop and "/" in drop:
            out[drop] = line.split(":", 1)[1].strip()
    return out


def test_real_repository_contract_versions_match_vendor_md():
    """Each contract's version (what ``--print-record`` writes) is the drop's mirrored DROP_VERSION
    and VENDOR.md's "drop version" bullet (a contract once said 36 while the drop was at 70)."""
    p = subprocess.run([sys.executable, "-m", "moe_ep.shim.audit", "--print-record"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    printed = _drop_versions(p.stdout)
    recorded = _drop_versions((REPO / "VENDOR.md").read_text())
    assert printed and set(printed) <= set(recorded), (printed, recorded)
    assert {d: recorded[d] for d in printed} == printed
    from moe_ep.shim.drops import sm90_megamoe

    assert sm90_megamoe.CONTRACT.version == sm90_megamoe.CONSTANTS.value("sm90_megamoe", "DROP_VERSION")


def test_attribute_use_declaration():
    from moe_ep.shim.contract import AttributeUse, DropContract

    u = AttributeUse("pkg.mod:Cls", ["a", "b"])
    assert u.attrs == ("a", "b") and u.module == "pkg.mod" and u.qualname == "Cls"
    m = AttributeUse("pkg.mod", "KINDS")  # a bare string is one name, not its letters
    assert m.attrs == ("KINDS",) and m.qualname is None
    assert DropContract.__dataclass_fields__["attributes"].default == ()


def test_seam_clean_and_imports_table_lists_string_loads(seam, capsys):
    root, pkg, d, toy = seam
    rc, out = run_audit(capsys, root, "--imports")
    assert rc == 0, out
    assert "6 declared attribute(s)" in out[-1] and "2 string load(s)" in out[-1], out[-1]
    src = f"kernel_src/sm90/toy/src/{pkg}"
    table = "\n".join(out)
    assert (f'shim/drops/toy.py:{_line(toy, "k = self._k")}  _load("{pkg}.kernel")  ->  {src}/kernel.py  '
            "(reads ToyKernel, ToyKernel().tile_m, helper)") in table
    assert f'_load("{pkg}")  ->  {src}/__init__.py  (reads VERSION)' in table


def test_seam_renamed_instance_attribute(seam, capsys):
    root, pkg, d, toy = seam
    _edit(d / "kernel.py", "self.activation, self.tile_m = activation, tile_m",
          "self.activation, self.tile_rows = activation, tile_m")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1
    assert out == [f"kernel_src/sm90/toy/src/{pkg}/kernel.py:6: missing attribute: ToyKernel.tile_m read by the shim: "
                   "expected 'tile_m' assigned as self.tile_m in a method of ToyKernel (or of a base class in the "
                   "drop), or a class-level field, method or property; found no such attribute (similar: tile_rows)"]


def test_seam_instance_attribute_from_a_base_class_and_dataclass_field(seam, capsys):
    root, pkg, d, toy = seam
    _write(d, "base.py", "from dataclasses import dataclass\n\n\n@dataclass\nclass Base:\n    tile_m: int = 128\n")
    _edit(d / "kernel.py", "class ToyKernel:", "from .base import Base\n\n\nclass ToyKernel(Base):")
    _edit(d / "kernel.py", "self.activation, self.tile_m = activation, tile_m", "self.activation = activation")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 0, out  # tile_m: a dataclass field of a base class defined in the drop
    _edit(d / "base.py", "tile_m: int = 128", "tile_n: int = 128")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1 and "missing attribute: ToyKernel.tile_m read by the shim" in out[0], out


def test_seam_module_name_removed(seam, capsys):
    root, pkg, d, toy = seam
    _edit(d / "__init__.py", "VERSION = 3", "DROP_VERSION = 3")
    _edit(d / "kernel.py", "def helper(x):", "def helper_v2(x):")
    record(capsys, root)
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 3, out
    src = f"kernel_src/sm90/toy/src/{pkg}"
    assert f"{src}/__init__.py: missing attribute: {pkg}.VERSION read by the shim: expected 'VERSION' bound at " \
           f"top level of {pkg} (assigned, imported or defined); found no such name (similar: DROP_VERSION)" in out
    assert f"{src}/kernel.py: missing attribute: {pkg}.kernel.helper read by the shim: expected 'helper' bound at " \
           f"top level of {pkg}.kernel (assigned, imported or defined); found no such name (similar: helper_v2)" in out
    assert _only(out, "shim import names a symbol the drop no longer has: expected 'helper'")  # the static import


def test_seam_undeclared_reads(seam, capsys):
    root, pkg, d, toy = seam
    toy.write_text(toy.read_text() + f'''

def launch_it(a, b):
    kmod = _load("{pkg}.kernel")
    return kmod.launch(kmod.ToyKernel("identity"), a, b), kmod.ToyKernel("swiglu").activation_v2
''')
    rc, out = run_audit(capsys, root)
    assert rc == 1
    n = _line(toy, "return kmod.launch")
    assert sorted(out) == sorted([
        f"shim/drops/toy.py:{n}: undeclared drop attribute read by the shim ({pkg}.kernel.launch): expected "
        f"'launch' listed in an AttributeUse('{pkg}.kernel', ...) of the drop's DropContract; found not declared",
        f"shim/drops/toy.py:{n}: undeclared drop attribute read by the shim (ToyKernel.activation_v2): expected "
        f"'activation_v2' listed in an AttributeUse('{pkg}.kernel:ToyKernel', ...) of the drop's DropContract; "
        "found not declared; and no such attribute on class ToyKernel "
        f"(kernel_src/sm90/toy/src/{pkg}/kernel.py:6) (similar: activation)",
    ])


def test_seam_string_load_of_a_missing_module(seam, capsys):
    root, pkg, d, toy = seam
    toy.write_text(toy.read_text() + f'''

def gone():
    return _load("{pkg}.gone"), importlib.import_module("{pkg}.also_gone"), _load("nodrop_{pkg}.x")
''')
    rc, out = run_audit(capsys, root, "--imports")
    assert rc == 1
    n, src = _line(toy, "def gone") + 1, f"kernel_src/sm90/toy/src/{pkg}"
    assert f'  shim/drops/toy.py:{n}  _load("{pkg}.gone")  ->  MISSING' in out
    assert f'  shim/drops/toy.py:{n}  importlib.import_module("{pkg}.also_gone")  ->  MISSING' in out
    found = [ln for ln in out if ln.startswith("shim/drops/toy.py:")]
    assert sorted(found) == sorted([
        f"shim/drops/toy.py:{n}: shim string load names a module the drop no longer has: expected module "
        f"'{pkg}.gone' at {src}/gone.py or {src}/gone/__init__.py; found no such file",
        f"shim/drops/toy.py:{n}: shim string load names a module the drop no longer has: expected module "
        f"'{pkg}.also_gone' at {src}/also_gone.py or {src}/also_gone/__init__.py; found no such file",
        f"shim/drops/toy.py:{n}: shim string load names no drop's module (_load): expected a module of a drop "
        f"under kernel_src/*/*/src (top-level names: {pkg}); found 'nodrop_{pkg}.x': no drop provides 'nodrop_{pkg}'",
    ])


def test_seam_declared_class_gone(seam, capsys):
    root, pkg, d, toy = seam
    _edit(root / "shim/drops/toy.py", f'AttributeUse("{pkg}", ("VERSION",)),',
          f'AttributeUse("{pkg}", ("VERSION",)), AttributeUse("{pkg}.kernel:ToyKernal", ("tile_m",)),')
    rc, out = run_audit(capsys, root)
    assert rc == 1 and len(out) == 1, out
    assert out[0] == (f"kernel_src/sm90/toy/src/{pkg}/kernel.py: class the shim reads attributes from is gone "
                      f"({pkg}.kernel:ToyKernal): expected class ToyKernal defined in (or imported into) {pkg}.kernel "
                      "(the shim reads tile_m); found no such name (similar: ToyKernel)")


# the real SM90 drop, copied: its contract's declared seam against mutated sources (no probe, no imports)


@pytest.fixture
def sm90_copy(tmp_path):
    from moe_ep.shim.drops.sm90_megamoe import CONTRACT

    root = tmp_path / "sm90_checkout"
    shutil.copytree(REPO / "kernel_src/sm90/megamoe/src", root / "kernel_src/sm90/megamoe/src",
                    ignore=shutil.ignore_patterns("__pycache__"))
    _write(root, "shim/drops/sm90_megamoe.py", (REPO / "shim/drops/sm90_megamoe.py").read_text())
    src = root / "kernel_src/sm90/megamoe/src"
    contracts = [{"key": CONTRACT.key, "src": str(src), "src_exists": True,
                  "attributes": [{"target": u.target, "attrs": list(u.attrs)} for u in CONTRACT.attributes]}]
    return root.resolve(), src / "sm90_megamoe", contracts


def _seam_findings(root: Path, contracts: list[dict]) -> list[str]:
    from moe_ep.shim import audit_seam

    owners = audit.drop_owners(root)
    rows, reads, bad = audit_seam.scan_string_loads(root, owners)
    assert rows and reads
    return [str(f) for f in bad + audit_seam.check_attributes(root, contracts)
            + audit_seam.check_reads(root, owners, reads, contracts)]


def test_sm90_seam_declared_and_clean(sm90_copy):
    root, pkg, contracts = sm90_copy
    assert _seam_findings(root, contracts) == []
    declared = {(u["target"], a) for u in contracts[0]["attributes"] for a in u["attrs"]}
    for want in [("sm90_megamoe.launch:CompiledGroupedGemm", "n_out"), ("sm90_megamoe.launch:CompiledGroupedGemm",
                                                                        "schedule"),
                 ("sm90_megamoe.ep_launch:EpRank", "read_err"), ("sm90_megamoe.ep_launch:EpBuffers", "recv_x"),
                 ("sm90_megamoe.ep_launch", "KINDS"), ("sm90_megamoe.layout_launch", "KINDS")]:
        assert want in declared, want


def test_sm90_seam_renamed_field_and_module_name(sm90_copy):
    root, pkg, contracts = sm90_copy
    _edit(pkg / "launch.py", "self.n_out, self.n_tiles =", "self.n_cols, self.n_tiles =")
    _edit(pkg / "ep_launch.py", "    def read_err(self", "    def read_error(self")
    _edit(pkg / "ep_launch.py", "\nKINDS = (", "\nEP_KINDS = (")
    out = _seam_findings(root, contracts)
    src = "kernel_src/sm90/megamoe/src/sm90_megamoe"
    assert _only(out, f"{src}/launch.py:{_line(pkg / 'launch.py', 'class CompiledGroupedGemm')}: missing attribute: "
                      "CompiledGroupedGemm.n_out read by the shim: expected 'n_out' assigned as self.n_out")
    assert _only(out, f"{src}/ep_launch.py:{_line(pkg / 'ep_launch.py', 'class EpRank')}: missing attribute: "
                      "EpRank.read_err read by the shim")
    assert _only(out, f"{src}/ep_launch.py: missing attribute: sm90_megamoe.ep_launch.KINDS read by the shim: "
                      "expected 'KINDS' bound at top level of sm90_megamoe.ep_launch")
    assert len(out) == 3, out  # the shim's reads are declared: each rename is reported once, at the drop


def test_real_repository_seam_clean_for_sm90():
    """This repository's shim reads only declared, existing attributes of the SM90 drop (other
    drops still being integrated may have findings of their own)."""
    from moe_ep.shim import audit_seam

    facts = audit.run_probe(REPO)
    assert not facts["error"], facts["error"]
    contracts = [c for c in facts["contracts"] if "fatal" not in c]
    assert any(c["key"] == "sm90/megamoe" and c["attributes"] for c in contracts)
    owners = audit.drop_owners(REPO)
    rows, reads, bad = audit_seam.scan_string_loads(REPO, owners)
    found = bad + audit_seam.check_attributes(REPO, contracts) + audit_seam.check_reads(REPO, owners, reads, contracts)
    assert [str(f) for f in found if "sm90" in f.file] == []
    # the BF16 shim module and its EP part (split off for file length)
    loads = {(r.module, r.names) for r in rows
             if r.shim_file in ("shim/drops/sm90_megamoe.py", "shim/drops/sm90_megamoe_ep.py")}
    assert any(m == "sm90_megamoe.ep_launch" and "EpRank().read_err" in names for m, names in loads), loads
    assert any(m == "sm90_megamoe.launch" and "CompiledGroupedGemm().compiled" in names for m, names in loads)
