"""CPU functional model of the grouped GEMM's data movement (no GPU, no CuTe compile).

It runs the kernel's own per-lane index maps (``Mxfp8GroupedGemmSm120.w_ldsm_row`` & co, the
TMA box bases ``_w_base``, the scale-row clamps, the epilogue slots) against an independent
model of what the hardware does with them, taken from the PTX ISA:

* TMA with 128-byte swizzle writes byte (r, c) of a box to ``r*128 + ((c/16) ^ (r%8))*16 + c%16``
  and zero-fills rows outside the tensor;
* ``ldmatrix.x4``: thread t receives from matrix i the 4 bytes at ``addr[8 i + t/4] + 4 (t%4)``;
* ``mma.m16n8k32`` fragments: A reg i of thread t holds A[t/4 + 8 (i%2), 16 (i/2) + 4 (t%4) + b],
  B reg i holds B[16 i + 4 (t%4) + b, t/4], C element i is C[t/4 + 8 (i/2), 2 (t%4) + i%2];
* block scales (scale_vec::1X, thread-id 0): the A scale of row r comes from lane
  ``4 (r%8) + r/8``, the B scale of column n from lane ``4 n``.

So a wrong swizzle XOR, a swapped gate/up half, a misplaced scale lane or a wrong epilogue slot
shows up as a mismatch against :func:`reference.grouped_gemm_reference`. The pipeline (barriers,
phases) is not modelled. Float64 math; the bf16 rounding of the output is not applied.
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import MMA_WARPS_M, TILE_K, TILE_W
from .grouped_gemm import Mxfp8GroupedGemmSm120
from .reference import gated_activation_reference

_BOX = TILE_W // 2


def _swizzle_box(rows: torch.Tensor) -> torch.Tensor:
    """(R, 128) uint8 box -> flat smem image as TMA SWIZZLE_128B writes it."""
    r_cnt = rows.shape[0]
    r = torch.arange(r_cnt)[:, None]
    c = torch.arange(TILE_K)[None, :]
    off = r * TILE_K + ((c // 16) ^ (r % 8)) * 16 + c % 16
    smem = torch.zeros(r_cnt * TILE_K, dtype=torch.uint8)
    smem[off.reshape(-1)] = rows.reshape(-1)
    return smem


_T = torch.arange(32)
_B4 = torch.arange(4)


def _ldsm_x4(smem: torch.Tensor, addrs: torch.Tensor) -> torch.Tensor:
    """ldmatrix.x4: lane addresses (32,) -> registers (4 matrices, 32 threads, 4 bytes):
    thread t gets from matrix i the 4 bytes at addrs[8 i + t / 4] + 4 (t % 4)."""
    i = torch.arange(4)[:, None]
    base = addrs[8 * i + _T[None, :] // 4] + 4 * (_T[None, :] % 4)  # (4, 32)
    return smem[base[..., None] + _B4]


def _fragment_maps():
    """(row, col) of every (register, thread, byte) of the A / B fragments and of every
    (thread, element) of the C fragment of mma.m16n8k32 (8-bit inputs)."""
    i, t, b = torch.meshgrid(torch.arange(4), _T, _B4, indexing="ij")
    a_rc = (t // 4 + 8 * (i % 2), 16 * (i // 2) + 4 * (t % 4) + b)
    i2, t2, b2 = torch.meshgrid(torch.arange(2), _T, _B4, indexing="ij")
    b_rc = (16 * i2 + 4 * (t2 % 4) + b2, t2 // 4)  # (k, n)
    t3, e3 = torch.meshgrid(_T, torch.arange(4), indexing="ij")
    c_rc = (t3 // 4 + 8 * (e3 // 2), 2 * (t3 % 4) + e3 % 2)
    for rc, shape in ((a_rc, (16, 32)), (b_rc, (32, 8)), (c_rc, (16, 8))):
        flat = rc[0] * shape[1] + rc[1]
        assert torch.equal(flat.reshape(-1).sort().values, torch.arange(shape[0] * shape[1])), \
            "fragment map is not a bijection"
    return a_rc, b_rc, c_rc


_A_RC, _B_RC, _C_RC = _fragment_maps()


def _frag_a(regs: torch.Tensor) -> torch.Tensor:
    """A registers (4, 32, 4) -> the 16 x 32 byte matrix the MMA sees."""
    a = torch.empty(16, 32, dtype=torch.uint8)
    a[_A_RC] = regs
    return a


def _frag_b(regs2: torch.Tensor) -> torch.Tensor:
    """B registers (b0, b1) as (2, 32, 4) -> the 32 x 8 byte matrix (K x N) the MMA sees."""
    b = torch.empty(32, 8, dtype=torch.uint8)
    b[_B_RC] = regs2
    return b


def _e4m3(u8: torch.Tensor) -> torch.Tensor:
    return u8.view(torch.float8_e4m3fn).to(torch.float64)


def _e8m0(codes: torch.Tensor) -> torch.Tensor:
    return torch.exp2(codes.to(torch.float64) - 127.0)


_SFA_LANE = torch.tensor([4 * (r % 8) + r // 8 for r in range(16)])  # lane holding row r's scale
_SFB_LANE = torch.tensor([4 * c for c in range(8)])                  # lane holding column c's


def emulate_grouped_gemm(kern: Mxfp8GroupedGemmSm120, x, x_scale, w, w_scale, offsets,
                         row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Model of ``kern`` on CPU tensors (fp8 as float8 or uint8). Returns float64
    ``[M_total, N_out]``; rows of no expert stay NaN. Asserts that every staging slot and every
    stored output element is written exactly once. Keep the sizes small (thousands of tiny
    tensor ops per tile)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: thread pools only add overhead
    try:
        return _emulate(kern, x, x_scale, w, w_scale, offsets, row_scale)
    finally:
        torch.set_num_threads(threads)


def _emulate(kern, x, x_scale, w, w_scale, offsets, row_scale):
    x, x_scale = x.view(torch.uint8).cpu(), x_scale.view(torch.uint8).cpu()
    w, w_scale = w.view(torch.uint8).cpu(), w_scale.view(torch.uint8).cpu()
    num_experts, n, k = w.shape
    m_total = x.shape[0]
    n_out, n_tiles, k_tiles = kern.static_shapes(n, k)
    kern.n, kern.n_out = n, n_out  # what __call__ records at trace time (used by _w_base)
    bn, vec, nw = kern.tile_tokens, kern.epi_vec, kern.num_mma_warps
    lanes = range(32)
    ksteps = TILE_K // 32
    # the kernel's per-lane index maps, evaluated once
    w_addr = torch.tensor([[[[kern.w_ldsm_row(wi % MMA_WARPS_M, a, ln) * TILE_K
                              + kern.w_ldsm_chunk(kk, ln) * 16 for ln in lanes]
                             for kk in range(ksteps)] for a in range(2)] for wi in range(nw)])
    w_sfr = torch.tensor([[[kern.w_sf_row(wi % MMA_WARPS_M, a, ln) for ln in lanes]
                           for a in range(2)] for wi in range(nw)])
    x_addr = torch.tensor([[[[kern.x_ldsm_row(wi // MMA_WARPS_M, j, ln) * TILE_K
                              + kern.x_ldsm_chunk(kh, ln) * 16 for ln in lanes]
                             for kh in range(2)] for j in range(kern.n_atoms)] for wi in range(nw)])
    x_sft = torch.tensor([[[kern.x_sf_token(wi // MMA_WARPS_M, j, ln) for ln in lanes]
                           for j in range(kern.n_atoms)] for wi in range(nw)])
    # epilogue slot of every accumulator element (a, hh, t, lane); swiglu: hh = 0 only
    hhs = (0,) if kern.gated else (0, 1)
    keys = [(a, hh, t, ln) for a in range(2) for hh in hhs for t in range(2) for ln in lanes]
    slot = torch.tensor([kern.epi_slot(*key) for key in keys])  # (n_keys, 2)
    key_a, key_hh, key_t, key_ln = (torch.tensor(c) for c in zip(*keys))

    offs = [int(v) for v in offsets.tolist()]
    out = torch.full((m_total, n_out), float("nan"), dtype=torch.float64)
    written = torch.zeros(m_total, n_out, dtype=torch.int32)
    r64 = torch.arange(_BOX)
    for e in range(num_experts):
        cnt = max(offs[e + 1] - offs[e], 0)
        for tt in range((cnt + bn - 1) // bn):
            row0 = offs[e] + tt * bn
            rows_left = min(offs[e + 1], m_total) - row0
            xrows = row0 + torch.arange(bn)
            for n_tile in range(n_tiles):
                acc = torch.zeros(nw, 2, kern.n_atoms, 32, 4, dtype=torch.float64)
                bases = [kern._w_base(n_tile, h) for h in range(2)]
                for kt in range(k_tiles):
                    k0 = kt * TILE_K
                    # ---- what TMA (zero fill outside the tensor) and the cp.asyncs leave in smem
                    boxes = []
                    for h in range(2):
                        rows = bases[h] + r64
                        box = w[e, rows.clamp(max=n - 1), k0:k0 + TILE_K].clone()
                        box[rows >= n] = 0
                        boxes.append(_swizzle_box(box))
                    s_w = torch.cat(boxes)
                    xbox = x[xrows.clamp(max=m_total - 1), k0:k0 + TILE_K].clone()
                    xbox[xrows >= m_total] = 0
                    s_x = _swizzle_box(xbox)
                    wsrc = torch.cat([bases[h] + r64 for h in range(2)]).clamp(max=n - 1)
                    s_sfw = w_scale[e, wsrc, kt * 4:kt * 4 + 4]            # (128, 4)
                    s_sfx = x_scale[xrows.clamp(max=m_total - 1), kt * 4:kt * 4 + 4]  # (bn, 4)
                    # ---- the MMA warps
                    for wi in range(nw):
                        for kk in range(ksteps):
                            a_mats = []
                            for a in range(2):
                                a_bytes = _frag_a(_ldsm_x4(s_w, w_addr[wi, a, kk]))
                                sa = s_sfw[w_sfr[wi, a], kk][_SFA_LANE]
                                a_mats.append(_e4m3(a_bytes) * _e8m0(sa)[:, None])
                            for j in range(kern.n_atoms):
                                regs = _ldsm_x4(s_x, x_addr[wi, j, kk // 2])
                                b_bytes = _frag_b(regs[2 * (kk % 2):2 * (kk % 2) + 2])
                                sb = s_sfx[x_sft[wi, j], kk][_SFB_LANE]
                                b_mat = _e4m3(b_bytes) * _e8m0(sb)[None, :]
                                for a in range(2):
                                    acc[wi, a, j] += (a_mats[a] @ b_mat)[_C_RC]
                # ---- epilogue
                for wi in range(nw):
                    wm, wn = wi % MMA_WARPS_M, wi // MMA_WARPS_M
                    for j in range(kern.n_atoms):
                        t_base = wn * kern.warp_tokens + 8 * j
                        stage = torch.full((8, kern.epi_feats), float("nan"), dtype=torch.float64)
                        hits = torch.zeros(8, kern.epi_feats, dtype=torch.int32)
                        accj = acc[wi, :, j]  # (2, 32, 4)
                        if kern.gated:  # the activation in float64 (drop v2: every gated epilogue)
                            v = gated_activation_reference(kern.epilogue, accj[key_a, key_ln, key_t],
                                                           accj[key_a, key_ln, 2 + key_t], **kern.act_consts)
                        else:
                            v = accj[key_a, key_ln, 2 * key_hh + key_t]
                            if kern.scale_rows:
                                ridx = (row0 + t_base + slot[:, 0]).clamp(max=row0 + rows_left - 1)
                                v = v * row_scale.double()[ridx.clamp(min=0)]
                        stage[slot[:, 0], slot[:, 1]] = v
                        hits.index_put_((slot[:, 0], slot[:, 1]), torch.ones_like(v, dtype=torch.int32),
                                        accumulate=True)
                        assert (hits == 1).all(), "epilogue staging slots written != once"
                        for ln in lanes:
                            tl, col = kern.epi_store(n_tile, wm, ln)
                            tok = t_base + tl
                            if tok < rows_left and col < n_out:
                                s0 = (ln % 4) * vec
                                out[row0 + tok, col:col + vec] = stage[tl, s0:s0 + vec]
                                written[row0 + tok, col:col + vec] += 1
    covered = written[offs[0]:min(offs[-1], m_total)]
    assert (covered == 1).all(), "output elements of expert rows written != once"
    return out
