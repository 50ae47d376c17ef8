"""``python -m moe_ep.bench hf [--model qwen3,qwen3_fp8,gpt_oss,nemotron,gemma4]`` -- one model-shaped MoE block
(router + experts, transformers' own block class) run through transformers' experts registry: moe_ep
vs transformers' ``grouped_mm`` experts (and ``sonicmoe`` when it loads), same weights, same inputs,
eager and CUDA graph, at 8192 and 128 tokens (``--tokens`` overrides). Reports ms and tokens/s, with
the ratio to ``grouped_mm`` measured in the same run. The blocks:

- ``qwen3``: Qwen3-30B-A3B's ``Qwen3MoeSparseMoeBlock``;
- ``qwen3_fp8``: the same block with its experts as a Qwen3-FP8 checkpoint holds them (moe_ep's FP8
  layer against ``grouped_mm`` on the BF16 weights they were quantised from);
- ``gpt_oss``: gpt-oss-20b's ``GptOssMLP`` (transposed, interleaved weights with biases: moe_ep runs
  a repacked copy);
- ``nemotron``: Nemotron-3-Nano's routed ``NemotronHExperts`` behind a top-6 softmax router of the
  bench's own (its block's router and shared expert need more of its config);
- ``gemma4``: Gemma-4-26B-A4B's ``Gemma4TextRouter`` and ``Gemma4TextExperts`` (GELU's tanh form; the
  decoder layer's norms and dense MLP around them left out).
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
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        print(f"moe_ep.bench hf: needs transformers >= 5 ({e})")
        return 1
    import moe_ep.integrations.transformers as moe_ep_hf

    moe_ep_hf.register("moe_ep", backend=(args.backend or ["auto"])[0])
    impls = ["moe_ep", "grouped_mm"] + (["sonicmoe"] if "sonicmoe" in ALL_EXPERTS_FUNCTIONS else [])
    for key in args.model:  # names checked against BLOCKS by the bench's parser
        torch.manual_seed(args.seed)
        # a builder gives (title, config, block, hidden) and, when its runs are not one per
        # implementation, (runs, the experts modules to release) too
        title, cfg, block, H, *own_runs = BLOCKS[key]()
        runs, held = own_runs or ([(impl, _use(cfg, impl)) for impl in impls], [block])
        _run_block(args, title, block, H, runs)
        for mod in held:
            moe_ep_hf.release(mod)
    return 0


def _use(cfg, impl, block=None, experts=None):
    """A run's set-up: the experts implementation (and, with ``block``, which experts module it holds)."""
    def activate():
        cfg._experts_implementation = impl
        if block is not None:
            block.experts = experts
    return activate


def _qwen3():
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm"
    block = Qwen3MoeSparseMoeBlock(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 2048 ** -0.5)
        block.experts.down_proj.normal_(0, 768 ** -0.5)
        block.gate.weight.normal_(0, 2048 ** -0.5)
    return "transformers Qwen3MoeSparseMoeBlock (H 2048, I 768, 128 experts, top-8)", cfg, block, 2048


def _gpt_oss():
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    cfg._experts_implementation = "grouped_mm"
    block = GptOssMLP(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 2880 ** -0.5)
        block.experts.down_proj.normal_(0, 2880 ** -0.5)
        block.experts.gate_up_proj_bias.normal_(0, 1.0)
        block.experts.down_proj_bias.normal_(0, 0.1)
        block.router.weight.normal_(0, 2880 ** -0.5)
    return ("transformers GptOssMLP (gpt-oss-20b: H 2880, I 2880, 32 experts, top-4, biases, clamped SwiGLU)",
            cfg, _Tuple0(block), 2880)


