"""``python -m moe_ep.bench.schedule_model [--model qwen3] [--tokens 8192]`` -- arithmetic on the
grouped GEMMs' tile schedule for three ideas, before anyone writes a kernel for them. CPU only; it
runs no kernel and times nothing: it counts tiles and bytes on the bench's own routing
(:func:`moe_ep.bench.models.draw_routing`, seed 0) and takes the measured times as arguments.

1. **The partial m-tiles.** Each expert's rows end in a tile of fewer than 128 rows; the tiles of
   at most 64 rows could run as one 64-row WGMMA. Inside the kernel that was tried (drops v44, v46,
   v78: the full tiles got slower, LIMITS.md). The model prices the other way: a second, separate
   launch for those tails. It has to read the weights of every expert with such a tail again,
   since the main kernel has long left them behind in L2.
2. **The combine inside FC2** (the "last arriver" sums): FC2's epilogue counts each (token,
   n-tile) segment's K rows; the CTA that stores the last one sums the K rows of that segment in
   k order (the bits of CombineLocal) and writes the output. The question is how much of the
   combine can then hide under FC2. FC2's tiles go expert by expert, so a token's segment is
   complete only once its last expert's tile is done. The model follows the kernel's schedule:
   the drop's raster (``_locate``), CTA ``b`` taking tiles ``b, b + grid, ...``, each tile the
   same time. Combine work that becomes ready is served at ``--spare-tbs`` while FC2 runs, and at
   the combine's own measured rate after FC2 ends. ``--passes P`` also models FC2 sweeping its
   n-tiles in P groups (all experts, then again), which completes segments earlier but reads A
   (FC2's input rows) P times.
3. **FC1's last wave.** Both GEMMs are persistent, one CTA per SM taking every ``grid``-th tile;
   the CTAs with no tile left in the last slot sit idle until FC1 ends, because FC2 (launched
   under PDL) waits for the whole of FC1. The model gives that idle time; FC2 tiles that waited
   only for their own m-tile's FC1 tiles (counters, as drop v91's placing FC1 waited for its rows)
   could fill it.

The defaults are the Qwen3 BF16 layer's measured times on the H200 (thirty-seventh session,
``SM90_MEGAMOE_PDL=0``: FC1 655, FC2 347, CombineLocal 77.4 us) and FC2's schedule (pingpong
128 x 192, raster 16). The spare bandwidth during FC2 is a guess (FC2 itself moves ~0.8 GB in
~350 us), which is why the model prints more than one value.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from .models import MODELS, draw_routing


def expert_rows(key: str, tokens: int, seed: int = 0) -> np.ndarray:
    """Rows per expert of the bench's routing for model ``key`` (one rank)."""
    m = MODELS[key]
    _, ids = draw_routing(torch.Generator().manual_seed(seed), m["num_experts"], m["top_k"], tokens)
    return np.bincount(ids.flatten().numpy(), minlength=m["num_experts"])


