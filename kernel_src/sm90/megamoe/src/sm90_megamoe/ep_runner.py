"""Standalone runner of the EP kernels with W VIRTUAL ranks in one process on one GPU.

Each virtual rank owns its own EP buffers (plain cudaMalloc memory of the same GPU), its own
CUDA stream and a peer table holding the other virtual ranks' buffer addresses. Grids are kept
small (default #SMs / W / 2 CTAs per kernel) so that all ranks' CTAs co-reside and the
spin-waits cannot deadlock.

    python -m sm90_megamoe.ep_runner --world 2 --tokens 4096 --hidden 2048 --experts 128 --topk 8
    python -m sm90_megamoe.ep_runner --world 4 --uneven --forwards 4        # T per rank incl. 0
    python -m sm90_megamoe.ep_runner --world 2 --stall 1                    # must report err 1
    python -m sm90_megamoe.ep_runner --world 2 --sim                        # torch model, CPU ok
    python -m sm90_megamoe.ep_runner --world 2 --bad-prob 0.01 --ids64      # bad ids / weights
    python -m sm90_megamoe.ep_runner --suite                                # all GPU checks

Per forward, phase by phase over the ranks (each rank on its own stream, no host sync):
    dispatch -> Layout (wait + count, place + row gather) -> expert (torch, weighted)
    -> CombineSend -> CombineReduce
Checks (after a device sync, outside the forward): err == 0, received buffers == ref_dispatch,
the layout == layout_reference.ref_layout exactly (deterministic row order), outputs ==
ref_forward bitwise, epochs / flags advanced by one, arrival counters back at 0, and the
recorded bad inputs (verr) == ep_reference.first_bad_values.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import torch

from .ep_constants import (
    CTRL_COMBINE_ARRIVE,
    CTRL_DISPATCH_ARRIVE,
    CTRL_EPOCH,
    DEFAULT_TIMEOUT_NS,
    ERR_TIMEOUT,
    WHERE_WAIT,
)
from .ep_reference import (
    dest_mask,
    expert_layout,
    expert_scaled,
    first_bad_values,
    ref_combine_reduce,
    ref_combine_send_partials,
    ref_dispatch,
    ref_forward,
    ref_gather,
    valid_choices,
)
from .layout_reference import ref_layout


# =============================================================================================
# Torch model of the kernels (``--sim``): same buffers and protocol, runs on CPU too
# =============================================================================================


class SimRank:
    """Drop-in for ``ep_launch.EpRank`` that executes the kernels' semantics with torch (for
    checking the runner / reference plumbing without a GPU). Host-synchronizing."""

    def __init__(self, cfg, rank, all_bufs, timeout_ns=DEFAULT_TIMEOUT_NS):
        self.cfg, self.rank, self.all = cfg, rank, all_bufs
        self.bufs = all_bufs[rank]

    def _err(self, code, peer, where, aux):
        if int(self.bufs.err[0]) == 0:
            self.bufs.err.copy_(torch.tensor([code, peer, where, aux], dtype=torch.int32))

    def dispatch(self, x, topk_ids, topk_w, stream=None):
        cfg, r = self.cfg, self.rank
        if int(self.bufs.err[0]) != 0:
            return
        T, E_l = x.shape[0], cfg.local_experts
        e = int(self.bufs.ctrl[CTRL_EPOCH]) + 1
        g = topk_ids.long()
        ok = valid_choices(topk_ids, topk_w, cfg.num_experts)
        dest = torch.div(g.clamp(min=0), E_l, rounding_mode="floor")
        lo = r * cfg.max_tokens
        for d, b in enumerate(self.all):
            on_d = ok & (dest == d)
            b.recv_ids[lo:lo + T] = torch.where(on_d, g - d * E_l, torch.full_like(g, -1)).int()
            b.recv_w[lo:lo + T] = topk_w
            m = on_d.any(dim=1)
            rows = torch.nonzero(m).flatten()
            b.recv_x[lo + rows] = x[rows]
        self.bufs.dmask[:T] = dest_mask(topk_ids, topk_w, cfg.world, cfg.num_experts)
        bad = first_bad_values(topk_ids, topk_w, cfg.num_experts)
        for (ep_i, key_i, val_i), name in (((0, 1, 2), "topk_ids"), ((3, 4, 5), "topk_weights")):
            if bad[name] is not None and int(self.bufs.verr[ep_i]) in (0, e):
                t, k, v = bad[name]
                if t * cfg.topk + k < int(self.bufs.verr[key_i]):
                    self.bufs.verr[ep_i] = e
                    self.bufs.verr[key_i] = t * cfg.topk + k
                    self.bufs.verr[val_i] = (v if name == "topk_ids" else
                                             int(torch.tensor([v]).view(torch.int32)[0]))
        for b in self.all:
            b.recv_count[r] = T
            b.flags[r] = e
        self.bufs.ctrl[CTRL_EPOCH] = e

    def wait(self, stream=None):
        if int(self.bufs.err[0]) != 0:
            return
        e = int(self.bufs.ctrl[CTRL_EPOCH])
        for s in range(self.cfg.world):
            if int(self.bufs.flags[s]) != e:
                self._err(ERR_TIMEOUT, s, WHERE_WAIT, e)
                return

    def gather(self, src, idx, count, out, stream=None):
        n = min(int(count.view(-1)[0]), idx.shape[0])
        out[:n] = ref_gather(src, idx, n)

    def combine_send(self, y, pos, stream=None, weighted=False):
        cfg, r = self.cfg, self.rank
        if int(self.bufs.err[0]) != 0:
            return
        part = ref_combine_send_partials(y, pos)
        any_k = (pos >= 0).any(dim=1)
        e = int(self.bufs.ctrl[CTRL_EPOCH])
        for q in range(cfg.world):
            T = int(self.bufs.recv_count[q])
            lo = q * cfg.max_tokens
            rows = torch.nonzero(any_k[lo:lo + T]).flatten()
            self.all[q].comb[r * cfg.max_tokens + rows] = part[lo + rows]
        for b in self.all:
            b.flags[cfg.world + r] = e

    def combine_reduce(self, out, stream=None):
        cfg = self.cfg
        if int(self.bufs.err[0]) != 0:
            return
        e = int(self.bufs.ctrl[CTRL_EPOCH])
        for d in range(cfg.world):
            if int(self.bufs.flags[cfg.world + d]) != e:
                self._err(ERR_TIMEOUT, d, 4, e)
                return
        T = out.shape[0]
        out.copy_(ref_combine_reduce(self.bufs.dmask[:T], self.bufs.comb, cfg.world, cfg.max_tokens))

    def read_err(self):
        return tuple(int(v) for v in self.bufs.err.cpu())

    def read_verr(self):
        from .ep_launch import EpRank
        return EpRank.read_verr(self)

    def reset_verr(self):
        from .ep_constants import VERR_RESET
        self.bufs.verr.copy_(torch.tensor(VERR_RESET, dtype=torch.int64))

    def reset_state(self):
        for t in (self.bufs.flags, self.bufs.recv_count, self.bufs.ctrl, self.bufs.err):
            t.zero_()


# =============================================================================================
# Virtual EP world
# =============================================================================================


class VirtualEP:
    def __init__(self, cfg, device, num_ctas: int, timeout_ns: int, sim: bool = False):
        from .ep_launch import EpBuffers, EpRank, build_peer_table

        self.cfg, self.device, self.sim = cfg, device, sim
        W, S, K, H = cfg.world, cfg.slots, cfg.topk, cfg.hidden
        self.bufs = [EpBuffers.allocate(cfg, device) for _ in range(W)]
        if sim:
            self.ranks = [SimRank(cfg, r, self.bufs, timeout_ns) for r in range(W)]
            self.streams = [None] * W
        else:
            table = build_peer_table(self.bufs, device)  # same address space for every rank
            t0 = time.time()
            self.ranks = [EpRank(cfg, r, self.bufs[r], table, num_ctas=num_ctas,
                                 timeout_ns=timeout_ns) for r in range(W)]
            from .layout_launch import Layout, LayoutConfig
            lcfg = LayoutConfig(H, K, W, cfg.max_tokens, cfg.local_experts)
            self.layout_k = [Layout(lcfg, device, num_chunks=num_ctas, timeout_ns=timeout_ns)
                             for _ in range(W)]
            print(f"compiled / loaded EP + layout kernels in {time.time() - t0:.2f}s")
            self.streams = [torch.cuda.Stream(device=device) for _ in range(W)]
        i32 = torch.int32
        self.lay_bufs = [dict(offsets=torch.zeros(cfg.local_experts + 1, dtype=i32, device=device),
                              idx=torch.zeros(S * K, dtype=i32, device=device),
                              ws=torch.zeros(S * K, dtype=torch.float32, device=device),
                              pos=torch.full((S, K), -1, dtype=i32, device=device))
                         for _ in range(W)]
        self.xg = [torch.empty(S * K, H, dtype=torch.bfloat16, device=device) for _ in range(W)]
        self.out = [torch.empty(cfg.max_tokens, H, dtype=torch.bfloat16, device=device)
                    for _ in range(W)]

    def _ctx(self, r):
        s = self.streams[r]
        return torch.cuda.stream(s) if s is not None else _nullctx()

    def poison(self):
        for b, xg, out in zip(self.bufs, self.xg, self.out):
            b.recv_x.fill_(float("nan"))
            b.comb.fill_(float("nan"))
            b.recv_ids.fill_(-2)
            b.recv_w.fill_(float("nan"))
            xg.fill_(float("nan"))
            out.fill_(float("nan"))

    def forward(self, xs, ids, ws, scale, stall: Optional[int] = None, ev=None, join=False):
        """Enqueue one forward of every (non-stalled) rank. No host sync in CUDA mode.
        ev: optional dict of per-rank event lists for timing; join: device-side barrier of all
        streams between the dispatch and combine phases (timing only)."""
        cfg = self.cfg
        W, E_l = cfg.world, cfg.local_experts
        live = [r for r in range(W) if r != stall]
        if not self.sim:
            main = torch.cuda.current_stream()
            for r in live:
                self.streams[r].wait_stream(main)
        for r in live:  # phase 1: dispatch + wait
            with self._ctx(r):
                if ev is not None:
                    ev["d0"][r].record()
                self.ranks[r].dispatch(xs[r], ids[r], ws[r], stream=self.streams[r])
        ys = [None] * W
        for r in live:  # phase 2: wait + expert layout (+ row gather), expert
            with self._ctx(r):
                b, lb = self.bufs[r], self.lay_bufs[r]
                if self.sim:  # torch model: wait, stable-sort layout, gather
                    self.ranks[r].wait(stream=self.streams[r])
                    lay = expert_layout(b.recv_ids, b.recv_count, b.recv_w, cfg.max_tokens, E_l, r)
                    lb["offsets"].copy_(lay["offsets"])
                    lb["idx"].copy_(lay["idx"])
                    lb["ws"].copy_(lay["weight"])
                    lb["pos"].copy_(lay["pos"])
                    self.ranks[r].gather(b.recv_x, lb["idx"], lb["offsets"][E_l:], self.xg[r])
                else:
                    self.layout_k[r](b, lb["offsets"], lb["idx"], lb["ws"], lb["pos"], self.xg[r],
                                     stream=self.streams[r])
                if ev is not None:
                    ev["d1"][r].record()
                rows = torch.arange(lb["idx"].shape[0], dtype=torch.int32, device=self.device)
                expert = torch.searchsorted(lb["offsets"][1:], rows, right=True).clamp(max=E_l - 1)
                ys[r] = expert_scaled(self.xg[r], expert + r * E_l, lb["ws"], scale)
        if join and not self.sim:
            evs = []
            for r in live:
                e = torch.cuda.Event()
                e.record(self.streams[r])
                evs.append(e)
            for r in live:
                for e in evs:
                    self.streams[r].wait_event(e)
        for r in live:  # phase 3: combine
            with self._ctx(r):
                if ev is not None:
                    ev["c0"][r].record()
                self.ranks[r].combine_send(ys[r], self.lay_bufs[r]["pos"], stream=self.streams[r])
        for r in live:
            with self._ctx(r):
                T = xs[r].shape[0]
                self.ranks[r].combine_reduce(self.out[r][:T], stream=self.streams[r])
                if ev is not None:
                    ev["c1"][r].record()
        if not self.sim:
            main = torch.cuda.current_stream()
            for r in live:
                main.wait_stream(self.streams[r])
        return [self.out[r][:xs[r].shape[0]] for r in range(W)]


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# =============================================================================================
# Inputs, checks, timing
# =============================================================================================


def make_inputs(W, Ts, H, E, K, seed, drop_prob, device, bad_prob=0.0, ids64=False):
    """Random tokens and routing; ``drop_prob`` of the choices get id -1; ``bad_prob`` of them
    get an out-of-range id (E, E + 5, a huge int64 / int32 value, a negative one) or a NaN / inf
    weight."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(W):
        T = Ts[r]
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        i = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int64 if ids64 else torch.int32)
        if drop_prob > 0:
            i[torch.rand(T, K, generator=g) < drop_prob] = -1
        w = torch.softmax(torch.randn(T, K, generator=g), dim=1).float()
        if bad_prob > 0:
            huge = 2**40 + 3 if ids64 else 2**31 - 1
            pick = torch.rand(T, K, generator=g)
            choice = torch.randint(0, 6, (T, K), generator=g)
            bad_ids = torch.tensor([E, E + 5, huge, -7], dtype=i.dtype)[choice.clamp(max=3)]
            i = torch.where((pick < bad_prob) & (choice < 4), bad_ids, i)
            w = torch.where((pick < bad_prob) & (choice == 4), torch.full_like(w, float("nan")), w)
            w = torch.where((pick < bad_prob) & (choice == 5), torch.full_like(w, float("inf")), w)
        xs.append(x.to(device))
        ids.append(i.to(device).contiguous())
        ws.append(w.to(device).contiguous())
    return xs, ids, ws


