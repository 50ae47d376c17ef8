"""Model shapes used by the benchmarks and tests, and the random inputs the benchmarks draw."""

import torch

from moe_ep.api import MoEConfig

MODELS = {
    "qwen3": dict(name="Qwen3-30B-A3B", hidden=2048, intermediate=768, num_experts=128, top_k=8),
    "mixtral": dict(name="Mixtral-8x7B", hidden=4096, intermediate=14336, num_experts=8, top_k=2),
    "dsv3_shard": dict(name="DeepSeek-V3 local shard", hidden=7168, intermediate=2048, num_experts=32, top_k=8),
    # gpt-oss-120b: I = 2880 is 22.5 tiles of 128 (ragged), clamped SwiGLU (alpha 1.702, limit 7)
    "gpt_oss": dict(name="gpt-oss-120b", hidden=2880, intermediate=2880, num_experts=128, top_k=4,
                    activation="clamped_swiglu"),
    # Nemotron-3-Nano-30B-A3B's routed experts: squared-ReLU (not gated), FC1 K = 2688, N = 1856
    "nemotron": dict(name="Nemotron-3-Nano-30B-A3B", hidden=2688, intermediate=1856, num_experts=128, top_k=6,
                     activation="squared_relu"),
    # DeepSeek-V4's routed experts (256, top-6) as an EP-8 rank holds them: its clamped SiLU,
    # silu(min(g, 10)) * clamp(u, -10, 10) (drop v99; FP8 with drop v100)
    "dsv4_shard": dict(name="DeepSeek-V4 local shard", hidden=4096, intermediate=2048, num_experts=32, top_k=6,
                       activation="clamped_swiglu", swiglu_alpha=1.0, swiglu_limit=10.0, swiglu_beta=0.0),
    # Inkling2's routed experts (384, top-8) as an EP-8 rank holds them: its softcapped SwiGLU,
    # 4 tanh(g / 4) sigmoid(g) 25 tanh(u / 25) (drop v103)
    "inkling2_shard": dict(name="Inkling2 local shard", hidden=4608, intermediate=2304, num_experts=48, top_k=8,
                           activation="softcapped_swiglu", gate_softcap=4.0, up_softcap=25.0),
    # Gemma-4-26B-A4B's experts: GELU's tanh form (drop v109), I = 704 = 5.5 tiles of 128 (ragged);
    # H 2816 as this project reads the published config (one model page says 2112: not verified here)
    "gemma4": dict(name="Gemma-4-26B-A4B", hidden=2816, intermediate=704, num_experts=128, top_k=8,
                   activation="gelu_tanh_glu"),
}

#: the MoEConfig fields a model entry may set besides the shape (its activation and that's constants)
_ACTIVATION_FIELDS = ("activation", "swiglu_alpha", "swiglu_limit", "swiglu_beta", "swiglu_limit_after_act",
                      "gate_softcap", "up_softcap")


def model_config(key: str, max_tokens: int, quant: str | None = None) -> MoEConfig:
    """The MoEConfig of model ``key`` for ``max_tokens`` tokens per rank (``quant``: a block-scaled
    weight format, see :class:`moe_ep.api.MoEConfig`)."""
    m = MODELS[key]
    return MoEConfig(num_experts=m["num_experts"], hidden=m["hidden"], intermediate=m["intermediate"],
                     top_k=m["top_k"], max_tokens_per_rank=max(max_tokens, 1), quant=quant,
                     **{f: m[f] for f in _ACTIVATION_FIELDS if f in m})


def draw_routing(g: torch.Generator, num_experts: int, top_k: int, T: int, world: int = 1, rank: int = 0,
                 skew: bool = False):
    """This rank's ``(top-k logits, topk_ids)`` of random router logits ``[world, T, E]`` drawn
    from ``g`` (``skew``: expert 0 favoured)."""
    logits = torch.randn(world, T, num_experts, generator=g)[rank]
    if skew:
        logits[:, 0] += 4.0
    return logits.topk(top_k, dim=-1)


def gpu_layer_inputs(cfg: MoEConfig, T: int, seed: int = 0):
    """``(x, topk_ids, topk_weights, w13, w2, out)`` on the current GPU for timing host paths:
    random tokens, routing and small weights from one CUDA generator."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, cfg.hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randn(T, cfg.num_experts, device="cuda", generator=g).topk(cfg.top_k, -1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, cfg.top_k, device="cuda", generator=g), -1)
    w13 = (torch.randn(cfg.num_experts, cfg.w13_rows, cfg.hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(cfg.num_experts, cfg.hidden, cfg.intermediate, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    return x, ids, w, w13, w2, torch.empty(T, cfg.hidden, dtype=torch.bfloat16, device="cuda")
