"""Check the expert-layout kernels (layout_kernels) against the torch reference, and time them.

    cd kernel_src/sm90/megamoe/src && python -m sm90_megamoe.layout_runner           # GPU
    python -m sm90_megamoe.layout_runner --sim          # torch model of the kernels, CPU ok
    python -m sm90_megamoe.layout_runner --no-timing --calls 20

Per case (several W / T_max / K / E_l / H) the runner makes ``--calls`` consecutive calls on
ONE Layout object, each with a different recv_count (including 0 and T_max sources), fresh
routing, garbage ids in the stale slots, and stale garbage in offsets / idx / ws / pos / xs
before the call; calls alternate fused gather / no gather. After each call (device sync):
    * offsets == reference; pos is a bijection between the valid pairs and rows [0, n);
    * after canonicalising the row order inside every expert: idx, ws, pos equal the
      reference exactly (i.e. per expert the same set of (slot, k, weight)), xs rows equal
      recv_x[idx] bitwise;
    * scratch is tail-clean: counts == 0, arrive == 0, cursor[e] == offsets[e + 1].
Timing (GPU): the moe_ep backend's torch path (torch_expert_layout + GatherRows) vs Layout
(fused) vs Layout(no gather) + GatherRows: host enqueue time per call and device time per call
(device measured behind a torch.cuda._sleep so that the host runs ahead).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Tuple

import torch

from .layout_reference import (
    TorchLayoutBuffers,
    canonicalize,
    ref_layout,
    torch_expert_layout,
    valid_pairs,
)

# (W, T_max, K, E_l, H)
CASES: List[Tuple[int, int, int, int, int]] = [
    (1, 512, 8, 128, 2048),   # Qwen3 EP=1 (small T_max)
    (2, 1024, 8, 64, 2048),   # Qwen3 EP=2
    (2, 777, 2, 4, 4096),     # Mixtral EP=2, odd T_max
    (4, 300, 6, 16, 264),     # H % 256 != 0 (predicated last chunk)
    (3, 100, 1, 5, 64),       # K = 1, tiny rows
    (1, 64, 32, 33, 128),     # K = 32 (full warp), E_l not a multiple of 32
    (8, 40, 8, 256, 7168),    # E_l = 256 (8 experts per lane in the scan), wide rows
]
SIM_CASES = CASES[:6]


# =============================================================================================
# Torch model of the two kernels (--sim): same interface and scratch semantics
# =============================================================================================


class SimLayout:
    """Drop-in for ``layout_launch.Layout`` executing the kernels' semantics with torch,
    including a RANDOM row order inside each expert (as the atomic cursors may produce) and
    the scratch protocol. Host-synchronizing."""

    def __init__(self, cfg, device, num_ctas=None, seed: int = 1):
        from .layout_kernels import scr_arrive, scr_counts, scr_cursor, scratch_len
        self.cfg = cfg
        E_l = cfg.local_experts
        self.scratch = torch.zeros(scratch_len(E_l), dtype=torch.int32, device=device)
        self._c, self._u, self._a = scr_counts(E_l), scr_cursor(E_l), scr_arrive(E_l)
        self.g = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, recv_ids, recv_w, recv_count, recv_x, offsets, idx, ws, pos, xs,
                 stream=None, check=True):
        c = self.cfg
        E_l, K = c.local_experts, c.topk
        scr = self.scratch
        # LayoutCount (adds into whatever counts hold, like the kernel)
        ok = valid_pairs(recv_ids, recv_count, c.max_tokens, E_l)
        e_all = recv_ids.long().clamp(0, E_l - 1)
        counts = torch.bincount(e_all[ok], minlength=E_l)
        scr[self._c:self._c + E_l] += counts.int()
        scr[self._a] += 1
        cnt = scr[self._c:self._c + E_l].clone()
        scr[self._c:self._c + E_l] = 0                       # atom.exch(count, 0)
        offsets[0] = 0
        offsets[1:] = torch.cumsum(cnt, 0).int()
        scr[self._u:self._u + E_l] = offsets[:E_l]
        scr[self._a] = 0
        # LayoutPlace: random service order of the pairs = random order inside each expert
        pos.fill_(-1)
        pairs = torch.nonzero(ok.flatten()).flatten()
        pairs = pairs[torch.randperm(pairs.numel(), generator=self.g).to(pairs.device)]
        for p in pairs.tolist():
            s, k = divmod(p, K)
            e = int(recv_ids[s, k])
            row = int(scr[self._u + e])
            scr[self._u + e] = row + 1
            pos[s, k] = row
            idx[row] = s
            ws[row] = recv_w[s, k]
            if recv_x is not None:
                xs[row] = recv_x[s]


# =============================================================================================
# Inputs and checks
# =============================================================================================


def make_counts(W: int, T_max: int, call: int, g: torch.Generator) -> torch.Tensor:
    """Different per call: cycles through all-full, all-zero, mixed random (incl. 0 / T_max)."""
    mode = call % 4
    if mode == 0:
        return torch.full((W,), T_max, dtype=torch.int32)
    if mode == 1 and call > 0:
        return torch.zeros(W, dtype=torch.int32)
    c = torch.randint(0, T_max + 1, (W,), generator=g, dtype=torch.int32)
    if W > 1:
        c[call % W] = 0 if mode == 2 else T_max
    return c


def fill_inputs(bufs, cfg, counts: torch.Tensor, g: torch.Generator, drop_prob: float):
    """Routing of the valid slots (ids in [-1, E_l), rare out-of-range ids), garbage in the
    stale slots, random weights and rows."""
    S, K, E_l, T_max = cfg.slots, cfg.topk, cfg.local_experts, cfg.max_tokens
    dev = bufs["recv_ids"].device
    ids = torch.randint(0, E_l, (S, K), generator=g, dtype=torch.int32)
    r = torch.rand(S, K, generator=g)
    ids[r < drop_prob] = -1
    ids[r > 1 - 0.002] = E_l + 3                    # out of range: must count as invalid
    garbage = torch.randint(-7, E_l + 7, (S, K), generator=g, dtype=torch.int32)
    t = torch.arange(T_max).repeat(cfg.world)
    q = torch.arange(cfg.world).repeat_interleave(T_max)
    stale = (t >= counts.long()[q]).unsqueeze(1)
    ids = torch.where(stale, garbage, ids)
    bufs["recv_ids"].copy_(ids.to(dev))
    bufs["recv_w"].copy_(torch.rand(S, K, generator=g).to(dev))
    bufs["recv_count"].copy_(counts.to(dev))
    bufs["recv_x"].copy_(torch.randn(S, cfg.hidden, generator=g).to(torch.bfloat16).to(dev))


def poison_outputs(bufs, g: torch.Generator):
    dev = bufs["pos"].device
    for name in ("offsets", "idx", "pos"):
        t = bufs[name]
        t.copy_(torch.randint(-1000, 100000, tuple(t.shape), generator=g,
                              dtype=torch.int32).to(dev))
    bufs["ws"].copy_(torch.randn(tuple(bufs["ws"].shape), generator=g).to(dev))
    bufs["xs"].copy_(torch.randn(tuple(bufs["xs"].shape), generator=g).to(torch.bfloat16).to(dev))


def allocate(cfg, device):
    S, K, P, H, E_l = cfg.slots, cfg.topk, cfg.pairs, cfg.hidden, cfg.local_experts
    i32, f32, bf = torch.int32, torch.float32, torch.bfloat16
    return dict(
        recv_ids=torch.empty(S, K, dtype=i32, device=device),
        recv_w=torch.empty(S, K, dtype=f32, device=device),
        recv_count=torch.empty(cfg.world, dtype=i32, device=device),
        recv_x=torch.empty(S, H, dtype=bf, device=device),
        offsets=torch.empty(E_l + 1, dtype=i32, device=device),
        idx=torch.empty(P, dtype=i32, device=device),
        ws=torch.empty(P, dtype=f32, device=device),
        pos=torch.empty(S, K, dtype=i32, device=device),
        xs=torch.empty(P, H, dtype=bf, device=device),
    )


def check_call(lay, cfg, b, gather: bool) -> List[str]:
    E_l = cfg.local_experts
    errs: List[str] = []
    ref = ref_layout(b["recv_ids"], b["recv_w"], b["recv_count"], cfg.max_tokens, E_l,
                     b["recv_x"] if gather else None)
    if not torch.equal(b["offsets"], ref["offsets"]):
        errs.append(f"offsets {b['offsets'][:8].tolist()}.. != {ref['offsets'][:8].tolist()}..")
        return errs
    got, e2 = canonicalize(b["offsets"], b["idx"], b["ws"], b["pos"], E_l,
                           b["xs"] if gather else None)
    if e2:
        return errs + e2
    for name in ("idx", "ws", "pos") + (("xs",) if gather else ()):
        if not torch.equal(got[name], ref[name]):
            bad = (got[name] != ref[name])
            if bad.dim() > 1:
                bad = bad.any(dim=-1)
            errs.append(f"{name}: {int(bad.sum())} mismatching rows (first "
                        f"{torch.nonzero(bad).flatten()[:4].tolist()})")
    # tail-clean scratch
    from .layout_kernels import scr_arrive, scr_counts, scr_cursor
    s = lay.scratch.cpu()
    cnt = s[scr_counts(E_l):scr_counts(E_l) + E_l]
    cur = s[scr_cursor(E_l):scr_cursor(E_l) + E_l]
    if int(cnt.abs().sum()) or int(s[scr_arrive(E_l)]):
        errs.append(f"scratch not clean: counts sum {int(cnt.abs().sum())}, "
                    f"arrive {int(s[scr_arrive(E_l)])}")
    if not torch.equal(cur, ref["offsets"][1:].cpu()):
        errs.append("cursor[e] != offsets[e+1] after LayoutPlace")
    return errs


def run_case(case, device, calls: int, seed: int, sim: bool, num_ctas, drop_prob: float,
             verbose: bool = True, count_ctas=None) -> List[str]:
    from .layout_launch import Layout, LayoutConfig
    W, T_max, K, E_l, H = case
    cfg = LayoutConfig(H, K, W, T_max, E_l)
    lay = SimLayout(cfg, device) if sim else Layout(cfg, device, num_ctas, count_ctas)
    b = allocate(cfg, device)
    g = torch.Generator().manual_seed(seed)
    fails: List[str] = []
    t0 = time.time()
    for i in range(calls):
        counts = make_counts(W, T_max, i, g)
        fill_inputs(b, cfg, counts, g, drop_prob)
        poison_outputs(b, g)
        gather = (i % 3) != 2
        lay(b["recv_ids"], b["recv_w"], b["recv_count"], b["recv_x"] if gather else None,
            b["offsets"], b["idx"], b["ws"], b["pos"], b["xs"] if gather else None)
        if device != "cpu":
            torch.cuda.synchronize()
        errs = check_call(lay, cfg, b, gather)
        fails += [f"{case} call {i} counts {counts.tolist()[:8]} gather={gather}: {e}"
                  for e in errs]
    if verbose:
        grids = "" if sim else f" grids {lay.count_ctas}/{lay.place_ctas}"
        print(f"  W={W} T_max={T_max:5d} K={K:2d} E_l={E_l:3d} H={H:5d}{grids}: {calls} calls "
              f"{'OK' if not fails else 'FAIL'} ({time.time() - t0:.1f}s)")
    return fails


# =============================================================================================
# Timing (GPU)
# =============================================================================================


def _time(fn, iters: int) -> Tuple[float, float]:
    """(host enqueue us/call, device us/call). Device time is measured with the host running
    ahead behind a torch.cuda._sleep, so it excludes launch gaps caused by the host."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(host * iters * 2.5e9) + 1_000_000)  # ~1.5x the enqueue time
    ev0.record()
    for _ in range(iters):
        fn()
    ev1.record()
    torch.cuda.synchronize()
    dev = ev0.elapsed_time(ev1) * 1e3 / iters
    return host * 1e6, dev


