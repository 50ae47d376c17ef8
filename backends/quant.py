"""Block-scaled weight formats: BF16 -> NVFP4 and BF16 -> MXFP8, and back (public: :mod:`moe_ep.api.quant`).

Both quantise along the last dimension (K, the reduction dimension of ``w13 [E, rows, H]`` and
``w2 [E, H, I]``), in blocks:

**NVFP4** (:func:`quantize_nvfp4`, the Blackwell W4A16 weight format): values are FP4 E2M1
(magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte; every 16 consecutive values share one
FP8 E4M3 scale; each expert (leading index) has one float32 global scale::

    global_scale[e] = amax(|w[e]|) / (6 · 448)
    block_scale     = e4m3(amax(|block|) / 6 / global_scale[e])         (round to nearest)
    value           = e2m1(w / (block_scale · global_scale[e]))       (round to nearest, ±6 max)
    w ≈ value · block_scale · global_scale[e]

Round-trip bound (checked by the tests), per element:
``|w − dequant(quant(w))| ≤ amax(|block|) · (1/6 + 1/16) + amax(|w[e]|) · 6 · 2⁻¹⁰ / 2688``
(half of the widest E2M1 step, 2 of 6, plus the E4M3 rounding of the block scale; the last term
covers block scales so small next to the expert's largest value that E4M3 holds them as
subnormals), and 0 for a block of zeros.

**MXFP8** (:func:`quantize_mxfp8`, OCP Microscaling layout): values are FP8 E4M3; every 32
consecutive values share one power-of-two scale stored as E8M0::

    scale = 2 ** ceil(log2(amax(|block|) / 448))
    value = e4m3(w / scale)                               (round to nearest)

(The OCP reference picks ``2 ** (floor(log2(amax)) − 8)``, which lets the largest values of a block
exceed 448 and saturate, up to 12.5 % off; rounding the scale up never saturates.)
Round-trip bound: ``|w − dequant(quant(w))| ≤ 2⁻⁴ · |w| + 2⁻¹⁰ · scale`` per element (3 mantissa
bits; the second term covers E4M3 subnormals).

**FP8 block-128** (:func:`quantize_fp8_block128`, DeepSeek-V3 / Qwen3-FP8 checkpoints): values are
FP8 E4M3; weights have one float32 scale per 128×128 block (``scale [E, ceil(N/128),
ceil(K/128)]``, the checkpoints' ``weight_scale_inv``), activations one per 128 consecutive
values of a row (:func:`quantize_fp8_rows128`)::

    scale = amax(|block|) / 448           (1 for a block of zeros)
    value = e4m3(w / scale)               (round to nearest; never saturates)

Round-trip bound: ``|w − dequant(quant(w))| ≤ 2⁻⁴ · |w| + 2⁻¹⁰ · scale`` per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
FP8_BLOCK = 128
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def _div_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded on every device: CUDA torch turns a division by a Python
    scalar into a multiplication by its rounded reciprocal (1 ulp off at times); the kernels divide."""
    return amax / torch.full_like(amax, E4M3_MAX)
# E2M1 magnitudes by code 0..7 (bit 3 is the sign)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class NVFP4Weight:
    """NVFP4 weights of E experts.

    Attributes:
        values: ``[E, N, K/2]`` uint8, two E2M1 codes per byte (element 2j in the low nibble,
            2j+1 in the high nibble; code = sign·8 + magnitude index).
        block_scale: ``[E, N, K/16]`` ``torch.float8_e4m3fn``.
        global_scale: ``[E]`` float32.
    """

    values: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The logical ``[E, N, K]`` shape of the weight."""
        e, n, k2 = self.values.shape
        return torch.Size((e, n, 2 * k2))

    @property
    def device(self) -> torch.device:
        return self.values.device


@dataclass(frozen=True)
class _ScaledValues:
    """``values`` plus one ``scale`` tensor; the logical shape and device are the values'."""

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device


