"""transformers experts modules whose layout, activation or format differs from transformers' default,
through ``experts_implementation="moe_ep"`` (the reference backend on CPU):
- gpt-oss (transposed weights, interleaved gate/up rows, biases, its clamped SwiGLU), Aria
  (transposed weights; SiLU experts whatever ``hidden_act`` says), Nemotron-H (no gate, relu^2, with
  and without its latent projection): against transformers' own ``"eager"`` experts, and one gpt-oss
  block against float64 math written from the model's definition;
- DeepSeek-V4 and Hunyuan-V4 (clamped SiLU: ``swiglu_beta`` 0, drop v99) and Step-3.7 and Bailing (the
  gate clamped after the SiLU: ``swiglu_limit_after_act``, drop v102) and Inkling2 (``softcapped_swiglu``,
  drop v103): against ``"eager"``, with the clamp / caps biting; Gemma 4 (``gelu_tanh_glu``, drop v109)
  against ``"eager"`` and its experts against float64 from GELU's tanh formula, and the erf and tanh
  GELU gates told apart;
- FP8 checkpoints' ``FP8Experts`` (FineGrainedFP8Config; float32 and UE8M0 scales): against the
  quantised model in float64;
- the repacked copy follows in-place weight updates; a gate moe_ep does not compute is refused."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moe_ep.integrations.transformers as moe_ep_hf  # noqa: E402

from moe_oracle import record_outputs, rel_err  # noqa: E402

NAME = moe_ep_hf.register()


def _gpt_oss(impl):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=64)
    torch.manual_seed(0)
    model = GptOssForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval()
    for mod in model.modules():
        if hasattr(mod, "gate_up_proj"):
            with torch.no_grad():  # realistic scales; biases large enough to push some gates past the clamp
                mod.gate_up_proj.normal_(0, 64 ** -0.5)
                mod.down_proj.normal_(0, 32 ** -0.5)
                mod.gate_up_proj_bias.normal_(0, 3.0)
                mod.down_proj_bias.normal_(0, 0.1)
    return model


def _nemotron_h(impl, latent):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          layers_block_type=["moe"], n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                          moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, moe_latent_size=latent,
                          max_position_embeddings=64, n_group=1, topk_group=1)
    torch.manual_seed(0)
    model = NemotronHForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval()
    for mod in model.modules():
        if isinstance(getattr(mod, "up_proj", None), torch.nn.Parameter):
            with torch.no_grad():
                mod.up_proj.normal_(0, mod.up_proj.shape[-1] ** -0.5)
                mod.down_proj.normal_(0, mod.down_proj.shape[-1] ** -0.5)
    return model


def _aria(impl):
    """Aria's text model: transposed weights, and routed experts always SiLU-gated whatever
    ``hidden_act`` says (here gelu, which its shared expert follows)."""
    from transformers import AriaTextConfig, AriaTextForCausalLM

    cfg = AriaTextConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, moe_num_experts=8, moe_topk=2, moe_num_shared_experts=1,
                         max_position_embeddings=64, hidden_act="gelu")
    torch.manual_seed(0)
    model = AriaTextForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval()
    for mod in model.modules():
        if hasattr(mod, "gate_up_proj"):
            with torch.no_grad():
                mod.gate_up_proj.normal_(0, 64 ** -0.5)
                mod.down_proj.normal_(0, 32 ** -0.5)
    return model


CLAMP_LIMIT = 1.5  # small, so that the clamp triggers on this toy's FC1 outputs


def _deepseek_v4(impl):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = DeepseekV4Config(vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=32, o_lora_rank=32,
                           o_groups=2, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=8,
                           n_routed_experts=8, num_experts_per_tok=2, qk_rope_head_dim=8, max_position_embeddings=64,
                           num_nextn_predict_layers=0, swiglu_limit=CLAMP_LIMIT)
    torch.manual_seed(0)
    return _scaled(DeepseekV4ForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _hy_v4(impl):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("hy_v4", vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=64, moe_intermediate_size=32,
                               intermediate_size=48, num_experts=8, num_experts_per_tok=2, mlp_layer_types=["sparse"],
                               swiglu_limit=CLAMP_LIMIT, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return _scaled(AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _step3p7(impl):
    """Step-3.7's text model (its causal LM is multimodal): layer 0 without a limit (plain SwiGLU),
    layer 1 with one (``min(silu(g), limit) * clamp(u)``)."""
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    cfg = Step3p7TextConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            moe_intermediate_size=32, share_expert_dim=32, num_local_experts=8, n_routed_experts=8,
                            num_experts_per_tok=2, mlp_layer_types=["sparse", "sparse"], sliding_window=8,
                            swiglu_limits=[0, CLAMP_LIMIT], swiglu_limits_shared=[0, 0])
    torch.manual_seed(0)
    return _scaled(Step3p7TextModel._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _bailing(impl):
    """Bailing's hybrid (Ling; KDA linear attention, torch's reference form on the CPU), both layers clamped
    after the SiLU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("bailing_hybrid", vocab_size=96, hidden_size=64, intermediate_size=48,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
                               qk_nope_head_dim=16, head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
                               num_local_experts=8, first_k_dense_replace=0, max_position_embeddings=64,
                               pad_token_id=0, eos_token_id=2, layer_group_size=2, num_mtp_layers=0,
                               expert_swiglu_limit_list=[CLAMP_LIMIT, CLAMP_LIMIT])
    torch.manual_seed(0)
    return _scaled(AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _inkling2(impl):
    """Inkling2 (384 experts at full size; its softcapped SwiGLU with caps 1 and 1.5 here, so that
    the caps bite on this toy's FC1 outputs)."""
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig
    from transformers.models.inkling2.modeling_inkling2 import Inkling2ForCausalLM

    cfg = Inkling2TextConfig(vocab_size=96, unpadded_vocab_size=96, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                             swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, rel_extent=16, d_rel=4,
                             max_position_embeddings=64, moe_intermediate_size=32, n_routed_experts=8,
                             num_experts_per_tok=2, eos_token_id=2, mlp_gate_softcap=1.0, mlp_up_softcap=1.5)
    torch.manual_seed(0)
    return _scaled(Inkling2ForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _gemma4(impl):
    """Gemma 4's text model with its MoE block (26B-A4B: 128 experts, top-8, expert I 704; here 8 of 32
    columns, top-2); its experts' gate is GELU's tanh approximation (``gelu_pytorch_tanh``)."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM

    cfg = Gemma4TextConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                           sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                           hidden_size_per_layer_input=0, vocab_size_per_layer_input=96)
    assert cfg.hidden_activation == "gelu_pytorch_tanh"
    torch.manual_seed(0)
    return _scaled(Gemma4ForCausalLM._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval())


def _scaled(model):
    for mod in _experts(model):
        with torch.no_grad():  # FC1 outputs of a few units: many past the limit of 1.5
            mod.gate_up_proj.normal_(0, 3 * mod.gate_up_proj.shape[-1] ** -0.5)
            mod.down_proj.normal_(0, mod.down_proj.shape[-1] ** -0.5)
    return model


def _experts(model):
    return [m for m in model.modules() if isinstance(getattr(m, "down_proj", None), torch.nn.Parameter)]


def _same_logits(build, tol=2e-2, experts_tol=2e-2, **call):
    """The model with moe_ep's experts against transformers' eager experts: the logits and, since a
    final norm hides most of an error in the experts' scale, each experts module's own output."""
    ours, ref = build(NAME), build("eager")
    ref.load_state_dict(ours.state_dict())
    got, want = record_outputs(_experts(ours)), record_outputs(_experts(ref))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = (getattr(o, "logits", None) if getattr(o, "logits", None) is not None else o.last_hidden_state
                for o in (ours(ids, **call), ref(ids, **call)))
        a, b = a.float(), b.float()
    assert all("_moe_ep_layer" in m.__dict__ for m in _experts(ours)), "moe_ep was not called"
    assert torch.isfinite(a).all() and rel_err(a, b) < tol, rel_err(a, b)
    assert len(got) == len(want) >= 1
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert max(errs) < experts_tol, errs
    return ours


def test_gpt_oss_logits_match_transformers_eager():
    ours = _same_logits(_gpt_oss)
    layer = _experts(ours)[0]._moe_ep_layer
    cfg = layer.config
    assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.bias_dtype) == (
        "clamped_swiglu", 1.702, 7.0, torch.bfloat16)
    assert moe_ep_hf.release(ours) == 1 and "_moe_ep_packed" not in _experts(ours)[0].__dict__


def test_aria_logits_match_transformers_eager():
    ours = _same_logits(_aria)
    mod = _experts(ours)[0]
    assert mod._moe_ep_layer.config.activation == "swiglu"  # what its experts compute, not hidden_act
    assert "_moe_ep_packed" in mod.__dict__  # transposed: a copy in moe_ep's layout


@pytest.mark.parametrize("latent", [None, 32])
def test_nemotron_h_logits_match_transformers_eager(latent):
    ours = _same_logits(lambda impl: _nemotron_h(impl, latent), use_cache=False)
    cfg = _experts(ours)[0]._moe_ep_layer.config
    assert cfg.activation == "squared_relu" and cfg.hidden == (latent or 64)
    assert "_moe_ep_packed" not in _experts(ours)[0].__dict__  # its layout is moe_ep's: no copy


@pytest.mark.parametrize("build", [_deepseek_v4, _hy_v4], ids=["deepseek_v4", "hy_v4"])
def test_clamped_silu_models_match_transformers_eager(build):
    """DeepSeek-V4's and Hunyuan-V4's experts, ``silu(min(g, limit)) * clamp(u, -limit, limit)``, run as
    ``clamped_swiglu`` with alpha 1 and beta 0 (until drop v99 they were refused); the clamp triggers."""
    seen = []
    ours = _same_logits(lambda impl: _with_input_hook(build(impl), seen))
    cfg = _experts(ours)[0]._moe_ep_layer.config
    assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta) == ("clamped_swiglu", 1.0, CLAMP_LIMIT, 0.0)
    mod = _experts(ours)[0]
    h = torch.cat([x.float() @ mod.gate_up_proj[e].float().t() for x in seen for e in range(mod.gate_up_proj.shape[0])])
    I = mod.down_proj.shape[-1]
    assert (h[:, :I] > CLAMP_LIMIT).float().mean() > 0.05 and (h[:, I:].abs() > CLAMP_LIMIT).float().mean() > 0.05


@pytest.mark.parametrize("build", [_step3p7, _bailing], ids=["step3p7", "bailing_hybrid"])
def test_clamp_after_silu_models_match_transformers_eager(build):
    """Step-3.7's and Bailing's experts (``limit_after_act``), ``min(silu(g), limit) * clamp(u, -limit,
    limit)``, run as ``clamped_swiglu`` with alpha 1, beta 0 and ``swiglu_limit_after_act`` (until drop
    v102 they were refused); Step-3.7's unclamped layer as plain ``swiglu``. The clamp triggers."""
    seen = []
    ours = _same_logits(lambda impl: _with_input_hook(build(impl), seen), use_cache=False)
    mods = _experts(ours)
    clamped = [m for m in mods if getattr(m, "limit", None) is not None]
    for mod in mods:
        cfg = mod._moe_ep_layer.config
        if mod in clamped:
            assert (cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta, cfg.swiglu_limit_after_act) == (
                "clamped_swiglu", 1.0, CLAMP_LIMIT, 0.0, True)
        else:
            assert cfg.activation == "swiglu"
    assert len(clamped) == (1 if build is _step3p7 else 2)
    mod = clamped[0]
    x = seen[mods.index(mod)::len(mods)]
    h = torch.cat([t.float() @ mod.gate_up_proj[e].float().t() for t in x for e in range(mod.gate_up_proj.shape[0])])
    I = mod.down_proj.shape[-1]
    assert (torch.nn.functional.silu(h[:, :I]) > CLAMP_LIMIT).float().mean() > 0.05
    assert (h[:, I:].abs() > CLAMP_LIMIT).float().mean() > 0.05


def test_softcapped_models_match_transformers_eager():
    """Inkling2's experts, ``Softcap(g) * sigmoid(g) * Softcap(u)``, run as ``softcapped_swiglu`` with the
    caps of its ``act_fn`` (until drop v103 they were refused); the caps bite."""
    seen = []
    ours = _same_logits(lambda impl: _with_input_hook(_inkling2(impl), seen))
    mods = _experts(ours)
    for mod in mods:
        cfg = mod._moe_ep_layer.config
        assert (cfg.activation, cfg.gate_softcap, cfg.up_softcap) == ("softcapped_swiglu", 1.0, 1.5)
    mod = mods[0]
    h = torch.cat([t.float() @ mod.gate_up_proj[e].float().t() for t in seen[::len(mods)]
                   for e in range(mod.gate_up_proj.shape[0])])
    I = mod.down_proj.shape[-1]
    assert (h[:, :I].abs() > 1.0).float().mean() > 0.1 and (h[:, I:].abs() > 1.5).float().mean() > 0.05


def test_gemma4_runs_as_gelu_tanh_glu():
    """Gemma 4's experts (``gelu_pytorch_tanh(g) * u``) run as ``gelu_tanh_glu`` (drop v109; refused
    until then): the logits against transformers' eager experts (bf16 noise: transformers' own
    grouped_mm experts sit ~1.8e-2 from its eager ones on this toy), and each experts module's output
    on the hidden states it saw against float64 written from GELU's tanh formula."""
    from moe_oracle import gelu_tanh_f64, gated_moe_f64

    seen = []
    ours = _same_logits(lambda impl: _with_input_hook(_gemma4(impl), seen), tol=3e-2, experts_tol=3e-2)
    mods = _experts(ours)
    assert [m._moe_ep_layer.config.activation for m in mods] == ["gelu_tanh_glu"] * 2
    assert "_moe_ep_packed" not in mods[0].__dict__  # Gemma 4's layout is moe_ep's: no copy
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    idx = torch.randn(37, 8, generator=g).topk(2, -1).indices
    w = torch.softmax(torch.randn(37, 2, generator=g), -1)
    with torch.no_grad():
        got = mods[0](x, idx, w)
    I = mods[0].down_proj.shape[-1]
    want = gated_moe_f64(x, idx, w, mods[0].gate_up_proj.detach(), mods[0].down_proj.detach(),
                         lambda h: gelu_tanh_f64(h[:, :I]) * h[:, I:])
    assert rel_err(got.float(), want) < 1e-2, rel_err(got.float(), want)


def test_the_two_gelu_gates_are_told_apart():
    """A gate with GELU's erf form runs as ``gelu_glu``, one with its tanh approximation as
    ``gelu_tanh_glu`` (the two GELUs differ by ~10% at g = -3): each module runs as its own."""
    for approximate, activation in (("none", "gelu_glu"), ("tanh", "gelu_tanh_glu")):
        cls = _toy_experts_class(is_transposed=True)

        def gate(self, gate_up, approximate=approximate):
            g, u = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.gelu(g, approximate=approximate) * u

        cls._apply_gate = gate
        mod = _toy(NAME, cls)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod(torch.randn(4, 64).to(torch.bfloat16), torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2))
        assert mod._moe_ep_layer.config.activation == activation


def _with_input_hook(model, seen):
    """Record the hidden states each experts module is called with."""
    for mod in _experts(model):
        mod.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    return model


def _gpt_oss_f64(mod, x, idx, w):
    """gpt-oss's experts in float64, written from its definition: x @ gate_up_proj[e] + bias, gate and up
    the even and odd columns, clamp, (up + 1) * gate * sigmoid(alpha * gate), @ down_proj[e] + bias."""
    W1, b1 = mod.gate_up_proj.detach().double(), mod.gate_up_proj_bias.detach().double()
    W2, b2 = mod.down_proj.detach().double(), mod.down_proj_bias.detach().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = x[t].double() @ W1[e] + b1[e]
            g, u = h[0::2].clamp(max=mod.limit), h[1::2].clamp(-mod.limit, mod.limit)
            out[t] += float(w[t, k]) * (((u + 1) * g * torch.sigmoid(mod.alpha * g)) @ W2[e] + b2[e])
    return out


def test_gpt_oss_block_against_float64_and_weight_updates():
    """One gpt-oss experts block as transformers calls it; then its weights change in place (as a
    checkpoint load would) and the next call uses the new ones (the copy is repacked once, not per call)."""
    mod = _experts(_gpt_oss(NAME))[0]
    g = torch.Generator().manual_seed(2)
    T, K, E = 29, 2, mod.num_experts
    x = torch.randn(T, 64, generator=g).to(torch.bfloat16)
    idx = torch.randn(T, E, generator=g).topk(K, -1).indices
    w = torch.softmax(torch.randn(T, K, generator=g), -1).to(torch.bfloat16)  # as gpt-oss's router gives them
    with torch.no_grad(), pytest.warns(UserWarning, match="transposed and with gate and up rows interleaved"):
        got = mod(x, idx, w)
    packed = mod.__dict__["_moe_ep_packed"]
    assert rel_err(got, _gpt_oss_f64(mod, x, idx, w.float())) < 1e-2
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no second copy warning, no rebuild
        mod(x, idx, w)
        assert mod.__dict__["_moe_ep_packed"] is packed  # unchanged weights: the same copy
        mod.gate_up_proj.mul_(-0.5)
        mod.down_proj_bias.add_(0.25)
        got2 = mod(x, idx, w)
    assert mod.__dict__["_moe_ep_packed"] is not packed
    assert rel_err(got2, _gpt_oss_f64(mod, x, idx, w.float())) < 1e-2
    assert rel_err(got2, got) > 0.1  # it did change


def _toy_experts_class(**flags):
    """A transformers-style experts class (``[E, in, out]`` weights with ``is_transposed``), for the
    layouts no small model config gives."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(**flags)
    class ToyExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
            self.num_experts = E
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, H, 2 * I) * H ** -0.5)
            self.down_proj = torch.nn.Parameter(torch.randn(E, I, H) * I ** -0.5)
            self.act_fn = torch.nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):  # eager: one token-expert pair at a time
            out = torch.zeros_like(hidden_states, dtype=torch.float32)
            for t in range(hidden_states.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = int(top_k_index[t, k])
                    h = self._apply_gate(hidden_states[t].float() @ self.gate_up_proj[e].float())
                    out[t] += float(top_k_weights[t, k]) * (h @ self.down_proj[e].float())
            return out.to(hidden_states.dtype)

    return ToyExperts


def _toy(impl, cls, seed=0):
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, hidden_act="silu")
    cfg._experts_implementation = impl
    torch.manual_seed(seed)
    return cls(cfg).to(torch.bfloat16).eval()


def test_transposed_weights_alone():
    cls = _toy_experts_class(is_transposed=True)
    ours, ref = _toy(NAME, cls), _toy("eager", cls)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, 64, generator=g).to(torch.bfloat16)
    idx = torch.randn(13, 8, generator=g).topk(2, -1).indices
    w = torch.rand(13, 2, generator=g)
    with torch.no_grad(), pytest.warns(UserWarning, match="stores its weights transposed; moe_ep keeps a copy"):
        got = ours(x, idx, w)
    with torch.no_grad():
        want = ref(x, idx, w)
    assert ours._moe_ep_layer.config.activation == "swiglu"
    assert rel_err(got.float(), want.float()) < 1e-2


def test_a_gate_moe_ep_does_not_compute_is_refused():
    """A gate moe_ep computes no form of -- here SiLU with a slope of 1.5 inside, ``silu(1.5 g) * u``,
    a near neighbour of swiglu -- is refused: the layer is never built rather than computed as the
    neighbour."""
    cls = _toy_experts_class(is_transposed=True)

    def steep_silu_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(1.5 * gate) * up

    cls._apply_gate = steep_silu_gate
    mod = _toy(NAME, cls)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(moe_ep_hf.MoEEpTransformersError,
                                        match=r"ToyExperts's gate \(.*steep_silu_gate.*computes none of moe_ep's"):
        mod(x, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2))
    assert "_moe_ep_layer" not in mod.__dict__


def test_the_clamp_order_is_told_apart():
    """A gate clamped after the SiLU and one clamped before it, with the same limit, are different
    layers: each runs as what it computes (against its eager module)."""
    def after(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)

    def before(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(23, 64, generator=g) * 4).to(torch.bfloat16)  # FC1 outputs past the limit often
    idx = torch.randn(23, 8, generator=g).topk(2, -1).indices
    w = torch.rand(23, 2, generator=g)
    outs = {}
    for gate_fn, after_act in ((after, True), (before, False)):
        cls = _toy_experts_class(is_transposed=True)
        cls._apply_gate = gate_fn
        ours, ref = _toy(NAME, cls), _toy("eager", cls)
        ours.limit = ref.limit = 1.5
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, want = ours(x, idx, w), ref(x, idx, w)
        cfg = ours._moe_ep_layer.config
        assert (cfg.activation, cfg.swiglu_beta, cfg.swiglu_limit_after_act) == ("clamped_swiglu", 0.0, after_act)
        assert rel_err(got.float(), want.float()) < 1e-2
        outs[after_act] = want.float()
    assert rel_err(outs[True], outs[False]) > 0.05  # the two forms differ on these inputs


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["gpt_oss_20b", "nemotron_3_nano", "gemma4_26b_a4b"])
def test_full_size_blocks_on_sm90(model):
    """gpt-oss-20b's experts block (32 experts, H = I = 2880, top-4, biases, clamped SwiGLU, transposed
    and interleaved weights), Nemotron-3-Nano's (128 experts, H 2688, I 1856, top-6, relu^2, no gate)
    and Gemma-4-26B-A4B's (128 experts, H 2816, I 704, top-8, GELU's tanh form; drop v109)
    through transformers' registry on sm90_bf16_cutedsl, against transformers' grouped_mm experts on
    the same module (and gpt-oss's first tokens against float64)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    name = moe_ep_hf.register("moe_ep_sm90_layouts", backend="sm90_bf16_cutedsl", min_tokens=512)
    if model == "gpt_oss_20b":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
        cfg._experts_implementation = name
        mod = GptOssExperts(cfg).to("cuda", torch.bfloat16)
        H, E, K = 2880, 32, 4
        with torch.no_grad():
            mod.gate_up_proj.normal_(0, H ** -0.5)
            mod.down_proj.normal_(0, 2880 ** -0.5)
            mod.gate_up_proj_bias.normal_(0, 3.0)
            mod.down_proj_bias.normal_(0, 0.1)
    elif model == "gemma4_26b_a4b":
        from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

        cfg = Gemma4TextConfig(hidden_size=2816, enable_moe_block=True, num_experts=128, top_k_experts=8,
                               moe_intermediate_size=704)
        cfg._experts_implementation = name
        mod = Gemma4TextExperts(cfg).to("cuda", torch.bfloat16)
        H, E, K = 2816, 128, 8
        with torch.no_grad():
            mod.gate_up_proj.normal_(0, 3 * H ** -0.5)  # gates of a few units: where the two GELUs differ
            mod.down_proj.normal_(0, 704 ** -0.5)
    else:
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = NemotronHConfig(hidden_size=2688, moe_intermediate_size=1856, n_routed_experts=128, num_experts_per_tok=6)
        cfg._experts_implementation = name
        mod = NemotronHExperts(cfg).to("cuda", torch.bfloat16)
        H, E, K = 2688, 128, 6
        with torch.no_grad():
            mod.up_proj.normal_(0, H ** -0.5)
            mod.down_proj.normal_(0, 1856 ** -0.5)
    g = torch.Generator(device="cuda").manual_seed(8)
    T = 1000
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randn(T, E, device="cuda", generator=g).topk(K, -1).indices
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=g), -1).to(torch.bfloat16)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = mod(x, idx, w)
        cfg._experts_implementation = "grouped_mm"
        ref = mod(x, idx, w)
    assert mod._moe_ep_layer.backend_name == "sm90_bf16_cutedsl"
    assert torch.isfinite(got).all() and rel_err(got.float(), ref.float()) < 1e-2, rel_err(got.float(), ref.float())
    if model == "gpt_oss_20b":
        with torch.no_grad():
            want = _gpt_oss_f64(mod.cpu(), x[:16].cpu(), idx[:16].cpu(), w[:16].float().cpu())
        assert rel_err(got[:16].cpu(), want) < 1e-2
    moe_ep_hf.release(mod)