def _nemotron():
    import torch
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = NemotronHConfig(hidden_size=2688, moe_intermediate_size=1856, n_routed_experts=128, num_experts_per_tok=6)
    cfg._experts_implementation = "grouped_mm"
    experts = NemotronHExperts(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        experts.up_proj.normal_(0, 2688 ** -0.5)
        experts.down_proj.normal_(0, 1856 ** -0.5)
    router = torch.nn.Linear(2688, 128, bias=False, device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(router.weight, 0, 2688 ** -0.5)
    return ("transformers NemotronHExperts (Nemotron-3-Nano: H 2688, I 1856, 128 experts, top-6, relu^2) "
            "behind a softmax top-6 router", cfg, _Routed(router, experts, 6), 2688)


def _gemma4():
    import torch
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    cfg = Gemma4TextConfig(hidden_size=2816, enable_moe_block=True, num_experts=128, top_k_experts=8,
                           moe_intermediate_size=704)
    cfg._experts_implementation = "grouped_mm"
    experts = Gemma4TextExperts(cfg).to("cuda", torch.bfloat16).eval()
    router = Gemma4TextRouter(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 2816 ** -0.5)
        experts.down_proj.normal_(0, 704 ** -0.5)
        router.proj.weight.normal_(0, 2816 ** -0.5)
    return ("transformers Gemma4TextRouter + Gemma4TextExperts (Gemma-4-26B-A4B: H 2816, I 704, 128 experts, "
            "top-8, GELU tanh)", cfg, _RouterExperts(router, experts), 2816)


class _RouterExperts:
    """A router that returns ``(scores, top_k_weights, top_k_index)`` (Gemma 4's) in front of an experts
    module: ``[1, T, H] -> [1, T, H]``."""

    def __init__(self, router, experts):
        self.router, self.experts = router, experts

    def __call__(self, x):
        h = x.reshape(-1, x.shape[-1])
        _, w, idx = self.router(h)
        return self.experts(h, idx, w).reshape(x.shape)

    def modules(self):
        return self.experts.modules()


class _Tuple0:
    """A block that returns (hidden_states, router_scores): its first output only."""

    def __init__(self, block):
        self.block = block

    def __call__(self, x):
        return self.block(x)[0]

    def modules(self):
        return self.block.modules()


class _Routed:
    """A softmax top-k router in front of an experts module: ``[1, T, H] -> [1, T, H]``."""

    def __init__(self, router, experts, top_k: int):
        self.router, self.experts, self.top_k = router, experts, top_k

    def __call__(self, x):
        import torch

        h = x.reshape(-1, x.shape[-1])
        w, idx = torch.softmax(self.router(h).float(), -1).topk(self.top_k, -1)
        return self.experts(h, idx, (w / w.sum(-1, keepdim=True)).to(h.dtype)).reshape(x.shape)

    def modules(self):
        return self.experts.modules()


def quantised_fp8_experts(cfg, weights: dict, block=(128, 128), scale_fmt: str = "float", **kw):
    """transformers' ``FP8Experts`` (the experts of a ``FineGrainedFP8Config`` model) holding ``weights``
    (``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}``, BF16) as such a checkpoint holds them:
    quantised by transformers' own ``Fp8Quantize`` (e4m3, one scale per ``block``), on the weights'
    device. ``kw``: more ``FP8Experts`` arguments (e.g. ``activation_scheme``)."""
    from types import SimpleNamespace

    import torch
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts, Fp8Quantize
    from transformers.integrations.moe import use_experts_implementation

    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    device = next(iter(weights.values())).device
    mod = cls(cfg, block_size=block, scale_fmt=scale_fmt, **kw).to(device)
    quantise = Fp8Quantize(SimpleNamespace(quantization_config=SimpleNamespace(weight_block_size=block,
                                                                                 scale_fmt=scale_fmt)))
    with torch.no_grad():
        for name, w in weights.items():
            q = quantise.convert({name: w.detach()})
            getattr(mod, name).copy_(q[name])
            getattr(mod, name + "_scale_inv").data = q[name + "_scale_inv"].to(device)
    return mod


def _qwen3_fp8():
    """Qwen3's block with its experts as a Qwen3-FP8 checkpoint holds them (:func:`quantised_fp8_experts`):
    moe_ep on those against transformers' ``grouped_mm`` on the BF16 weights they came from (its own
    FP8 experts kernels come from the Hugging Face hub, which the GPU hosts cannot reach), and moe_ep
    on the BF16 weights."""
    title, cfg, block, H = _qwen3()
    bf16 = block.experts
    fp8 = quantised_fp8_experts(cfg, {n: getattr(bf16, n) for n in ("gate_up_proj", "down_proj")})
    runs = [("moe_ep (FP8 weights)", _use(cfg, "moe_ep", block, fp8)),
            ("grouped_mm (BF16)", _use(cfg, "grouped_mm", block, bf16)),
            ("moe_ep (BF16)", _use(cfg, "moe_ep", block, bf16))]
    return title.replace("(H 2048", "with FP8 block-128 experts (H 2048"), cfg, block, H, runs, [fp8, bf16]


BLOCKS = {"qwen3": _qwen3, "qwen3_fp8": _qwen3_fp8, "gpt_oss": _gpt_oss, "nemotron": _nemotron, "gemma4": _gemma4}


def _run_block(args, title, block, H, runs) -> None:
    """Time each of ``runs`` ((label, set-up)) on ``block``; ratios to the run labelled ``grouped_mm...``."""
    import torch

    token_counts = [args.tokens] if args.tokens is not None else [8192, 128]
    print(f"\n{title}, bf16, GPU {torch.cuda.get_device_name()}, median of {args.iters}")
    print(f"{'experts_implementation':<24}{'tokens':>7}{'eager ms':>10}{'tok/s':>12}{'graph ms':>10}{'tok/s':>12}"
          f"{'vs grouped_mm':>15}")
    for T in token_counts:
        x = torch.randn(1, T, H, device="cuda").to(torch.bfloat16)
        res, outs = {}, {}
        for impl, activate in runs:
            activate()
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
        base_label = next((label for label, _ in runs if label.startswith("grouped_mm")), None)
        base = res.get(base_label)
        for impl, (eager, graph) in res.items():
            ratio = f"{base[0] / eager:.2f}x / {base[1] / graph:.2f}x" if base else "n/a"
            print(f"{impl:<24}{T:>7}{eager:>10.3f}{T / eager * 1e3:>12.0f}{graph:>10.3f}{T / graph * 1e3:>12.0f}"
                  f"{ratio:>15}")
        for impl in outs:
            if impl != base_label and base_label in outs:
                d = (outs[impl] - outs[base_label]).norm() / outs[base_label].norm()
                print(f"  {impl} vs {base_label} output: rel. difference {float(d):.2e}")
