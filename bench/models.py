"""Model shapes used by the benchmarks and tests."""

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
}


def model_config(key: str, max_tokens: int, quant: str | None = None) -> MoEConfig:
    """The MoEConfig of model ``key`` for ``max_tokens`` tokens per rank (``quant``: a block-scaled
    weight format, see :class:`moe_ep.api.MoEConfig`)."""
    m = MODELS[key]
    return MoEConfig(num_experts=m["num_experts"], hidden=m["hidden"], intermediate=m["intermediate"],
                     top_k=m["top_k"], max_tokens_per_rank=max(max_tokens, 1),
                     activation=m.get("activation", "swiglu"), quant=quant)
