"""docs/SWITCHES.md lists every environment variable moe_ep reads: each ``MOE_EP_*`` (and NVSHMEM /
SM90 drop / NCCL / torch) name that appears as a string in the package's own code (every module
outside tests/: shim, backends, api, bench, integrations, aot, the package ``__init__``, every drop)
or in its shell scripts (bench/*.sh, .ci/) is documented -- in the first cell of a table row, or in
the "benchmarks only" section -- and the documentation names none that the code no longer reads."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = r"(?:MOE_EP|NVSHMEM|SM90_MEGAMOE|NCCL|TORCH_SYMM_MEM)_[A-Z0-9_]+"
NAME = re.compile(rf"^{PREFIX}$")


def _python_files() -> list:
    files = [p for d in ("shim", "backends", "api", "bench", "integrations", "aot") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "__init__.py", *(ROOT / "kernel_src").rglob("*.py")]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def _names_in_code() -> set:
    found = set()
    for path in _python_files():
        tree = ast.parse(path.read_text())
        exported = set()
        for node in ast.walk(tree):  # names in __all__ are Python names, not variables
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                exported |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
        found |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAME.match(n.value)} - exported
    return found


def _names_in_scripts() -> set:
    scripts = [*(ROOT / "bench").rglob("*.sh"), *(p for p in (ROOT / ".ci").rglob("*") if p.is_file())]
    return {n for p in scripts for n in re.findall(rf"\b({PREFIX})\b", p.read_text(errors="replace"))}


def _documented(doc: str) -> set:
    """Names in the first cell of a table row, and in the section on the benchmarks' own variables."""
    names = set()
    for line in doc.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            names |= set(re.findall(rf"`({PREFIX})`", cells[1]))
    bench = doc.split("## The benchmarks only", 1)
    assert len(bench) == 2, "docs/SWITCHES.md lost its '## The benchmarks only' section"
    names |= set(re.findall(rf"`({PREFIX})`", bench[1].split("\n## ", 1)[0]))
    return names


def test_every_variable_read_is_in_the_table():
    in_doc = _documented((ROOT / "docs/SWITCHES.md").read_text())
    code = _names_in_code()
    assert {"MOE_EP_FP8_OVERLAP", "MOE_EP_CACHE_DIR", "SM90_MEGAMOE_PDL"} <= code  # the scan sees them
    assert code - in_doc == set(), f"read but not in docs/SWITCHES.md: {sorted(code - in_doc)}"
    assert in_doc - code == set(), f"in docs/SWITCHES.md but never read: {sorted(in_doc - code)}"
    scripts = _names_in_scripts()
    assert scripts - in_doc == set(), f"used by a script but not in docs/SWITCHES.md: {sorted(scripts - in_doc)}"


def test_a_name_mentioned_in_passing_is_not_documented():
    doc = "| `MOE_EP_A` | 0, 1 | see also `MOE_EP_B` |\n\n## The benchmarks only\n\n`MOE_EP_C` (a file)\n\n## Next\n`MOE_EP_D`"
    assert _documented(doc) == {"MOE_EP_A", "MOE_EP_C"}
