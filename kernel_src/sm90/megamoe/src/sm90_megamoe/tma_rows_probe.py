"""Probe (drop v40, mended in v43; not a kernel of the layer): can a grouped GEMM's producer gather A rows by index
with TMA on SM90?

SM90 has no TMA gather, but a 2-D TMA load whose box is one row of 128 bytes (``tile_k`` e4m3
values, or 64 bf16) with the 128-byte swizzle can be aimed at row r of a stage's A tile (its
shared-memory address ``base + 128 r``). If the TMA unit swizzles by the destination address --
the pattern repeats every 1024 bytes, which is why swizzled tiles are 1024-byte aligned -- then
128 such loads of rows ``idx[r]`` write exactly the bytes one tile load of the gathered rows
writes, and FC1 could read the caller's tokens (or the tokens quantised once) where they are,
without LayoutPlace's row copy (BF16 Qwen3: ~115 us of a 1.26 ms forward) or the scattering
quantiser's T * top_k row writes (FP8). The cp.async producer of drops v22-v24 fed the WGMMAs
too slowly; one TMA per row costs one instruction per 128 bytes instead of eight 16-byte copies.

This file checks the premise on the GPU, on one CTA:
1. one tile load (box 128 x 128 bytes, the A smem layout the GEMMs use) of rows ``idx`` gathered
   beforehand equals the 128B-swizzled image of those rows (chunk c of row r at c ^ (r % 8)),
2. 128 row loads (box 1 x 128 bytes, the same swizzle, destination ``base + 128 r``, source row
   ``idx[r]``) equal the tile load byte for byte, for the identity and a random gather,
3. the cycles one warp spends per 16 KB: 128 row loads against one tile load (a latency-bound
   single-CTA number, not the throughput of 132 busy SMs).

    python -m sm90_megamoe.tma_rows_probe      # GPU: prints the checks, exit 1 if one fails
                                               # CPU: compiles for sm_90a only
"""

from __future__ import annotations

import sys

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from .grouped_gemm import LayoutEnum

ROWS = 128       # a tile's rows
ROW_BYTES = 128  # one k-tile of a row: 128 e4m3 (or 64 bf16) values, one swizzle row


def _row_layout():
    """One 128-byte row under the 128-byte swizzle (Swizzle<3,4,3> on byte offsets)."""
    return cute.make_composed_layout(cute.make_swizzle(3, 4, 3), 0,
                                     cute.make_layout((1, ROW_BYTES), stride=(ROW_BYTES, 1)))