def timing(iters: int, num_ctas, sweep: bool = False):
    from cutlass import Int32
    from .ep_launch import EpConfig, _real, _stream, default_num_ctas
    from .ep_launch import get_kernel as ep_get_kernel
    from .layout_launch import Layout, LayoutConfig
    dev = "cuda"
    nsm = default_num_ctas()
    nct = num_ctas or nsm  # GatherRows grid (as EpRank's default)
    shapes = [  # name, (W, T_max, K, E_l, H), tokens per source
        ("Qwen3 EP=1 8192 tok", (1, 8192, 8, 128, 2048), 8192),
        ("Qwen3 EP=2 8192 tok", (2, 8192, 8, 64, 2048), 8192),
        ("Qwen3 EP=1 128 tok (decode)", (1, 8192, 8, 128, 2048), 128),
        ("Mixtral EP=2 8192 tok", (2, 8192, 2, 4, 4096), 8192),
    ]
    g = torch.Generator().manual_seed(7)
    print(f"timing ({iters} calls, num_ctas={nct}): host = enqueue us/call, dev = device "
          "us/call; end-to-end eager cost ~ max(host, dev)")
    for name, (W, T_max, K, E_l, H), T in shapes:
        cfg = LayoutConfig(H, K, W, T_max, E_l)
        b = allocate(cfg, dev)
        fill_inputs(b, cfg, torch.full((W,), T, dtype=torch.int32), g, 0.0)
        lay = Layout(cfg, dev, num_ctas)
        lb = TorchLayoutBuffers.allocate(W, T_max, K, E_l, dev)
        gk = ep_get_kernel("gather", EpConfig(H, K, W, T_max, E_l * W))
        st = _stream(None)
        ncta = Int32(nct)
        g_src = _real(b["recv_x"], 16, True)
        g_idx_t, g_idx_k = _real(lb.idx, 4, True), _real(b["idx"], 4, True)
        g_cnt_t = _real(lb.offsets[E_l:].view(1), 4, False)
        g_cnt_k = _real(b["offsets"][E_l:].view(1), 4, False)
        g_out = _real(b["xs"], 16, True)

        def torch_path():
            torch_expert_layout(lb, b["recv_ids"], b["recv_w"], b["recv_count"], E_l)
            gk(g_src, g_idx_t, g_cnt_t, g_out, ncta, st)

        def fused():
            lay(b["recv_ids"], b["recv_w"], b["recv_count"], b["recv_x"], b["offsets"],
                b["idx"], b["ws"], b["pos"], b["xs"], check=False)

        def split():
            lay(b["recv_ids"], b["recv_w"], b["recv_count"], None, b["offsets"], b["idx"],
                b["ws"], b["pos"], None, check=False)
            gk(g_src, g_idx_k, g_cnt_k, g_out, ncta, st)

        def layout_only():
            lay(b["recv_ids"], b["recv_w"], b["recv_count"], None, b["offsets"], b["idx"],
                b["ws"], b["pos"], None, check=False)

        def torch_layout_only():
            torch_expert_layout(lb, b["recv_ids"], b["recv_w"], b["recv_count"], E_l)

        print(f"  {name}: W={W} T_max={T_max} K={K} E_l={E_l} H={H} "
              f"(grids: count {lay.count_ctas}, place {lay.place_ctas})")
        for label, fn in (("torch expert_layout + GatherRows", torch_path),
                          ("Layout fused gather (2 launches)", fused),
                          ("Layout no gather + GatherRows", split),
                          ("torch expert_layout only", torch_layout_only),
                          ("Layout no gather only", layout_only)):
            h, d = _time(fn, iters)
            print(f"    {label:34s} host {h:8.1f} us   dev {d:8.1f} us   max {max(h, d):8.1f} us")
        if sweep:
            for mult in (1, 2, 4, 8):
                for cmult in (1, 2):
                    lay2 = Layout(cfg, dev, mult * nsm, cmult * nsm)

                    def fused2():
                        lay2(b["recv_ids"], b["recv_w"], b["recv_count"], b["recv_x"],
                             b["offsets"], b["idx"], b["ws"], b["pos"], b["xs"], check=False)
                    h, d = _time(fused2, iters)
                    print(f"    sweep fused place {mult}x SMs, count {cmult}x SMs: "
                          f"dev {d:8.1f} us (host {h:6.1f} us)")
        del b, lb, lay
        torch.cuda.empty_cache()