# ---------------------------------------------------------------- FP8 checkpoints (FineGrainedFP8Config)

def _fp8_experts(scale_fmt="float", block=(128, 128), seed=0, dims=(256, 128, 8, 2), swiglu_limit=None,
                 softcaps=None, **kw):
    """transformers' ``FP8Experts`` as a Qwen3-FP8-like checkpoint loads it (``dims`` = H, I, experts,
    top-k), its weights quantised from random bf16 ones by transformers' own ``Fp8Quantize``;
    ``swiglu_limit``: the config's, as DeepSeek-V4's and GLM-5's carry one (FP8Experts then clamps);
    ``softcaps``: the config's ``mlp_gate_softcap`` / ``mlp_up_softcap``, as Inkling2's."""
    from transformers import Qwen3MoeConfig

    from moe_ep.bench.hf_block import quantised_fp8_experts

    H, I, E, K = dims
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = NAME
    if swiglu_limit is not None:
        cfg.swiglu_limit = swiglu_limit
    if softcaps is not None:
        cfg.mlp_gate_softcap, cfg.mlp_up_softcap = softcaps
    g = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(E, n, k, generator=g) * k ** -0.5).to(torch.bfloat16)
               for name, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I)))}
    return quantised_fp8_experts(cfg, weights, block=block, scale_fmt=scale_fmt, **kw)