def token_counts(W, T_max, forward_idx, uneven):
    if not uneven:
        return [T_max] * W
    pats = [T_max, 0, T_max // 2 + 1, max(1, T_max // 3), T_max - 1, 1, T_max // 4, 7]
    return [max(0, min(T_max, pats[(r + forward_idx) % len(pats)])) for r in range(W)]


def sent_bytes(cfg, ids):
    """(total, remote) dispatch payload bytes of every rank (rows x H x 2)."""
    out = []
    for r, i in enumerate(ids):
        g = i.long()
        ok = (g >= 0) & (g < cfg.num_experts)
        dest = torch.div(g.clamp(min=0), cfg.local_experts, rounding_mode="floor")
        total = remote = 0
        for d in range(cfg.world):
            n = int((ok & (dest == d)).any(dim=1).sum())
            total += n
            if d != r:
                remote += n
        out.append((total * cfg.hidden * 2, remote * cfg.hidden * 2))
    return out


def _eq(a, b):
    """Bitwise equality (NaN-safe) of two tensors of the same dtype."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def check_forward(vep, xs, ids, ws, scale, outs, epoch) -> List[str]:
    cfg = vep.cfg
    W, T_max, E = cfg.world, cfg.max_tokens, cfg.num_experts
    bad = []
    for r in range(W):
        err = vep.ranks[r].read_err()
        if err[0] != 0:
            bad.append(f"rank {r}: err={err}")
    if bad:
        return bad
    exp = ref_dispatch(xs, ids, ws, T_max, E)
    for d in range(W):
        b, e = vep.bufs[d], exp[d]
        if not torch.equal(b.recv_count, e["recv_count"]):
            bad.append(f"rank {d}: recv_count {b.recv_count.tolist()} != {e['recv_count'].tolist()}")
        v = e["slot_valid"]
        if not torch.equal(b.recv_ids[v], e["recv_ids"][v]):
            bad.append(f"rank {d}: recv_ids mismatch "
                       f"({int((b.recv_ids[v] != e['recv_ids'][v]).sum())} entries)")
        if not _eq(b.recv_w[v], e["recv_w"][v]):
            bad.append(f"rank {d}: recv_w mismatch")
        m = e["row_mask"]
        if not _eq(b.recv_x[m], e["recv_x"][m]):
            bad.append(f"rank {d}: recv_x mismatch "
                       f"({int((b.recv_x[m] != e['recv_x'][m]).any(dim=1).sum())} rows)")
        ctrl, flags = b.ctrl.tolist(), b.flags.tolist()
        if ctrl[CTRL_EPOCH] != epoch or ctrl[CTRL_DISPATCH_ARRIVE] or ctrl[CTRL_COMBINE_ARRIVE]:
            bad.append(f"rank {d}: ctrl {ctrl} (expected epoch {epoch}, counters 0)")
        if any(f != epoch for f in flags):
            bad.append(f"rank {d}: flags {flags} != {epoch}")
    for d in range(W):  # the layout: exactly the stable (expert, slot, k) order
        b, lb = vep.bufs[d], vep.lay_bufs[d]
        ref = ref_layout(b.recv_ids, b.recv_w, b.recv_count, T_max, cfg.local_experts, b.recv_x)
        n = ref["n"]
        slot_ok = exp[d]["slot_valid"]
        if not torch.equal(lb["offsets"], ref["offsets"]):
            bad.append(f"rank {d}: layout offsets differ")
            continue
        for name in ("idx", "ws"):
            if not _eq(lb[name][:n], ref[name]):
                bad.append(f"rank {d}: layout {name} differs from the stable order")
        if not torch.equal(lb["pos"][slot_ok], ref["pos"][slot_ok]):
            bad.append(f"rank {d}: layout pos differs on valid slots")
        if not _eq(vep.xg[d][:n], ref["xs"]):
            bad.append(f"rank {d}: gathered rows differ")
    for r in range(W):  # first bad input of this forward, then forget it
        got = vep.ranks[r].read_verr()
        want = first_bad_values(ids[r], ws[r], E) if xs[r].shape[0] else {"topk_ids": None, "topk_weights": None}
        for name in ("topk_ids", "topk_weights"):
            g, w = got[name], want[name]
            same = (g is None and w is None) or (g is not None and w is not None and g[0] == epoch
                                                 and g[1:3] == w[:2] and
                                                 (g[3] == w[2] or (g[3] != g[3] and w[2] != w[2])))
            if not same:
                bad.append(f"rank {r}: verr {name} = {g}, expected {w} at epoch {epoch}")
        vep.ranks[r].reset_verr()
    ref = ref_forward(xs, ids, ws, E, scale)
    for r in range(W):
        if not _eq(outs[r], ref[r]):
            diff = (outs[r].float() - ref[r].float()).abs()
            bad.append(f"rank {r}: output mismatch: max|diff| {diff.nan_to_num(float('inf')).max().item():.3e}, "
                       f"{int((diff != 0).any(dim=1).sum())}/{outs[r].shape[0]} rows, "
                       f"nan rows {int(outs[r].isnan().any(dim=1).sum())}")
    return bad


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="T_max (and T unless --uneven)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--forwards", type=int, default=3, help="checked consecutive forwards")
    p.add_argument("--uneven", action="store_true", help="vary T per rank, including 0")
    p.add_argument("--drop-prob", type=float, default=0.02, help="fraction of choices set to -1")
    p.add_argument("--bad-prob", type=float, default=0.0,
                   help="fraction of choices with an out-of-range id or a NaN / inf weight")
    p.add_argument("--ids64", action="store_true", help="int64 expert ids")
    p.add_argument("--expert", choices=("identity", "scaled"), default="scaled")
    p.add_argument("--ctas", type=int, default=0, help="CTAs per kernel (0: #SMs / W / 2)")
    p.add_argument("--timeout-ms", type=float, default=5000.0)
    p.add_argument("--iters", type=int, default=20, help="timed forwards (0: skip timing)")
    p.add_argument("--stall", type=int, default=-1, help="after the checks, run a forward in "
                   "which this rank sends nothing; every other rank must report err 1 naming it")
    p.add_argument("--stall-timeout-ms", type=float, default=200.0)
    p.add_argument("--sim", action="store_true", help="torch model of the kernels (no GPU needed)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    from .ep_launch import EpConfig

    sim = a.sim
    device = torch.device("cpu") if (sim and not torch.cuda.is_available()) else torch.device("cuda")
    cfg = EpConfig(hidden=a.hidden, topk=a.topk, world=a.world, max_tokens=a.tokens,
                   num_experts=a.experts)
    W = cfg.world
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    ctas = a.ctas or max(1, sms // W // 2)
    print(f"EP virtual ranks: W={W} T_max={a.tokens} H={a.hidden} E={a.experts} K={a.topk} "
          f"ctas/kernel={ctas} sim={sim} device={device}")
    vep = VirtualEP(cfg, device, ctas, int(a.timeout_ms * 1e6), sim=sim)
    g = torch.Generator().manual_seed(a.seed + 1000)
    scale = (torch.ones(a.experts) if a.expert == "identity"
             else 0.5 + torch.rand(a.experts, generator=g)).float().to(device)

    ok = True
    for f in range(a.forwards):
        Ts = token_counts(W, a.tokens, f, a.uneven)
        xs, ids, ws = make_inputs(W, Ts, a.hidden, a.experts, a.topk, a.seed + f, a.drop_prob,
                                  device, a.bad_prob, a.ids64)
        vep.poison()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = vep.forward(xs, ids, ws, scale)
        t_enq = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.synchronize()
        bad = check_forward(vep, xs, ids, ws, scale, outs, epoch=f + 1)
        status = "OK" if not bad else "FAIL"
        print(f"forward {f}: T={Ts} {status} (host enqueue {t_enq * 1e3:.2f} ms)")
        for line in bad:
            print("   ", line)
        ok &= not bad
        if bad:
            break

    if ok and a.iters > 0 and not sim:
        Ts = [a.tokens] * W
        xs, ids, ws = make_inputs(W, Ts, a.hidden, a.experts, a.topk, a.seed + 99, 0.0, device)
        nb = sent_bytes(cfg, ids)
        for _ in range(3):
            vep.forward(xs, ids, ws, scale, join=True)
        torch.cuda.synchronize()
        mk = lambda: [torch.cuda.Event(enable_timing=True) for _ in range(W)]  # noqa: E731
        evs = [{k: mk() for k in ("d0", "d1", "c0", "c1")} for _ in range(a.iters)]
        t0 = time.perf_counter()
        for i in range(a.iters):
            vep.forward(xs, ids, ws, scale, ev=evs[i], join=True)
        t_host = (time.perf_counter() - t0) / a.iters
        torch.cuda.synchronize()
        errs = [vep.ranks[r].read_err() for r in range(W)]
        if any(e[0] for e in errs):
            print("timing run errors:", errs)
            ok = False
        d_ms, c_ms = [], []
        for e in evs:
            d_ms.append(max(e["d0"][0].elapsed_time(e["d1"][r]) for r in range(W)))
            c_ms.append(max(e["c0"][0].elapsed_time(e["c1"][r]) for r in range(W)))
        d_ms.sort(), c_ms.sort()
        dm, cm = d_ms[len(d_ms) // 2], c_ms[len(c_ms) // 2]
        tot = sum(b[0] for b in nb)
        rem = sum(b[1] for b in nb)
        print(f"timing (median of {a.iters}, all {W} ranks concurrently on ONE GPU):")
        print(f"  dispatch+layout{dm * 1e3:8.1f} us  payload {tot / 1e6:.1f} MB "
              f"({rem / 1e6:.1f} MB to other ranks) -> {tot / dm / 1e6:.1f} GB/s aggregate, "
              f"{tot / W / dm / 1e6:.1f} GB/s per rank")
        print(f"  combine        {cm * 1e3:8.1f} us  payload {tot / 1e6:.1f} MB "
              f"-> {tot / cm / 1e6:.1f} GB/s aggregate, {tot / W / cm / 1e6:.1f} GB/s per rank")
        print(f"  host enqueue of one forward (all ranks, incl. torch expert ops): "
              f"{t_host * 1e6:.0f} us; {W * 5} EP + layout kernel launches")
        print("  (one GPU: 'bandwidth' is HBM copy bandwidth shared by all virtual ranks)")

    if a.stall >= 0:
        assert W >= 2 and 0 <= a.stall < W, "--stall needs W >= 2 and a valid rank"
        for r in range(W):
            vep.ranks[r].timeout_ns = int(a.stall_timeout_ms * 1e6)
        Ts = token_counts(W, a.tokens, 0, a.uneven)
        xs, ids, ws = make_inputs(W, Ts, a.hidden, a.experts, a.topk, a.seed + 7, 0.0, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        vep.forward(xs, ids, ws, scale, stall=a.stall)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        errs = [vep.ranks[r].read_err() for r in range(W)]
        print(f"stall rank {a.stall}: forward returned after {dt * 1e3:.0f} ms "
              f"(timeout {a.stall_timeout_ms:.0f} ms); err per rank {errs}")
        for r in range(W):
            if r == a.stall:
                continue
            if errs[r][0] != ERR_TIMEOUT or errs[r][1] != a.stall:
                print(f"    FAIL: rank {r} should report (1, {a.stall}, ...)")
                ok = False
        if ok:
            print("stall: OK (every live rank reported a timeout naming the stalled rank)")
        if device.type == "cuda":
            torch.cuda.synchronize()
        for r in range(W):
            vep.ranks[r].reset_state()
        if device.type == "cuda":
            torch.cuda.synchronize()

    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


SUITE = [
    # (description, argv)
    ("EP=1 Qwen3 shape", "--world 1 --tokens 4096 --iters 10"),
    ("EP=2 Qwen3 shape + stall", "--world 2 --tokens 4096 --iters 20 --stall 1"),
    ("EP=4 uneven T incl. 0, H%256!=0, K=6, stall rank 0",
     "--world 4 --tokens 1000 --hidden 2056 --experts 64 --topk 6 --uneven --forwards 6 "
     "--iters 0 --stall 0"),
    ("EP=8 uneven, stall rank 5",
     "--world 8 --tokens 2048 --uneven --forwards 8 --iters 10 --stall 5"),
    ("EP=2 Mixtral shape (H 4096, E 8, K 2)",
     "--world 2 --tokens 8192 --hidden 4096 --experts 8 --topk 2 --iters 10"),
    ("EP=8 H 7168 (DeepSeek width)",
     "--world 8 --tokens 512 --hidden 7168 --experts 256 --topk 8 --forwards 3 --iters 5"),
    ("EP=4 tiny rows (H 64), uneven", "--world 4 --tokens 64 --hidden 64 --experts 16 --topk 8 "
     "--uneven --forwards 8 --iters 0"),
    ("EP=2 identity experts, 30% dropped choices",
     "--world 2 --tokens 128 --expert identity --drop-prob 0.3 --forwards 4 --iters 0"),
    ("EP=2 bad ids / NaN / inf weights, int32 ids",
     "--world 2 --tokens 300 --uneven --bad-prob 0.01 --forwards 4 --iters 0"),
    ("EP=4 bad values, int64 ids (huge ids must not wrap)",
     "--world 4 --tokens 200 --bad-prob 0.02 --ids64 --forwards 4 --iters 0"),
]


def suite() -> int:
    results = []
    for desc, argv in SUITE:
        print(f"\n===== {desc}: {argv}")
        rc = main(argv.split())
        results.append((desc, rc))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print("\n===== suite summary")
    for desc, rc in results:
        print(f"  {'OK  ' if rc == 0 else 'FAIL'} {desc}")
    return 0 if all(rc == 0 for _, rc in results) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--suite":
        sys.exit(suite())
    sys.exit(main())