@dataclass(frozen=True)
class MXFP8Tensor(_ScaledValues):
    """MXFP8 values of any ``[..., K]`` tensor.

    Attributes:
        values: ``[..., K]`` ``torch.float8_e4m3fn``.
        scale: ``[..., K/32]`` ``torch.float8_e8m0fnu`` (a power of two per 32 values).
    """


def _check_float(name: str, w: torch.Tensor, block: int, min_dim: int) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point() or w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{name} must be a bf16/fp16/fp32 tensor, got {w.dtype}")
    if w.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(w.shape)}")
    if w.shape[-1] % block:
        raise ValueError(f"{name}: the last dimension ({w.shape[-1]}) must be a multiple of {block}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} holds non-finite values")


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8 0..15), round to nearest (ties to the even code), saturating."""
    table = torch.tensor(_E2M1, dtype=torch.float32, device=x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    # nearest magnitude; on a tie argmin takes the lower index, then move to the even code
    d = (mag.unsqueeze(-1) - table).abs()
    idx = d.argmin(dim=-1)
    tie = (idx < 7) & torch.isclose(d.gather(-1, idx.unsqueeze(-1)).squeeze(-1),
                                    d.gather(-1, (idx + 1).clamp(max=7).unsqueeze(-1)).squeeze(-1))
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    return (idx + 8 * (x < 0).to(idx.dtype)).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> NVFP4Weight:
    """``w [E, N, K]`` (bf16/fp16/fp32, K % 16 == 0) -> :class:`NVFP4Weight` (see the module)."""
    _check_float("w", w, NVFP4_BLOCK, 3)
    E, N, K = w.shape
    wf = w.float()
    amax_e = wf.abs().amax(dim=(1, 2))
    gs = torch.where(amax_e > 0, amax_e / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax_e))
    blocks = wf.reshape(E, N, K // NVFP4_BLOCK, NVFP4_BLOCK)
    amax_b = blocks.abs().amax(dim=-1)
    bs = (amax_b / E2M1_MAX / gs[:, None, None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = bs.float() * gs[:, None, None]
    q = torch.where(denom[..., None] > 0, blocks / denom[..., None].clamp_min(1e-38), torch.zeros_like(blocks))
    codes = _round_e2m1(q).reshape(E, N, K)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
    return NVFP4Weight(packed, bs.contiguous(), gs.float().contiguous())


def dequantize_nvfp4(q: NVFP4Weight) -> torch.Tensor:
    """:class:`NVFP4Weight` -> float32 ``[E, N, K]``."""
    E, N, K = q.shape
    table = torch.tensor(_E2M1, dtype=torch.float32, device=q.device)
    codes = torch.stack((q.values & 0xF, q.values >> 4), dim=-1).reshape(E, N, K).long()
    vals = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = q.block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * q.global_scale.float()[:, None, None]
    return vals * scale


MXFP4_BLOCK = 32
E8M0_BIAS = 127


def nvfp4_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, gate_up_interleaved: bool = False,
                     exact: bool = True) -> NVFP4Weight:
    """MXFP4 expert weights (gpt-oss's checkpoints: E2M1 codes with one E8M0 power-of-two scale per 32
    values) -> :class:`NVFP4Weight` for ``quant="nvfp4_w4a16"``, without a detour through BF16.

    Args:
        blocks: ``[E, N, K/32, 16]`` or ``[E, N, K/2]`` uint8, two E2M1 codes per byte, element 2j in the
            low nibble (gpt-oss's ``*_blocks``; NVFP4's order too, so the bytes are kept).
        scales: ``[E, N, K/32]`` uint8 E8M0 codes (scale ``2 ** (code - 127)``) or ``torch.float8_e8m0fnu``
            (gpt-oss's ``*_scales``).
        gate_up_interleaved: the rows alternate gate, up, gate, ... (gpt-oss's ``gate_up_proj``): reorder
            them to moe_ep's gate rows ``[0, I)`` then up rows ``[I, 2I)`` (do the same to its bias:
            ``torch.cat((b[:, 0::2], b[:, 1::2]), 1)``).
        exact: each 32-block's ``2 ** k`` becomes two 16-blocks' E4M3 scale ``2 ** (k - k0[e])`` with the
            expert's global scale ``2 ** k0[e]``, ``k0[e]`` = the largest ``k`` of the expert's non-zero
            blocks minus 8 (E4M3 holds ``2 ** -9 .. 2 ** 8`` exactly). That is exact when those ``k`` span
            at most 17 per expert; otherwise ``exact=True`` raises ``ValueError``, and ``exact=False``
            re-rounds the blocks below the range to E2M1 at scale ``2 ** (k0[e] - 9)`` (they are more than
            ``2 ** 17`` times smaller than the expert's largest block).
    Returns the :class:`NVFP4Weight` ``[E, N, K]``; ``dequantize_nvfp4`` of it equals the MXFP4 weight
    exactly when ``exact`` holds.
    """
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8:
        raise TypeError(f"blocks must be a uint8 tensor, got {getattr(blocks, 'dtype', type(blocks).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"scales must be uint8 E8M0 codes or float8_e8m0fnu, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    if scales.dim() != 3:
        raise ValueError(f"scales must be [E, N, K/32], got shape {tuple(scales.shape)}")
    E, N, nb = scales.shape
    if tuple(blocks.shape) not in ((E, N, nb, MXFP4_BLOCK // 2), (E, N, nb * MXFP4_BLOCK // 2)):
        raise ValueError(f"blocks must be [E, N, K/32, 16] or [E, N, K/2] for scales {tuple(scales.shape)}, "
                         f"got shape {tuple(blocks.shape)}")
    values = blocks.reshape(E, N, nb * MXFP4_BLOCK // 2)
    scale_codes = scales.view(torch.uint8).to(torch.int32)
    if bool((scale_codes == 255).any()):
        raise ValueError("scales hold the E8M0 NaN code 255")
    if gate_up_interleaved:
        if N % 2:
            raise ValueError(f"gate_up_interleaved needs an even number of rows, got N={N}")
        order = torch.cat((torch.arange(0, N, 2), torch.arange(1, N, 2))).to(values.device)
        values, scale_codes = values[:, order], scale_codes[:, order]
    k = scale_codes - E8M0_BIAS  # [E, N, K/32]: each 32-block's scale is 2 ** k
    nonzero = (values.reshape(E, N, nb, MXFP4_BLOCK // 2) & 0x77).amax(dim=-1) > 0  # a block with a non-zero code
    kmax = torch.where(nonzero, k, torch.full_like(k, -(1 << 20))).amax(dim=(1, 2))
    k0 = torch.where(kmax > -(1 << 20), kmax - 8, torch.zeros_like(kmax))  # [E]; an all-zero expert: 2 ** 0
    j = k - k0[:, None, None]
    low = nonzero & (j < -9)
    if bool(low.any()):
        if exact:
            e = int(low.any(dim=(1, 2)).nonzero()[0])
            span = int(kmax[e] - torch.where(nonzero[e], k[e], kmax[e]).min())
            raise ValueError(f"expert {e}'s block scales span 2**{span} (more than 2**17): NVFP4 cannot hold them "
                             f"exactly; pass exact=False to re-round the {int(low.sum())} smallest blocks")
        table = torch.tensor(_E2M1, dtype=torch.float32, device=values.device)
        unpacked = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(E, N, nb, MXFP4_BLOCK).long()
        mag = table[unpacked & 7] * torch.where(unpacked >= 8, -1.0, 1.0)
        rescaled = mag * torch.exp2((j + 9).clamp(max=0).float())[..., None]  # into scale 2 ** (k0 - 9)
        recoded = torch.where(low[..., None], _round_e2m1(rescaled).long(), unpacked).reshape(E, N, -1)
        values = (recoded[..., 0::2] | (recoded[..., 1::2] << 4)).to(torch.uint8)
    block_scale = torch.exp2(j.clamp(-9, 8).float()).repeat_interleave(2, dim=-1).to(torch.float8_e4m3fn)
    return NVFP4Weight(values.contiguous(), block_scale.contiguous(), torch.exp2(k0.float()).contiguous())


def quantize_mxfp8(w: torch.Tensor) -> MXFP8Tensor:
    """``w [..., K]`` (bf16/fp16/fp32, K % 32 == 0) -> :class:`MXFP8Tensor` (see the module)."""
    _check_float("w", w, MXFP8_BLOCK, 1)
    wf = w.float()
    blocks = wf.reshape(*wf.shape[:-1], wf.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax.clamp_min(2.0 ** -120) / E4M3_MAX)),
                      torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scale = torch.exp2(exp)
    vals = (blocks / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return MXFP8Tensor(vals.reshape(wf.shape).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous())


def dequantize_mxfp8(q: MXFP8Tensor) -> torch.Tensor:
    """:class:`MXFP8Tensor` -> float32 of the same shape."""
    s = q.scale.float().repeat_interleave(MXFP8_BLOCK, dim=-1)
    return q.values.float() * s


@dataclass(frozen=True)
class FP8Block128Weight(_ScaledValues):
    """FP8 block-128 weights of E experts.

    Attributes:
        values: ``[E, N, K]`` ``torch.float8_e4m3fn``.
        scale: ``[E, ceil(N/128), ceil(K/128)]`` float32: ``w ≈ values · scale[e, n//128, k//128]``.
    """


def _blocks128(n: int) -> int:
    return -(-n // FP8_BLOCK)


def quantize_fp8_block128(w: torch.Tensor) -> FP8Block128Weight:
    """``w [E, N, K]`` (bf16/fp16/fp32; any N, K) -> :class:`FP8Block128Weight` (see the module)."""
    _check_float("w", w, 1, 3)
    E, N, K = w.shape
    nb, kb = _blocks128(N), _blocks128(K)
    wp = torch.zeros(E, nb * FP8_BLOCK, kb * FP8_BLOCK, dtype=torch.float32, device=w.device)
    wp[:, :N, :K] = w.float()
    blocks = wp.reshape(E, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, _div_e4m3_max(amax), torch.ones_like(amax))
    vals = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    vals = vals.reshape(E, nb * FP8_BLOCK, kb * FP8_BLOCK)[:, :N, :K].contiguous()
    return FP8Block128Weight(vals, scale.contiguous())


def dequantize_fp8_block128(q: FP8Block128Weight) -> torch.Tensor:
    """:class:`FP8Block128Weight` -> float32 ``[E, N, K]``."""
    E, N, K = q.values.shape
    s = q.scale.repeat_interleave(FP8_BLOCK, dim=1).repeat_interleave(FP8_BLOCK, dim=2)[:, :N, :K]
    return q.values.float() * s


def quantize_fp8_rows128(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``t [M, K]`` -> ``(values e4m3 [M, K], scale float32 [M, ceil(K/128)])``, one
    scale per 128 consecutive values of a row (the last group may be shorter)."""
    M, K = t.shape
    kb = _blocks128(K)
    tp = torch.zeros(M, kb * FP8_BLOCK, dtype=torch.float32, device=t.device)
    tp[:, :K] = t.float()
    g = tp.reshape(M, kb, FP8_BLOCK)
    amax = g.abs().amax(dim=-1)
    scale = torch.where(amax > 0, _div_e4m3_max(amax), torch.ones_like(amax))
    vals = (g / scale[..., None]).to(torch.float8_e4m3fn).reshape(M, kb * FP8_BLOCK)[:, :K]
    return vals.contiguous(), scale


def dequantize_fp8_rows128(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_rows128`: float32 ``[M, K]``."""
    K = values.shape[1]
    return values.float() * scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :K]