def _e4m3_rows128(t: torch.Tensor) -> torch.Tensor:
    """Activations as the format defines them, float64: per 128 values of a row, scale = amax / 448,
    the quotient rounded to the nearest e4m3 value (torch's cast), times the scale."""
    rows = t.double().reshape(t.shape[0], -1, 128)
    scale = rows.abs().amax(-1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((rows / scale).to(torch.float8_e4m3fn).double() * scale).reshape(t.shape)


def _fp8_model_f64(mod, x, idx, w, gate=None):
    """The quantised experts in float64: each weight block's e4m3 values times its scale_inv, x and
    FC2's input (the gate's output in bf16; ``gate(g, u)``, default SwiGLU) quantised per 128 values of
    a row, router weights."""
    gate = gate or (lambda g, u: torch.nn.functional.silu(g) * u)
    def deq(name):
        v, s = getattr(mod, name).detach().double(), getattr(mod, name + "_scale_inv").detach().double()
        return (v * s.repeat_interleave(128, 1).repeat_interleave(128, 2)).cpu()

    W13, W2 = deq("gate_up_proj"), deq("down_proj")
    I = W2.shape[-1]
    xq = _e4m3_rows128(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            h = W13[e] @ xq[t]
            a = gate(h[:I], h[I:]).to(torch.bfloat16)
            out[t] += float(w[t, k]) * (W2[e] @ _e4m3_rows128(a[None])[0])
    return out


def _fp8_call(mod, seed, T=96):
    """One call of an ``_fp8_experts`` module as transformers makes it: x [T, 256] bf16, top-2 of 8
    experts, softmax router weights; returns (x, idx, w, its output)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 256, generator=g).to(torch.bfloat16)
    idx = torch.randn(T, 8, generator=g).topk(2, -1).indices
    w = torch.softmax(torch.randn(T, 2, generator=g), -1)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto picks the reference backend on the CPU, and says so
        return x, idx, w, mod(x, idx, w)


def test_fp8_experts_compile_fullgraph_before_any_eager_call():
    """torch.compile(fullgraph=True) of a FineGrainedFP8 experts module (UE8M0 scales, converted on
    the first run) before any eager call: one ``torch.ops.moe_ep.hf_experts`` in the graph, the eager
    bits, which match the quantised model in float64."""
    mod = _fp8_experts("ue8m0", seed=3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    idx = torch.randn(64, 8, generator=g).topk(2, -1).indices
    w = torch.softmax(torch.randn(64, 2, generator=g), -1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        got = torch.compile(mod, backend=capture, fullgraph=True)(x, idx, w)
        eager = mod(x, idx, w)
    assert [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"] == ["moe_ep.hf_experts"]
    assert torch.equal(got, eager) and mod._moe_ep_layer.config.quant == "fp8_block128"
    assert rel_err(got, _fp8_model_f64(mod, x, idx, w)) < 1e-2


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_fp8_experts_against_the_quantised_model_in_float64(scale_fmt):
    """A FineGrainedFP8 experts module through ``experts_implementation="moe_ep"``: a
    ``quant="fp8_block128"`` layer on the module's own e4m3 weights and block scales (UE8M0 ones
    converted), against the quantised model written out in float64."""
    mod = _fp8_experts(scale_fmt)
    x, idx, w, got = _fp8_call(mod, seed=5)
    layer = mod._moe_ep_layer
    assert layer.config.quant == "fp8_block128" and layer.config.activation == "swiglu"
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, _fp8_model_f64(mod, x, idx, w)) < 1e-2
    assert ("_moe_ep_packed" in mod.__dict__) == (scale_fmt == "ue8m0")  # float32 scales: no copy


def test_fp8_experts_with_a_clamped_silu_gate():
    """A GLM-5-FP8 / DeepSeek-V4-like checkpoint: transformers' own ``FP8Experts`` with the config's
    ``swiglu_limit``, whose gate is silu(min(g, limit)) * clamp(u): a ``quant="fp8_block128"`` layer
    with clamped_swiglu, alpha 1, beta 0 (drop v100: the FP8 GEMM runs it), against the quantised
    model in float64 with that gate."""
    lim = 0.5  # FC1 outputs here are ~N(0, 1): the clamp triggers often
    mod = _fp8_experts(swiglu_limit=lim)
    assert mod.limit == lim
    x, idx, w, got = _fp8_call(mod, seed=6)
    cfg = mod._moe_ep_layer.config
    assert (cfg.quant, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit, cfg.swiglu_beta) == (
        "fp8_block128", "clamped_swiglu", 1.0, lim, 0.0)
    want = _fp8_model_f64(mod, x, idx, w, lambda g, u: torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim))
    assert rel_err(got, want) < 1e-2
    assert rel_err(got, _fp8_model_f64(mod, x, idx, w)) > 0.1  # plain SwiGLU would be far off


def test_fp8_experts_with_a_softcapped_gate():
    """An Inkling2-FP8-like checkpoint: transformers' ``FP8Experts`` with the config's softcaps runs as a
    ``quant="fp8_block128"`` softcapped_swiglu layer (drop v103), against the quantised model in float64."""
    cg, cu = 0.5, 0.75  # FC1 outputs here are ~N(0, 1): both caps bite
    mod = _fp8_experts(softcaps=(cg, cu))
    x, idx, w, got = _fp8_call(mod, seed=7)
    cfg = mod._moe_ep_layer.config
    assert (cfg.quant, cfg.activation, cfg.gate_softcap, cfg.up_softcap) == (
        "fp8_block128", "softcapped_swiglu", cg, cu)
    want = _fp8_model_f64(mod, x, idx, w,
                          lambda g, u: cg * torch.tanh(g / cg) * torch.sigmoid(g) * cu * torch.tanh(u / cu))
    assert rel_err(got, want) < 1e-2
    assert rel_err(got, _fp8_model_f64(mod, x, idx, w)) > 0.1  # plain SwiGLU would be far off


@pytest.mark.parametrize("change,match", [
    (dict(activation_scheme="static"), "static activation scales"),
    (dict(block=(64, 64)), r"weight blocks \(64, 64\)"),
])
def test_fp8_experts_refusals(change, match):
    block = change.pop("block", (128, 128))
    mod = _fp8_experts(block=block, **change)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(moe_ep_hf.MoEEpTransformersError, match=match):
        mod(x, torch.zeros(4, 2, dtype=torch.long), torch.rand(4, 2))


@pytest.mark.gpu
def test_fp8_experts_qwen3_block_on_sm90():
    """Qwen3-30B-A3B-FP8's experts (H 2048, I 768, 128 experts, top-8, 128 x 128 blocks) through the
    FP8 registry on sm90_fp8_cutedsl, 512 tokens; every 16th (32 tokens over all of them) against the
    quantised model in float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    name = moe_ep_hf.register("moe_ep_sm90_fp8", backend="sm90_fp8_cutedsl", min_tokens=512)
    mod = _fp8_experts(dims=(2048, 768, 128, 8)).cuda()
    mod.config._experts_implementation = name
    g = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(512, 2048, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randn(512, 128, device="cuda", generator=g).topk(8, -1).indices
    w = torch.softmax(torch.randn(512, 8, device="cuda", generator=g), -1).to(torch.bfloat16)
    with torch.no_grad():
        got = mod(x, idx, w)
    assert mod._moe_ep_layer.backend_name == "sm90_fp8_cutedsl"
    assert torch.isfinite(got).all()
    rows = torch.arange(3, 512, 16, device="cuda")  # 32 tokens, two from each 32-token stretch, every tile
    want = _fp8_model_f64(mod, x[rows].cpu(), idx[rows].cpu(), w[rows].float().cpu())
    assert rel_err(got[rows].cpu(), want) < 3e-2  # 32 tokens average little (the FP8 layer test's bound)
    moe_ep_hf.release(mod)
