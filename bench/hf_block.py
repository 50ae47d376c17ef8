"""``python -m moe_ep.bench hf`` — one Qwen3-MoE-shaped MoE block (router + experts,
transformers' ``Qwen3MoeSparseMoeBlock``) run through transformers' experts registry: moe_ep vs
transformers' ``grouped_mm`` experts (and ``sonicmoe`` when it loads), same weights, same inputs,
eager and CUDA graph, at 8192 and 128 tokens (``--tokens`` overrides). Reports ms and tokens/s,
with the ratio to ``grouped_mm`` measured in the same run.
"""

from __future__ import annotations

import warnings


def _time_ms(fn, iters: int, graph: bool) -> float:
    """Median ms of ``fn`` (eager) or of its CUDA-graph replay (captured after a warm-up)."""
    import torch

    from moe_ep.api import EPGroup

    from .ep import _time

    if graph:
        fn()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return _time(fn, EPGroup.single(), iters)


def run_hf(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("moe_ep.bench hf: needs a CUDA GPU; nothing to do here")
        return 0
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        print(f"moe_ep.bench hf: needs transformers >= 5 ({e})")
        return 1
    import moe_ep.integrations.transformers as moe_ep_hf
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    moe_ep_hf.register("moe_ep", backend=(args.backend or ["auto"])[0])
    impls = ["moe_ep", "grouped_mm"] + (["sonicmoe"] if "sonicmoe" in ALL_EXPERTS_FUNCTIONS else [])
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(args.seed)
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 2048 ** -0.5)
        block.experts.down_proj.normal_(0, 768 ** -0.5)
        block.gate.weight.normal_(0, 2048 ** -0.5)
    token_counts = [args.tokens] if args.tokens is not None else [8192, 128]
    print(f"\ntransformers Qwen3MoeSparseMoeBlock (H 2048, I 768, 128 experts, top-8), bf16, "
          f"GPU {torch.cuda.get_device_name()}, median of {args.iters}")
    print(f"{'experts_implementation':<24}{'tokens':>7}{'eager ms':>10}{'tok/s':>12}{'graph ms':>10}{'tok/s':>12}"
          f"{'vs grouped_mm':>15}")
    for T in token_counts:
        x = torch.randn(1, T, 2048, device="cuda").to(torch.bfloat16)
        res, outs = {}, {}
        for impl in impls:
            cfg._experts_implementation = impl
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    outs[impl] = block(x).float()
                    fn = lambda: block(x)  # noqa: E731
                    eager = _time_ms(lambda: torch.no_grad()(fn)(), args.iters, graph=False)
                    try:
                        graph = _time_ms(lambda: torch.no_grad()(fn)(), args.iters, graph=True)
                    except Exception as e:  # noqa: BLE001 - an implementation that cannot be captured
                        graph = float("nan")
                        print(f"  ({impl}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]})")
                res[impl] = (eager, graph)
            except Exception as e:  # noqa: BLE001
                print(f"  {impl}: FAILED {type(e).__name__}: {str(e)[:200]}")
        base = res.get("grouped_mm")
        for impl, (eager, graph) in res.items():
            ratio = f"{base[0] / eager:.2f}x / {base[1] / graph:.2f}x" if base else "n/a"
            print(f"{impl:<24}{T:>7}{eager:>10.3f}{T / eager * 1e3:>12.0f}{graph:>10.3f}{T / graph * 1e3:>12.0f}"
                  f"{ratio:>15}")
        if "moe_ep" in outs and "grouped_mm" in outs:
            d = (outs["moe_ep"] - outs["grouped_mm"]).norm() / outs["grouped_mm"].norm()
            print(f"  moe_ep vs grouped_mm output: rel. difference {float(d):.2e}")
    moe_ep_hf.release(block)
    return 0
