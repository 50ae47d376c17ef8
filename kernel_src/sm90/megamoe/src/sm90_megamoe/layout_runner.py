"""Check the expert-layout kernels (layout_kernels) against the torch reference, and time them.

    cd kernel_src/sm90/megamoe/src && python -m sm90_megamoe.layout_runner           # GPU
    python -m sm90_megamoe.layout_runner --sim          # torch model of the kernels, CPU ok
    python -m sm90_megamoe.layout_runner --no-timing --calls 20

Per case (several W / T_max / K / E_l / H, several chunk counts) the runner makes ``--calls``
consecutive calls on ONE Layout object, each with a different recv_count (including 0 and T_max
sources), fresh routing, garbage ids in the stale slots, stale garbage in offsets / idx / ws /
pos / xs AND in the counts scratch before the call (the kernels keep no state between calls);
calls alternate fused gather / no gather. After each call (device sync):
    * offsets, idx[:n], ws[:n], pos (valid slots) and xs[:n] equal ``ref_layout`` EXACTLY: the
      rows of each expert are its valid pairs in (slot, k) order, whatever the grid;
    * the same call repeated gives bit-identical outputs.
LocalRoute (one rank, ``Layout.route``): per W = 1 case, calls with T in {0, 1, 37, T_max},
int32 and int64 ids, out-of-range ids and non-finite weights mixed in: recv_ids / recv_w /
recv_count / dmask, the epoch + flag words and the first-bad-value record equal ``ref_route``
(EpDispatch's rules), and the layout from the caller's ``x`` equals ``ref_layout`` exactly.
Then the wait: with a source's dispatch flag behind the epoch, LayoutCount times out, err =
(1, source, WHERE_WAIT, epoch), offsets are all zero and nothing is placed.
Timing (GPU): host enqueue time per call and device time per call (device measured behind a
torch.cuda._sleep so that the host runs ahead), fused gather and layout only, over chunk counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace
from typing import List, Tuple

import torch

from .ep_constants import ERR_TIMEOUT, VERR_RESET, WHERE_WAIT
from .layout_reference import ref_layout, ref_route

# (W, T_max, K, E_l, H)
CASES: List[Tuple[int, int, int, int, int]] = [
    (1, 512, 8, 128, 2048),   # Qwen3 EP=1 (small T_max)
    (2, 1024, 8, 64, 2048),   # Qwen3 EP=2
    (2, 777, 2, 4, 4096),     # Mixtral EP=2, odd T_max
    (4, 300, 6, 16, 264),     # H % 256 != 0 (predicated last chunk), K = 6 (tile not 2^n)
    (3, 100, 1, 5, 64),       # K = 1, tiny rows
    (1, 64, 32, 33, 128),     # K = 32 (full warp), E_l not a multiple of 32
    (8, 40, 8, 256, 7168),    # E_l = 256, wide rows
    (2, 64, 8, 700, 256),     # E_l > 512: 256-thread CTAs, 22 experts per lane in the scan
]
SIM_CASES = CASES[:6]


class SimLayout:
    """Drop-in for ``layout_launch.Layout`` executing the contract with torch (host-synchronizing)."""

    def __init__(self, cfg, device, num_chunks=None):
        self.cfg = cfg
        self.num_chunks = num_chunks or 1
        self.counts = torch.zeros(self.num_chunks * cfg.local_experts, dtype=torch.int32, device=device)

    def __call__(self, bufs, offsets, idx, ws, pos, xs, stream=None, check=True):
        c = self.cfg
        if int(bufs.err[0]) == 0 and not bool((bufs.flags[:c.world] == bufs.ctrl[0]).all()):
            bad = int(torch.nonzero(bufs.flags[:c.world] != bufs.ctrl[0]).flatten()[0])
            bufs.err.copy_(torch.tensor([ERR_TIMEOUT, bad, WHERE_WAIT, int(bufs.ctrl[0])]))
        if int(bufs.err[0]) != 0:
            offsets.zero_()
            return
        ref = ref_layout(bufs.recv_ids, bufs.recv_w, bufs.recv_count, c.max_tokens,
                         c.local_experts, bufs.recv_x if xs is not None else None)
        n = ref["n"]
        offsets.copy_(ref["offsets"])
        idx[:n] = ref["idx"]
        ws[:n] = ref["ws"]
        slot_ok = _slot_valid(bufs.recv_count, c.world, c.max_tokens)
        pos[slot_ok] = ref["pos"][slot_ok]
        if xs is not None:
            xs[:n] = ref["xs"]

    def route(self, bufs, x, topk_ids, topk_w, offsets, idx, ws, pos, xs, stream=None, check=True):
        """LocalRoute step by step (a loop over the choices, as the kernel walks them; not
        ``ref_route``), then the layout with ``x`` as the row source."""
        c = self.cfg
        T, K, E = x.shape[0], c.topk, c.local_experts
        if int(bufs.err[0]) != 0:
            offsets.zero_()
            return
        epoch = int(bufs.ctrl[0]) + 1
        wbits = topk_w.contiguous().view(torch.int32).flatten()
        for t in range(T):
            any_ok = 0
            for k in range(K):
                key, gid = t * K + k, int(topk_ids[t, k])
                id_ok = 0 <= gid < E
                w_ok = (int(wbits[key]) & 0x7F800000) != 0x7F800000
                if not id_ok or not w_ok:  # the first bad choice of each kind, earliest forward
                    e_i = 0 if not id_ok else 3
                    if int(bufs.verr[e_i]) in (0, epoch):
                        bufs.verr[e_i] = epoch
                        bufs.verr[e_i + 1] = min(int(bufs.verr[e_i + 1]), key)
                ok = id_ok and w_ok
                bufs.recv_ids[t, k] = gid if ok else -1
                bufs.recv_w[t, k] = topk_w[t, k]
                any_ok |= int(ok)
            bufs.dmask[t] = any_ok
        if int(bufs.verr[0]) == epoch:
            bufs.verr[2] = int(topk_ids.flatten()[int(bufs.verr[1])])
        if int(bufs.verr[3]) == epoch:
            bufs.verr[5] = int(wbits[int(bufs.verr[4])])
        bufs.recv_count[0] = T
        bufs.flags[0] = epoch
        bufs.ctrl[0], bufs.ctrl[1] = epoch, 0
        src = SimpleNamespace(recv_ids=bufs.recv_ids, recv_w=bufs.recv_w, recv_count=bufs.recv_count,
                              recv_x=torch.zeros(c.max_tokens, c.hidden, dtype=torch.bfloat16),
                              flags=bufs.flags, ctrl=bufs.ctrl, err=bufs.err)
        src.recv_x[:T] = x
        self(src, offsets, idx, ws, pos, xs)


def _slot_valid(recv_count, W, T_max):
    t = torch.arange(T_max, device=recv_count.device).repeat(W)
    q = torch.arange(W, device=recv_count.device).repeat_interleave(T_max)
    return t < recv_count.long()[q]


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


def allocate(cfg, device):
    """The EP receive buffers the layout reads (an EpBuffers look-alike) and its outputs."""
    S, K, P, H, E_l, W = cfg.slots, cfg.topk, cfg.pairs, cfg.hidden, cfg.local_experts, cfg.world
    i32, f32, bf = torch.int32, torch.float32, torch.bfloat16
    bufs = SimpleNamespace(
        recv_ids=torch.empty(S, K, dtype=i32, device=device),
        recv_w=torch.empty(S, K, dtype=f32, device=device),
        recv_count=torch.empty(W, dtype=i32, device=device),
        recv_x=torch.empty(S, H, dtype=bf, device=device),
        flags=torch.zeros(2 * W, dtype=torch.int64, device=device),
        ctrl=torch.zeros(4, dtype=torch.int64, device=device),
        err=torch.zeros(4, dtype=i32, device=device))
    out = dict(offsets=torch.empty(E_l + 1, dtype=i32, device=device),
               idx=torch.empty(P, dtype=i32, device=device),
               ws=torch.empty(P, dtype=f32, device=device),
               pos=torch.empty(S, K, dtype=i32, device=device),
               xs=torch.empty(P, H, dtype=bf, device=device))
    return bufs, out


def fill_inputs(bufs, cfg, counts: torch.Tensor, g: torch.Generator, drop_prob: float, epoch: int):
    """Routing of the valid slots (ids in [-1, E_l), rare out-of-range ids), garbage in the
    stale slots, random weights and rows; every source's flag at ``epoch`` (the wait passes)."""
    S, K, E_l, T_max = cfg.slots, cfg.topk, cfg.local_experts, cfg.max_tokens
    dev = bufs.recv_ids.device
    ids = torch.randint(0, E_l, (S, K), generator=g, dtype=torch.int32)
    r = torch.rand(S, K, generator=g)
    ids[r < drop_prob] = -1
    ids[r > 1 - 0.002] = E_l + 3                    # out of range: must count as invalid
    garbage = torch.randint(-7, E_l + 7, (S, K), generator=g, dtype=torch.int32)
    stale = ~_slot_valid(counts, cfg.world, T_max).unsqueeze(1)
    bufs.recv_ids.copy_(torch.where(stale, garbage, ids).to(dev))
    bufs.recv_w.copy_(torch.rand(S, K, generator=g).to(dev))
    bufs.recv_count.copy_(counts.to(dev))
    bufs.recv_x.copy_(torch.randn(S, cfg.hidden, generator=g).to(torch.bfloat16).to(dev))
    bufs.ctrl[0] = epoch
    bufs.flags[:cfg.world] = epoch


