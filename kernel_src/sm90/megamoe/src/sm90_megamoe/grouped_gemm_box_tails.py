"""BF16 grouped GEMM whose partial m-tiles load only their own expert's A rows (drop v111; SM90).

The grouped rows are packed, so an expert's last m-tile holds fewer than ``tile_m`` of its rows and
the plain kernel (:class:`.grouped_gemm.GroupedGemmSm90`) loads, multiplies and then masks the next
expert's first rows in the rest (Qwen3 at 8192 tokens: 11.6% of the rows its GEMMs compute).
:class:`GroupedGemmBoxTailsSm90` loads such a tile's A as ``tile_m / box_rows`` TMA boxes of
``box_rows`` rows each, through a second descriptor of that box size: a box holding a row of the
expert reads its rows, every other box is issued at a row past the end of ``mA``, so TMA fills it
with zeros and reads nothing. The stage's bytes and its barrier's transaction count are the same as
for one ``tile_m``-row box, so the consumers and the pipeline are the plain kernel's.

Why: at the 700 W cap the L2 is the busiest unit of Qwen3's GEMMs (Nsight Compute, 45th session:
FC1 95% of its throughput), and zeros switch less in the tensor cores than tokens do
(``bench padfill``, 56th session: the same tiles 0.3-2.3% faster with zero spare rows). Drop v110
(branch ``exp/zero-tails``, not landed) had the same zero fill from a per-tile rewritten
descriptor in global memory; the rewrite and its proxy fences cost more than the fill saved. Here
nothing is written: both descriptors are kernel parameters.

Same bits as the plain kernel: a row's output depends on its own A row only, and the rows past the
expert (now zeros, or at most ``box_rows - 1`` of the next expert's rows in the last box read) are
never stored. Cooperative, wide and pingpong schedules, ``cluster_m`` 1 or 2; not ``cluster_n``
(A multicast over an n-tile pair) and not the gathering kernel.

Tensors: as :class:`.grouped_gemm.GroupedGemmSm90` (the same ``__call__``).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync

from .grouped_gemm import GroupedGemmSm90

#: the box heights the kernel takes: multiples of the 8-row swizzle atom, so every box starts on one
BOX_ROWS = (8, 16, 32)


class GroupedGemmBoxTailsSm90(GroupedGemmSm90):
    """The BF16 grouped GEMM with its partial m-tiles' A loaded in ``box_rows``-row boxes (module
    docstring). ``box_rows``: one of :data:`BOX_ROWS` (8: at most 7 rows of the next expert read)."""

    def __init__(self, activation: str, box_rows: int = 8, **kw):
        if box_rows not in BOX_ROWS:
            raise ValueError(f"box_rows must be one of {BOX_ROWS}, got {box_rows}")
        super().__init__(activation, **kw)
        if self.gather_a or self.cluster_n > 1:
            raise ValueError("box tails are for the TMA kernel whose CTAs load their own A rows "
                             "(not gather_a, not cluster_n)")
        if self.tile_m % box_rows:
            raise ValueError(f"tile_m {self.tile_m} is not a multiple of box_rows {box_rows}")
        self.box_rows = box_rows

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        max_active_ctas: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        self._check_inputs(mA, mB, mC, mOffsets, mBias)
        setup = self._setup(mA, mB, mOffsets)
        # the box's descriptor: rows of box_rows, the same 128-byte swizzle as A's stages
        box_smem_layout = sm90_utils.make_smem_layout_a(
            cutlass.utils.LayoutEnum.from_tensor(mA), (self.box_rows, self.tile_n, self.tile_k), self.ab_dtype, 1)
        tma_atom_box, tma_tensor_box = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(box_smem_layout, (None, None, 0)),
            (self.box_rows, self.tile_k))
        self._launch(self.kernel_box_tails(setup[0], setup[1], setup[2], setup[3], mC, mOffsets, mRowScale, mBias,
                                           *setup[4:], tma_atom_box, tma_tensor_box), max_active_ctas, stream)

    @cute.kernel
    def kernel_box_tails(
        self,
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        mC: cute.Tensor,
        mOffsets: cute.Tensor,
        mRowScale: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        tiled_mma_epi: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_smem_layout_main: cute.ComposedLayout,
        tma_atom_box: cute.CopyAtom,
        mBox_tma: cute.Tensor,
    ):
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            cpasync.prefetch_descriptor(tma_atom_box)
        self._body(tma_atom_a, mA_tma, tma_atom_b, mB_tma, mC, mOffsets, mRowScale, mBias, tiled_mma, tiled_mma_epi,
                   a_smem_layout, b_smem_layout, b_smem_layout_main, tails=(tma_atom_box, mBox_tma))

    @cute.jit
    def _copy_a_boxes(self, tails, sA: cute.Tensor, row0: cutlass.Int32, rows_valid: cutlass.Int32,
                      k_tile: cutlass.Int32, stage: cutlass.Int32, bar):
        """k-tile ``k_tile`` of a partial tile's A (``rows_valid`` < tile_m rows from ``row0``) into
        stage ``stage``, completing on ``bar``: box j (smem rows ``[j b, (j + 1) b)``) reads rows ``row0
        + j b ...`` when ``j b < rows_valid``, else it is issued at row ``M_total`` (past ``mA``: zero
        fill, nothing read). (Producer warp; traced inline into the producer loop.)"""
        tma_atom_box, mBox_tma = tails
        b = self.box_rows
        past_end = cute.size(mBox_tma, mode=[0])
        # (b, tile_k, box, 1, stage): box j of every stage
        sA_boxes = cute.flat_divide(sA, (b, self.tile_k))
        for j in cutlass.range_constexpr(self.tile_m // b):
            row = past_end
            if j * b < rows_valid:
                row = row0 + j * b
            gA = cute.local_tile(cute.domain_offset((row, 0), mBox_tma), (b, self.tile_k), (0, None))
            tAsA, tAgA = cpasync.tma_partition(tma_atom_box, 0, cute.make_layout(1),
                                               cute.group_modes(sA_boxes[(None, None, j, 0, None)], 0, 2),
                                               cute.group_modes(gA, 0, 2))
            cute.copy(tma_atom_box, tAgA[(None, k_tile)], tAsA[(None, stage)], tma_bar_ptr=bar)
