"""The import rules, enforced by parsing every module (moe_ep.shim.layering)."""

import textwrap

from moe_ep.shim.layering import check_layers


def test_repository_obeys_layer_rules(repo_root):
    bad = check_layers(repo_root)
    assert not bad, "layer-rule violations:\n" + "\n".join(map(str, bad))


def _tree(tmp_path, files):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return tmp_path


BASE = {
    "__init__.py": "",
    "api/__init__.py": "from ..backends import get\n",
    "backends/__init__.py": "from moe_ep.shim import COMPILE_CACHE\n",
    "shim/__init__.py": "from .cache import COMPILE_CACHE\n__all__ = ['COMPILE_CACHE']\n",
    "shim/cache.py": "COMPILE_CACHE = {}\n",
    "shim/drops/d.py": "import dropk.kernel\n",
    "kernel_src/sm90/d/src/dropk/__init__.py": "from . import kernel\n",
    "kernel_src/sm90/d/src/dropk/kernel.py": "import math\nfrom dropk import kernel\n",
}


def test_clean_synthetic_tree(tmp_path):
    assert check_layers(_tree(tmp_path, BASE)) == []


def _violations(tmp_path, extra):
    files = dict(BASE)
    files.update(extra)
    return check_layers(_tree(tmp_path, files))


def test_drop_importing_moe_ep(tmp_path):
    v = _violations(tmp_path, {"kernel_src/sm90/d/src/dropk/kernel.py": "import os\nfrom moe_ep.shim import x\n"})
    assert [(x.file, x.line, x.rule) for x in v] == [("kernel_src/sm90/d/src/dropk/kernel.py", 2, "drop-imports-moe_ep")]


def test_backend_importing_drop(tmp_path):
    v = _violations(tmp_path, {"backends/x.py": "\n\nimport dropk\n"})
    assert [(x.file, x.line, x.rule) for x in v] == [("backends/x.py", 3, "drop-import-outside-shim")]


def test_api_importing_shim_and_drop(tmp_path):
    v = _violations(tmp_path, {"api/x.py": "from ..shim import cache\nfrom dropk.kernel import k\n"})
    rules = sorted((x.line, x.rule) for x in v)
    assert rules == [(1, "shim-from-api"), (2, "drop-import-outside-shim")]


def test_backend_importing_shim_internal(tmp_path):
    v = _violations(tmp_path, {"backends/y.py": "from moe_ep.shim.cache import COMPILE_CACHE\n"
                                                "from moe_ep.shim import cache\nimport moe_ep.shim.paths\n"})
    assert [(x.line, x.rule) for x in v] == [(1, "shim-internal"), (2, "shim-internal"), (3, "shim-internal")]
    assert "backends/y.py:1:" in str(v[0])


def test_upward_imports(tmp_path):
    v = _violations(tmp_path, {"shim/z.py": "from moe_ep.backends import get\n",
                               "backends/w.py": "from ..api import MoELayer\n"})
    assert sorted((x.file, x.rule) for x in v) == [("backends/w.py", "upward-import"), ("shim/z.py", "upward-import")]


def test_bench_must_not_touch_shim(tmp_path):
    v = _violations(tmp_path, {"bench/b.py": "from moe_ep import shim\n"})
    assert [(x.file, x.rule) for x in v] == [("bench/b.py", "shim-from-bench")]


def test_integrations_use_the_api_only(tmp_path):
    v = _violations(tmp_path, {"integrations/t.py": "from moe_ep.api import MoELayer\nfrom moe_ep.backends import get\n"
                                                     "from moe_ep import shim\n"})
    assert sorted((x.line, x.rule) for x in v) == [(2, "backends-from-integrations"), (3, "shim-from-integrations")]


def test_kernel_src_only_from_shim(tmp_path):
    v = _violations(tmp_path, {"backends/k.py": "from moe_ep import kernel_src\n",
                               "api/k.py": "import moe_ep.kernel_src.sm90\n"})
    assert sorted((x.file, x.rule) for x in v) == [("api/k.py", "kernel_src-outside-shim"),
                                                   ("backends/k.py", "kernel_src-outside-shim")]


def test_relative_imports_resolve_from_a_package_init(tmp_path):
    """``from ..shim.cache import X`` in ``backends/__init__.py`` is ``moe_ep.shim.cache`` (an internal), but
    the same line in ``backends/sub/__init__.py`` is ``moe_ep.backends.shim.cache`` (no rule applies)."""
    v = _violations(tmp_path, {"backends/__init__.py": "from ..shim.cache import COMPILE_CACHE\n",
                               "backends/sub/__init__.py": "from ..shim.cache import X\n"})
    assert [(x.file, x.line, x.rule) for x in v] == [("backends/__init__.py", 1, "shim-internal")]


def test_imports_by_a_literal_string(tmp_path):
    v = _violations(tmp_path, {
        "backends/s.py": "import importlib\nm = importlib.import_module('moe_ep.shim.cache')\n"
                         "d = importlib.import_module('dropk.kernel')\nname = 'x'\nimportlib.import_module(name)\n",
        "api/s.py": "s = __import__('moe_ep.shim')\n",
        "shim/s.py": "from importlib import import_module\nimport_module('dropk')\nimport_module('moe_ep.api')\n"})
    assert sorted((x.file, x.line, x.rule) for x in v) == [
        ("api/s.py", 1, "shim-from-api"), ("backends/s.py", 2, "shim-internal"),
        ("backends/s.py", 3, "drop-import-outside-shim"), ("shim/s.py", 3, "upward-import")]


def test_nothing_imports_the_downstream_code(tmp_path):
    v = _violations(tmp_path, {"shim/b.py": "from moe_ep import bench\n",
                               "backends/i.py": "from moe_ep.integrations import transformers\n",
                               "api/a.py": "from ..aot import build\n",
                               "bench/ok.py": "from moe_ep.integrations import transformers\nfrom moe_ep.api import x\n"})
    assert sorted((x.file, x.rule) for x in v) == [("api/a.py", "upward-import"), ("backends/i.py", "upward-import"),
                                                   ("shim/b.py", "upward-import")]


def test_nested_folders_named_like_skipped_ones_are_checked(tmp_path):
    """Only the top-level build/, tests/, docs/ ... are skipped: ``backends/build/x.py`` is package code."""
    v = _violations(tmp_path, {"backends/build/x.py": "import dropk\n", "tests/t.py": "import dropk\n",
                               "backends/__pycache__/y.py": "import dropk\n"})
    assert [(x.file, x.rule) for x in v] == [("backends/build/x.py", "drop-import-outside-shim")]