def poison(out, counts_scratch, g: torch.Generator):
    for name in ("offsets", "idx", "pos"):
        t = out[name]
        t.copy_(torch.randint(-1000, 100000, tuple(t.shape), generator=g, dtype=torch.int32).to(t.device))
    out["ws"].copy_(torch.randn(tuple(out["ws"].shape), generator=g).to(out["ws"].device))
    out["xs"].copy_(torch.randn(tuple(out["xs"].shape), generator=g).to(torch.bfloat16).to(out["xs"].device))
    counts_scratch.copy_(torch.randint(-99, 99999, tuple(counts_scratch.shape), generator=g,
                                       dtype=torch.int32).to(counts_scratch.device))


def _eq(a, b):
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.shape == b.shape and torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def check_call(cfg, bufs, out, gather: bool) -> List[str]:
    ref = ref_layout(bufs.recv_ids, bufs.recv_w, bufs.recv_count, cfg.max_tokens, cfg.local_experts,
                     bufs.recv_x if gather else None)
    n = ref["n"]
    errs: List[str] = []
    if not torch.equal(out["offsets"], ref["offsets"]):
        return [f"offsets {out['offsets'][:8].tolist()}.. != {ref['offsets'][:8].tolist()}.."]
    slot_ok = _slot_valid(bufs.recv_count, cfg.world, cfg.max_tokens)
    checks = [("idx", out["idx"][:n], ref["idx"]), ("ws", out["ws"][:n], ref["ws"]),
              ("pos", out["pos"][slot_ok], ref["pos"][slot_ok])]
    if gather:
        checks.append(("xs", out["xs"][:n], ref["xs"]))
    for name, got, want in checks:
        if not _eq(got, want):
            bad = (got != want)
            if bad.dim() > 1:
                bad = bad.any(dim=-1)
            errs.append(f"{name}: {int(bad.sum())} entries differ from the stable order (first "
                        f"{torch.nonzero(bad).flatten()[:4].tolist()})")
    return errs


