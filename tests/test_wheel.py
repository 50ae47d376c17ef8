"""A built wheel carries every drop source byte-identical, and no tests."""

import hashlib
import shutil
import subprocess
import sys
import zipfile

import pytest


@pytest.mark.slow
def test_wheel_contents(repo_root, tmp_path):
    # build from a copy: setuptools writes build/ and *.egg-info/ next to the sources it builds
    src = tmp_path / "src"
    shutil.copytree(repo_root, src, ignore=shutil.ignore_patterns(
        ".git", ".device", ".whl", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
        ".hypothesis", ".benchmarks"))
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    wheels = list(tmp_path.glob("moe_ep-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as z:
        names = set(z.namelist())
        tracked = subprocess.run(["git", "ls-files", "kernel_src"], cwd=repo_root, capture_output=True, text=True)
        if tracked.returncode == 0 and tracked.stdout.strip():  # what a clean clone has
            drop_files = [repo_root / f for f in tracked.stdout.split() if "/src/" in f]
        else:
            drop_files = [f for f in (repo_root / "kernel_src").glob("*/*/src/**/*")
                          if f.is_file() and "__pycache__" not in f.parts and f.suffix in (".py", ".md", ".json", ".txt")]
        assert len(drop_files) >= 3 * 3, drop_files  # three drops, each with more than a couple of files
        for f in drop_files:
            arc = "moe_ep/" + f.relative_to(repo_root).as_posix()
            assert arc in names, f"{arc} missing from the wheel"
            assert hashlib.sha256(z.read(arc)).digest() == hashlib.sha256(f.read_bytes()).digest(), arc
        for must in ("moe_ep/__init__.py", "moe_ep/api/__init__.py", "moe_ep/backends/reference/backend.py",
                     "moe_ep/shim/layering.py", "moe_ep/bench/__main__.py", "moe_ep/kernel_src/__init__.py"):
            assert must in names
        assert not [n for n in names if n.startswith(("tests/", "moe_ep/tests/"))]
        assert not [n for n in names if n.endswith(".pyc")]
        assert not [n for n in names if not n.startswith(("moe_ep/", "moe_ep-"))], "stray top-level names"


def test_every_python_package_is_listed_in_pyproject(repo_root):
    """setuptools installs only the packages pyproject names: a new folder (e.g. a new backend)
    that is not listed works in an editable checkout and is missing from a real install."""
    import tomllib

    listed = set(tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = ("tests", ".device", "build", "dist", ".git", "docs", ".ci")
    found = {"moe_ep"}
    for init in repo_root.rglob("__init__.py"):
        rel = init.parent.relative_to(repo_root)
        if not rel.parts or rel.parts[0] in skip or "src" in rel.parts or "__pycache__" in rel.parts \
                or any(p.endswith(".egg-info") for p in rel.parts):
            continue
        found.add("moe_ep." + ".".join(rel.parts))
    assert found - listed == set(), f"packages missing from pyproject.toml [tool.setuptools] packages: {found - listed}"
