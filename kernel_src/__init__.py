"""Vendored kernel drops: ``kernel_src/<arch>/<drop>/src/<package>``.

Each drop is a standalone CuTeDSL package with a unique top-level name. It is imported by that
name after :mod:`moe_ep.shim` puts its ``src/`` folder on ``sys.path``; nothing here is a
``moe_ep.*`` module, and nothing under ``src/`` may import ``moe_ep``. Drops are verbatim: see
VENDOR.md and SKILL.md.
"""

from pathlib import Path

#: Folder holding ``<arch>/<drop>/src`` trees (inside the wheel too).
ROOT = Path(__file__).resolve().parent
