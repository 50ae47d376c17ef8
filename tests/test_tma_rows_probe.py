"""Drop v40's probe (``sm90_megamoe.tma_rows_probe``): whether 128 one-row TMA loads build the
swizzled A tile one tile load builds -- the premise of a grouped GEMM producer that gathers rows
by index with TMA. Here (CPU): it compiles for sm_90a to 2-D TMA loads (the tile's and the rows',
each row's aimed at ``base + 128 r`` with its own source row), and the host-side image of the
128-byte swizzle it compares against agrees with an independent per-byte formula. On the H200 the
probe itself runs (``python -m sm90_megamoe.tma_rows_probe``, ``bench/h200_session.sh verify``):
what it answers is a property of the hardware, reported, not asserted by the suite."""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from moe_ep.shim import drop_src, register_drop  # noqa: E402

register_drop(drop_src("sm90", "megamoe"))

from sm90_megamoe import tma_rows_probe as probe  # noqa: E402


def test_probe_compiles_to_tile_and_row_tma_loads():
    ptx = probe.compile_probe().__ptx__
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor.2d" in ln]
    assert loads and all(".global" in ln and "mbarrier::complete_tx::bytes" in ln for ln in loads)
    # the row loads' destinations step by 128 bytes (the unrolled loop: +128, +256, ...)
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\S* \[%r\d+\+128\]", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_swizzled_image_matches_per_byte_formula():
    g = torch.Generator().manual_seed(3)
    tile = torch.randint(0, 256, (probe.ROWS, probe.ROW_BYTES), dtype=torch.uint8, generator=g)
    img = probe.swizzled_image(tile)
    want = torch.empty(probe.ROWS * probe.ROW_BYTES, dtype=torch.uint8)
    for r in range(probe.ROWS):
        for c in range(probe.ROW_BYTES):
            # Swizzle<3,4,3> on the byte offset r * 128 + c: bits 4-6 ^= bits 7-9
            off = r * 128 + c
            want[off ^ (((off >> 7) & 7) << 4)] = tile[r, c]
    assert torch.equal(img, want)
    assert not torch.equal(img, tile.flatten())  # the swizzle moves bytes (rows 1.. are permuted)