class TmaRowsProbe:
    """``__call__(mA, mAg, mIdx, mOutTile, mOutRows, mCycles, col_tile, iters)``:

        mA        [T, K]          uint8   source rows (K % 128 == 0, 16-byte aligned)
        mAg       [128, K]        uint8   mA[idx], materialised (what the tile load reads)
        mIdx      [128]           int32   the gathered rows (< T)
        mOutTile  [128 * 128]     uint8   the tile load's shared-memory bytes
        mOutRows  [128 * 128]     uint8   the row loads' shared-memory bytes
        mCycles   [2]             int64   clock64 cycles of ``iters`` trips: row loads, tile loads
        col_tile  Int32           the k-tile (columns 128 col_tile ..) both load
    """

    @cute.jit
    def __call__(self, mA: cute.Tensor, mAg: cute.Tensor, mIdx: cute.Tensor, mOutTile: cute.Tensor,
                 mOutRows: cute.Tensor, mCycles: cute.Tensor, col_tile: Int32, iters: Int32):
        # the tile: the GEMMs' own A smem layout (K-major, 128-byte swizzle), one stage
        a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.from_tensor(mAg), (ROWS, ROWS, ROW_BYTES),
                                                 cutlass.Uint8, 1)
        a_one = cute.slice_(a_layout, (None, None, 0))
        tile_atom, mAg_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mAg, a_one,
                                                         (ROWS, ROW_BYTES))
        row_atom, mA_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, _row_layout(),
                                                       (1, ROW_BYTES))
        self.kernel(tile_atom, mAg_tma, row_atom, mA_tma, a_one, mIdx, mOutTile, mOutRows, mCycles, col_tile,
                    iters).launch(grid=(1, 1, 1), block=(ROWS, 1, 1))

    @cute.kernel
    def kernel(self, tile_atom: cute.CopyAtom, mAg_tma: cute.Tensor, row_atom: cute.CopyAtom, mA_tma: cute.Tensor,
               a_one: cute.ComposedLayout, mIdx: cute.Tensor, mOutTile: cute.Tensor, mOutRows: cute.Tensor,
               mCycles: cute.Tensor, col_tile: Int32, iters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        p_tile = cute.arch.alloc_smem(cutlass.Uint8, ROWS * ROW_BYTES, alignment=1024)
        p_rows = cute.arch.alloc_smem(cutlass.Uint8, ROWS * ROW_BYTES, alignment=1024)
        mbar = cute.arch.alloc_smem(cutlass.Int64, 1, alignment=8)
        if tidx == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # warp 0 issues the loads as a whole warp: CuTeDSL's TMA copy elects its lane with
        # elect.sync over the full warp, which one lone thread must not execute (v40 hung there)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, 2 * ROWS * ROW_BYTES)
            self._load_tile(tile_atom, mAg_tma, a_one, p_tile, col_tile, mbar)
            self._load_rows(row_atom, mA_tma, mIdx, p_rows, col_tile, mbar)
        cute.arch.mbarrier_wait(mbar, 0)
        s_tile = cute.make_tensor(p_tile, cute.make_layout(ROWS * ROW_BYTES))
        s_rows = cute.make_tensor(p_rows, cute.make_layout(ROWS * ROW_BYTES))
        for i in cutlass.range(ROW_BYTES, unroll=8):  # the raw bytes, thread t copies bytes 128 t ..
            mOutTile[tidx * ROW_BYTES + i] = s_tile[tidx * ROW_BYTES + i]
            mOutRows[tidx * ROW_BYTES + i] = s_rows[tidx * ROW_BYTES + i]
        cute.arch.sync_threads()
        if warp_idx == 0:  # one warp issues a stage's loads and waits for them, iters times each
            phase = Int32(1)
            t0 = cute.arch.clock64()
            for _ in cutlass.range(iters, unroll=1):
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, ROWS * ROW_BYTES)
                self._load_rows(row_atom, mA_tma, mIdx, p_rows, col_tile, mbar)
                cute.arch.mbarrier_wait(mbar, phase)
                phase = phase ^ 1
            t1 = cute.arch.clock64()
            for _ in cutlass.range(iters, unroll=1):
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, ROWS * ROW_BYTES)
                self._load_tile(tile_atom, mAg_tma, a_one, p_tile, col_tile, mbar)
                cute.arch.mbarrier_wait(mbar, phase)
                phase = phase ^ 1
            t2 = cute.arch.clock64()
            if tidx == 0:
                mCycles[0] = t1 - t0
                mCycles[1] = t2 - t1

    @cute.jit
    def _load_tile(self, atom, mAg_tma, a_one, p_tile, col_tile, mbar):
        """One TMA load of the 128 x 128-byte tile at k-tile ``col_tile`` of the gathered rows."""
        sA = cute.make_tensor(cute.recast_ptr(p_tile, a_one.inner, dtype=cutlass.Uint8), a_one.outer)
        gA = cute.local_tile(mAg_tma, (ROWS, ROW_BYTES), (0, col_tile))
        tAs, tAg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                                         cute.group_modes(gA, 0, 2))
        cute.copy(atom, tAg, tAs, tma_bar_ptr=mbar)

    @cute.jit
    def _load_rows(self, atom, mA_tma, mIdx, p_rows, col_tile, mbar):
        """128 TMA loads of one row each: source row ``mIdx[r]`` to destination ``base + 128 r``."""
        for r in cutlass.range(ROWS, unroll=4):
            sR = cute.make_tensor(p_rows + r * ROW_BYTES, _row_layout())
            gR = cute.local_tile(mA_tma, (1, ROW_BYTES), (mIdx[r], col_tile))
            tRs, tRg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sR, 0, 2),
                                             cute.group_modes(gR, 0, 2))
            cute.copy(atom, tRg, tRs, tma_bar_ptr=mbar)