# =============================================================================================


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sim", action="store_true", help="torch model of the kernels (CPU ok)")
    p.add_argument("--calls", type=int, default=0, help="consecutive checked calls per case "
                   "(default 12 on GPU, 5 with --sim)")
    p.add_argument("--ctas", type=int, default=0, help="LayoutPlace grid cap (0: default)")
    p.add_argument("--drop-prob", type=float, default=0.05)
    p.add_argument("--iters", type=int, default=200, help="timed calls (GPU)")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time fused Layout over grid sizes")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not a.sim and not torch.cuda.is_available():
        print("no GPU: use --sim")
        return 2
    device = "cpu" if a.sim else "cuda"
    calls = a.calls or (5 if a.sim else 12)
    cases = SIM_CASES if a.sim else CASES
    print(f"checks ({'sim' if a.sim else 'kernels'}, {calls} consecutive calls per case)")
    fails: List[str] = []
    for i, case in enumerate(cases):
        fails += run_case(case, device, calls, a.seed + i, a.sim, a.ctas or None, a.drop_prob)
    # a tiny grid (many grid-stride iterations, few CTAs arriving) and a 1-CTA grid
    if not a.sim:
        fails += run_case((2, 1024, 8, 64, 2048), device, 6, 99, False, 3, a.drop_prob,
                          count_ctas=3)
        fails += run_case((2, 300, 4, 40, 256), device, 6, 98, False, 1, a.drop_prob,
                          count_ctas=1)
        fails += run_case((1, 8192, 8, 128, 2048), device, 4, 97, False, None, a.drop_prob)
    for f in fails[:20]:
        print("FAIL:", f)
    print("ALL OK" if not fails else f"FAILED ({len(fails)})")
    if not a.sim and not a.no_timing and not fails:
        timing(a.iters, a.ctas or None, a.sweep)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