def run_case(case, device, calls: int, seed: int, sim: bool, num_chunks, drop_prob: float,
             verbose: bool = True) -> List[str]:
    from .layout_launch import Layout, LayoutConfig
    W, T_max, K, E_l, H = case
    cfg = LayoutConfig(H, K, W, T_max, E_l)
    lay = SimLayout(cfg, device, num_chunks) if sim else Layout(cfg, device, num_chunks)
    bufs, out = allocate(cfg, device)
    g = torch.Generator().manual_seed(seed)
    fails: List[str] = []
    t0 = time.time()
    for i in range(calls):
        counts = make_counts(W, T_max, i, g)
        fill_inputs(bufs, cfg, counts, g, drop_prob, epoch=i + 1)
        poison(out, lay.counts, g)
        gather = (i % 3) != 2
        lay(bufs, out["offsets"], out["idx"], out["ws"], out["pos"], out["xs"] if gather else None)
        if device != "cpu":
            torch.cuda.synchronize()
        errs = check_call(cfg, bufs, out, gather)
        if not errs and i % 4 == 0:  # the same call again: bit-identical
            first = {k: v.clone() for k, v in out.items()}
            poison(out, lay.counts, g)
            lay(bufs, out["offsets"], out["idx"], out["ws"], out["pos"], out["xs"] if gather else None)
            if device != "cpu":
                torch.cuda.synchronize()
            n = int(first["offsets"][-1])
            slot_ok = _slot_valid(bufs.recv_count, W, T_max)
            same = (torch.equal(first["offsets"], out["offsets"]) and _eq(first["idx"][:n], out["idx"][:n])
                    and _eq(first["ws"][:n], out["ws"][:n])
                    and torch.equal(first["pos"][slot_ok], out["pos"][slot_ok])
                    and (not gather or _eq(first["xs"][:n], out["xs"][:n])))
            if not same:
                errs.append("repeat of the same call is not bit-identical")
        if int(bufs.err[0]) != 0:
            errs.append(f"err set: {bufs.err.tolist()}")
        fails += [f"{case} chunks={lay.num_chunks} call {i} counts {counts.tolist()[:8]} "
                  f"gather={gather}: {e}" for e in errs]
    if verbose:
        print(f"  W={W} T_max={T_max:5d} K={K:2d} E_l={E_l:4d} H={H:5d} chunks {lay.num_chunks:4d}: "
              f"{calls} calls {'OK' if not fails else 'FAIL'} ({time.time() - t0:.1f}s)")
    return fails