def tile_schedule(counts: np.ndarray, tile_m: int, n_tiles: int, raster_m: int):
    """``(expert, m_tile, n_tile)`` of every linear tile id, as the drop's ``_locate`` maps them
    (expert by expert; inside an expert, groups of ``raster_m`` m-tiles with the m-tile fast)."""
    m_tiles = (counts + tile_m - 1) // tile_m
    out = []
    for e, mt in enumerate(m_tiles):
        for local in range(int(mt) * n_tiles):
            g = local // (raster_m * n_tiles)
            g_rows = min(raster_m, int(mt) - g * raster_m)
            r = local - g * raster_m * n_tiles
            out.append((e, g * raster_m + r % g_rows, r // g_rows))
    return out


def segment_ready(ids: np.ndarray, counts: np.ndarray, order, ctas: int, tile_m: int, n_tiles: int) -> np.ndarray:
    """``[T, n_tiles]`` time (in tile slots of one CTA) at which every row of a (token, n-tile)
    segment has been stored, for tiles run in ``order`` by ``ctas`` persistent CTAs (tile ``i``
    ends at slot ``i // ctas + 1``). ``ids [T, K]``: each token's experts; a token's grouped rows
    are in expert order, tokens in order within an expert (the layout kernels' order)."""
    T, K = ids.shape
    m_tiles = (counts + tile_m - 1) // tile_m
    done = np.zeros((len(counts), int(m_tiles.max()), n_tiles))
    for i, (e, m, n) in enumerate(order):
        done[e, m, n] = i // ctas + 1
    flat = ids.flatten()
    grouped = np.empty(T * K, dtype=np.int64)
    grouped[np.argsort(flat, kind="stable")] = np.arange(T * K)
    first_row = np.concatenate([[0], np.cumsum(counts)])[flat]
    m_of = (grouped - first_row) // tile_m
    return np.stack([done[flat, m_of, n].reshape(T, K).max(1) for n in range(n_tiles)], axis=1)


def combine_left_us(ready_us: np.ndarray, total_mb: float, spare_tbs: float, after_tbs: float, end_us: float) -> float:
    """Microseconds of combine work left when FC2 ends at ``end_us``: ``total_mb`` split evenly over
    the segments, each ready at its time in ``ready_us``, served at ``spare_tbs`` (TB/s = MB/us)
    until ``end_us`` and at ``after_tbs`` after."""
    t = np.sort(ready_us.ravel())
    per = total_mb / t.size
    queue, last = 0.0, 0.0
    for ti in t:
        queue = max(0.0, queue - (ti - last) * spare_tbs) + per
        last = ti
    queue = max(0.0, queue - (end_us - last) * spare_tbs)
    return queue / after_tbs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3", choices=sorted(MODELS))
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ctas", type=int, default=132)
    p.add_argument("--fc2-tile-n", type=int, default=192)
    p.add_argument("--raster-m", type=int, default=16)
    p.add_argument("--gemm-us", type=float, default=655.0 + 347.0, help="FC1 + FC2, measured")
    p.add_argument("--fc2-us", type=float, default=347.0, help="FC2, measured")
    p.add_argument("--combine-us", type=float, default=77.4, help="CombineLocal, measured")
    p.add_argument("--passes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--spare-tbs", type=float, nargs="+", default=[0.8, 1.3])
    args = p.parse_args(argv)
    m = MODELS[args.model]
    E, H, I, K, T = m["num_experts"], m["hidden"], m["intermediate"], m["top_k"], args.tokens
    gated = m.get("activation", "swiglu") != "squared_relu"
    counts = expert_rows(args.model, T)
    print(f"{m['name']}, {T} tokens, top-{K}: {int(counts.sum())} grouped rows over {E} experts "
          f"({counts.min()}-{counts.max()} per expert)")

    # 1. the partial m-tiles, and a separate launch for the small ones
    m_tiles = int(((counts + 127) // 128).sum())
    rem = counts % 128
    small = int(((rem > 0) & (rem <= 64)).sum())
    share = small / m_tiles
    w_mb = ((2 * I if gated else I) * H + H * I) * 2 / 1e6  # one expert's w13 + w2, bf16
    combine_mb = (T * K * H * 2 + T * H * 2) / 1e6  # CombineLocal reads K rows, writes one, per token
    after = combine_mb / args.combine_us  # its measured rate, TB/s (= MB/us)
    reread_us = small * w_mb / after
    print(f"\n1. m-tiles: {m_tiles} for {counts.sum() / 128:.0f} tiles' worth of rows "
          f"({m_tiles / (counts.sum() / 128) - 1:.1%} padding); {small} experts end in a tile of <= 64 rows "
          f"({share:.1%} of the tiles)")
    print(f"   those tiles' share of FC1 + FC2: ~{share * args.gemm_us:.0f} us; at 64 rows the most "
          f"a 64-row WGMMA saves is half, ~{share * args.gemm_us / 2:.0f} us")
    print(f"   a separate tail launch re-reads {small} experts' weights: {small * w_mb:.0f} MB, "
          f"~{reread_us:.0f} us at the combine's measured rate")

    # 2. the combine inside FC2
    n_tiles = (H + args.fc2_tile_n - 1) // args.fc2_tile_n
    _, ids = draw_routing(torch.Generator().manual_seed(0), E, K, T)
    ids = ids.numpy()
    print(f"\n2. combine inside FC2 ({n_tiles} n-tiles of {args.fc2_tile_n}; combine {combine_mb:.0f} MB, "
          f"{args.combine_us} us = {after:.2f} TB/s; FC2 {args.fc2_us} us):")
    for passes in args.passes:
        order = []  # every expert's tiles of n-group 0, then of group 1, ... (one group: the drop's order)
        for group in np.array_split(np.arange(n_tiles), passes):
            order += [(e, mt, int(group[n])) for e, mt, n in tile_schedule(counts, 128, len(group), args.raster_m)]
        ready = segment_ready(ids, counts, order, args.ctas, 128, n_tiles)
        end = ready.max()
        frac = ", ".join(f"{np.mean(ready <= q * end):.0%} by {q:.0%}" for q in (0.5, 0.8, 0.9, 0.95))
        left = ", ".join(f"{combine_left_us(ready / end * args.fc2_us, combine_mb, s, after, args.fc2_us):.0f} us "
                         f"at {s} TB/s spare" for s in args.spare_tbs)
        extra = "" if passes == 1 else f"; A read {passes}x: +{(passes - 1) * T * K * I * 2 / 1e6:.0f} MB"
        print(f"   {passes} pass(es): segments ready {frac} of FC2; combine left after FC2: {left}{extra}")

    # 3. FC1's last wave, and FC2 starting in it
    fc1_us = args.gemm_us - args.fc2_us
    fc1_tiles = m_tiles * -(-I // 128)  # cooperative 128 x 128 (gated: gate and up tiles together)
    fc2_tiles = m_tiles * n_tiles
    for name, tiles, us in (("FC1", fc1_tiles, fc1_us), ("FC2", fc2_tiles, args.fc2_us)):
        idle = last_wave_idle_us(tiles, args.ctas, us)
        print(f"\n3. {name}: {tiles} tiles on {args.ctas} CTAs = {tiles / args.ctas:.2f} waves; its last wave "
              f"leaves {idle:.1f} us of the whole GPU idle ({idle / us:.1%} of {us:.0f} us)")
    print(f"   FC2 tiles starting as soon as their m-tile's FC1 tiles are stored (per-m-tile counters "
          f"instead of PDL's whole-grid wait) could fill FC1's idle slots: at most "
          f"~{last_wave_idle_us(fc1_tiles, args.ctas, fc1_us):.0f} us a forward")


def last_wave_idle_us(tiles: int, ctas: int, kernel_us: float) -> float:
    """Whole-GPU microseconds idle in a persistent GEMM's last wave: CTA ``b`` runs tiles ``b, b + ctas,
    ...``, each the same time, so ``ctas - tiles % ctas`` CTAs sit out the last tile slot."""
    slots = -(-tiles // ctas)
    spare = slots * ctas - tiles
    return spare * (kernel_us / slots) / ctas


if __name__ == "__main__":
    main()