def swizzled_image(tile):
    """The 128B-swizzled bytes of a [128, 128] uint8 tile (torch): 16-byte chunk c of row r at chunk
    c ^ (r % 8) of the row -- the K-major 128B-swizzle layout WGMMA reads."""
    import torch

    chunks = tile.reshape(ROWS, ROW_BYTES // 16, 16)
    r = torch.arange(ROWS).unsqueeze(1)
    dest = torch.arange(ROW_BYTES // 16).unsqueeze(0) ^ (r % 8)
    out = torch.empty_like(chunks)
    out[r, dest] = chunks
    return out.reshape(-1)


def compile_probe(arch: str = "sm_90a", device: str = "cpu"):
    """The probe compiled for ``arch`` on tensors of the probe's shapes (no GPU needed on CPU)."""
    import torch
    from cutlass.cute.runtime import from_dlpack

    a = torch.zeros(512, 256, dtype=torch.uint8, device=device)
    ag = torch.zeros(ROWS, 256, dtype=torch.uint8, device=device)
    idx = torch.zeros(ROWS, dtype=torch.int32, device=device)
    out = torch.zeros(ROWS * ROW_BYTES, dtype=torch.uint8, device=device)
    cyc = torch.zeros(2, dtype=torch.int64, device=device)
    args = (from_dlpack(a, assumed_align=16), from_dlpack(ag, assumed_align=16), from_dlpack(idx),
            from_dlpack(out), from_dlpack(out.clone()), from_dlpack(cyc), 1, 1)
    return cute.compile(TmaRowsProbe(), *args, options=f"--gpu-arch {arch} --keep-ptx")


def main() -> int:
    import torch
    from cutlass.cute.runtime import from_dlpack

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        compile_probe()
        print("no SM90 GPU: compiled for sm_90a only")
        return 0
    T, K, col_tile, iters = 4096, 512, 2, 200
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randint(0, 256, (T, K), dtype=torch.uint8, device="cuda", generator=g)
    fn = None
    ok = True
    for name, idx in (("identity", torch.arange(ROWS, dtype=torch.int32, device="cuda")),
                      ("gather", torch.randperm(T, device="cuda", generator=g)[:ROWS].to(torch.int32))):
        ag = a[idx.long()].contiguous()
        out_tile = torch.full((ROWS * ROW_BYTES,), 0x5A, dtype=torch.uint8, device="cuda")  # poisoned
        out_rows = torch.full((ROWS * ROW_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
        cyc = torch.zeros(2, dtype=torch.int64, device="cuda")
        args = (from_dlpack(a, assumed_align=16), from_dlpack(ag, assumed_align=16), from_dlpack(idx),
                from_dlpack(out_tile), from_dlpack(out_rows), from_dlpack(cyc), col_tile, iters)
        if fn is None:
            fn = cute.compile(TmaRowsProbe(), *args)
        fn(*args)
        torch.cuda.synchronize()
        want = swizzled_image(ag[:, col_tile * ROW_BYTES:(col_tile + 1) * ROW_BYTES].cpu())
        tile_ok = torch.equal(out_tile.cpu(), want)
        rows_ok = torch.equal(out_rows.cpu(), out_tile.cpu())
        c = cyc.cpu().tolist()
        print(f"[tma rows] {name}: tile load = 128B-swizzled image: {tile_ok}; 128 row loads = tile load: "
              f"{rows_ok}; clock64 cycles per 16 KB stage (one warp, load + wait): 128 row loads "
              f"{c[0] / iters:.0f}, one tile load {c[1] / iters:.0f}", flush=True)
        ok &= tile_ok and rows_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