def check_route(case, device, seed: int, sim: bool = False, verbose: bool = True) -> List[str]:
    """LocalRoute + LayoutPlace (``Layout.route``) against ``ref_route`` + ``ref_layout``."""
    from .layout_launch import Layout, LayoutConfig
    W, T_max, K, E, H = case
    cfg = LayoutConfig(H, K, W, T_max, E)
    lay = SimLayout(cfg, device) if sim else Layout(cfg, device, route=True)
    bufs, out = allocate(cfg, device)
    bufs.verr = torch.tensor(VERR_RESET, dtype=torch.int64, device=device)
    bufs.dmask = torch.full((T_max,), -5, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(seed)
    fails: List[str] = []
    t0 = time.time()
    for i, T in enumerate((1, 37 % (T_max + 1), 0, T_max, 5 % (T_max + 1), T_max)):
        wide = i % 2 == 1
        ids = torch.randint(0, E, (T, K), generator=g)
        w = torch.rand(T, K, generator=g)
        if T and i in (1, 3):       # bad ids (both signs) and a non-finite weight on a valid id
            ids.view(-1)[min(3, T * K - 1)] = E + 5
            ids.view(-1)[T * K - 1] = -2
            w.view(-1)[(T * K) // 2] = float("nan") if i == 1 else float("inf")
            if T > 1:
                ids[T - 2] = E + 1  # a token with no valid choice: dmask 0, no row
        ids = ids.to(torch.int64 if wide else torch.int32)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        if i == 3:
            bufs.verr.copy_(torch.tensor(VERR_RESET))  # a fresh record for this call
        verr0 = bufs.verr.clone()
        epoch0 = int(bufs.ctrl[0])
        poison(out, lay.counts, g)
        bufs.recv_ids.fill_(-77), bufs.recv_count.fill_(-1), bufs.dmask.fill_(-5)
        gather = i % 3 != 2
        d = lambda t: t.to(device)  # noqa: E731
        lay.route(bufs, d(x), d(ids), d(w), out["offsets"], out["idx"], out["ws"], out["pos"],
                  out["xs"] if gather else None)
        if device != "cpu":
            torch.cuda.synchronize()
        want = ref_route(ids, w, E)
        errs: List[str] = []
        if not torch.equal(bufs.recv_ids[:T].cpu(), want["recv_ids"]):
            errs.append("recv_ids")
        if not _eq(bufs.recv_w[:T].cpu(), w):
            errs.append("recv_w")
        if int(bufs.recv_count[0]) != T or not torch.equal(bufs.dmask[:T].cpu(), want["dmask"]):
            errs.append(f"recv_count {int(bufs.recv_count[0])} / dmask")
        if not (int(bufs.ctrl[0]) == epoch0 + 1 == int(bufs.flags[0]) and int(bufs.ctrl[1]) == 0):
            errs.append(f"epoch words ctrl {bufs.ctrl.tolist()} flags {bufs.flags.tolist()}")
        for kind, (e_i, k_i, v_i) in (("bad_id", (0, 1, 2)), ("bad_w", (3, 4, 5))):
            got = tuple(int(v) for v in bufs.verr[[e_i, k_i, v_i]].tolist())
            if int(verr0[e_i]) == 0 and want[kind] is not None:
                exp = (epoch0 + 1, *want[kind])
            else:  # an earlier forward's record (or none) stays as it was
                exp = tuple(int(v) for v in verr0[[e_i, k_i, v_i]].tolist())
            if got != exp:
                errs.append(f"verr {kind}: {got} != {exp}")
        ref_bufs = SimpleNamespace(recv_ids=bufs.recv_ids, recv_w=bufs.recv_w, recv_count=bufs.recv_count,
                                   recv_x=torch.zeros(T_max, H, dtype=torch.bfloat16, device=device))
        ref_bufs.recv_x[:T] = d(x)
        errs += check_call(cfg, ref_bufs, out, gather)
        fails += [f"route {case} call {i} T={T} int{64 if wide else 32}: {e}" for e in errs]
    if verbose:
        print(f"  route W=1 T_max={T_max:5d} K={K:2d} E={E:4d} H={H:5d} chunks {lay.num_chunks:4d}: "
              f"{'OK' if not fails else 'FAIL'} ({time.time() - t0:.1f}s)")
    return fails


def check_wait_timeout(device, sim: bool) -> List[str]:
    """A source's flag behind the epoch: LayoutCount must time out naming it, and LayoutPlace
    must place nothing (offsets all zero)."""
    from .layout_launch import Layout, LayoutConfig
    cfg = LayoutConfig(256, 4, 3, 64, 8)
    lay = SimLayout(cfg, device, 5) if sim else Layout(cfg, device, 5, timeout_ns=20_000_000)
    bufs, out = allocate(cfg, device)
    g = torch.Generator().manual_seed(5)
    fill_inputs(bufs, cfg, torch.full((3,), 64, dtype=torch.int32), g, 0.0, epoch=7)
    bufs.flags[2] = 6  # source 2 has not dispatched epoch 7
    poison(out, lay.counts, g)
    lay(bufs, out["offsets"], out["idx"], out["ws"], out["pos"], out["xs"])
    if device != "cpu":
        torch.cuda.synchronize()
    errs = []
    err = bufs.err.tolist()
    if err[:3] != [ERR_TIMEOUT, 2, WHERE_WAIT] or err[3] != 7:
        errs.append(f"wait timeout: err = {err}, expected [{ERR_TIMEOUT}, 2, {WHERE_WAIT}, 7]")
    if int(out["offsets"].abs().sum()) != 0:
        errs.append(f"wait timeout: offsets {out['offsets'].tolist()} should all be 0")
    print(f"  wait timeout naming source 2: {'OK' if not errs else 'FAIL'}")
    return errs


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


def timing(iters: int, num_chunks):
    from .ep_launch import device_num_sms
    from .layout_launch import Layout, LayoutConfig
    dev = "cuda"
    nsm = device_num_sms()
    shapes = [  # name, (W, T_max, K, E_l, H), tokens per source
        ("Qwen3 EP=1 8192 tok", (1, 8192, 8, 128, 2048), 8192),
        ("Qwen3 EP=1 2048 of 8192 tok", (1, 8192, 8, 128, 2048), 2048),
        ("Qwen3 EP=2 8192 tok", (2, 8192, 8, 64, 2048), 8192),
        ("Qwen3 EP=1 128 tok (decode)", (1, 8192, 8, 128, 2048), 128),
        ("Mixtral EP=2 8192 tok", (2, 8192, 2, 4, 4096), 8192),
    ]
    g = torch.Generator().manual_seed(7)
    print(f"timing ({iters} calls): host = enqueue us/call, dev = device us/call")
    for name, (W, T_max, K, E_l, H), T in shapes:
        cfg = LayoutConfig(H, K, W, T_max, E_l)
        bufs, out = allocate(cfg, dev)
        fill_inputs(bufs, cfg, torch.full((W,), T, dtype=torch.int32), g, 0.0, epoch=1)
        print(f"  {name}: W={W} T_max={T_max} K={K} E_l={E_l} H={H}")
        for chunks in ([num_chunks] if num_chunks else [nsm, 2 * nsm]):
            lay = Layout(cfg, dev, chunks)

            def fused():
                lay(bufs, out["offsets"], out["idx"], out["ws"], out["pos"], out["xs"], check=False)

            def layout_only():
                lay(bufs, out["offsets"], out["idx"], out["ws"], out["pos"], None, check=False)

            fns = [("fused gather (2 launches)", fused), ("layout only", layout_only)]
            if W == 1:  # LocalRoute + place: replaces the dispatch AND the count (no recv_x copy)
                lay = Layout(cfg, dev, chunks, route=True)
                bufs.verr = torch.tensor(VERR_RESET, dtype=torch.int64, device=dev)
                bufs.dmask = torch.zeros(T_max, dtype=torch.int32, device=dev)
                x = torch.randn(T, H, device=dev).to(torch.bfloat16)
                ids = torch.randint(0, E_l, (T, K), device=dev, dtype=torch.int32)
                w = torch.rand(T, K, device=dev)

                def routed():
                    lay.route(bufs, x, ids, w, out["offsets"], out["idx"], out["ws"], out["pos"], out["xs"],
                              check=False)
                fns.append(("route + gather (2 launches)", routed))
            for label, fn in fns:
                h, d = _time(fn, iters)
                print(f"    {chunks:4d} chunks  {label:26s} host {h:8.1f} us   dev {d:8.1f} us")
            del lay
        del bufs, out
        torch.cuda.empty_cache()


# =============================================================================================


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sim", action="store_true", help="torch model of the kernels (CPU ok)")
    p.add_argument("--calls", type=int, default=0, help="consecutive checked calls per case "
                   "(default 12 on GPU, 5 with --sim)")
    p.add_argument("--chunks", type=int, default=0, help="chunks = grid of both kernels (0: #SMs)")
    p.add_argument("--drop-prob", type=float, default=0.05)
    p.add_argument("--iters", type=int, default=200, help="timed calls (GPU)")
    p.add_argument("--no-timing", action="store_true")
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
        fails += run_case(case, device, calls, a.seed + i, a.sim, a.chunks or None, a.drop_prob)
    if not a.sim:  # other chunk counts: 1 chunk, 3 chunks, more chunks than SMs
        for j, (case, chunks) in enumerate((((2, 1024, 8, 64, 2048), 3), ((2, 300, 4, 40, 256), 1),
                                            ((1, 8192, 8, 128, 2048), 264), ((1, 8192, 8, 128, 2048), 7))):
            fails += run_case(case, device, 5, 90 + j, False, chunks, a.drop_prob)
    for j, case in enumerate(c for c in cases if c[0] == 1):  # one rank without a dispatch (LocalRoute)
        fails += check_route(case, device, 70 + j, sim=a.sim)
    fails += check_wait_timeout(device, a.sim)
    for f in fails[:20]:
        print("FAIL:", f)
    print("ALL OK" if not fails else f"FAILED ({len(fails)})")
    if not a.sim and not a.no_timing and not fails:
        timing(a.iters, a.chunks or None)
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(main())
