"""docs/SWITCHES.md lists every environment variable moe_ep reads: each ``MOE_EP_*`` (and NVSHMEM /
SM90 drop) name that appears as a string in the package's own code (shim, backends, api, bench,
integrations, the SM90 drop's PDL switch) appears in the table, and the table names none that the
code no longer reads."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"^(MOE_EP|NVSHMEM|SM90_MEGAMOE|NCCL|TORCH_SYMM_MEM)_[A-Z0-9_]+$")


def _names_in_code() -> set:
    found = set()
    files = [p for d in ("shim", "backends", "api", "bench", "integrations") for p in (ROOT / d).rglob("*.py")]
    files.append(ROOT / "kernel_src/sm90/megamoe/src/sm90_megamoe/pdl.py")
    for path in files:
        tree = ast.parse(path.read_text())
        exported = set()
        for node in ast.walk(tree):  # names in __all__ are Python names, not variables
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                exported |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
        found |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.match(n.value)} - exported
    return found


def test_every_variable_read_is_in_the_table():
    doc = (ROOT / "docs/SWITCHES.md").read_text()
    in_doc = set(re.findall(r"`((?:MOE_EP|NVSHMEM|SM90_MEGAMOE|NCCL|TORCH_SYMM_MEM)_[A-Z0-9_]+)`", doc))
    code = _names_in_code()
    assert "MOE_EP_FP8_OVERLAP" in code and "MOE_EP_CACHE_DIR" in code  # the scan sees them
    assert code - in_doc == set(), f"read but not in docs/SWITCHES.md: {sorted(code - in_doc)}"
    assert in_doc - code == set(), f"in docs/SWITCHES.md but never read: {sorted(in_doc - code)}"
