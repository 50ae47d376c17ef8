"""moe_ep as a Hugging Face transformers experts implementation: small random models built from
their configs (no downloads), forward with ``experts_implementation="moe_ep"`` against transformers'
own ``"eager"`` experts and against a float64 oracle of one experts block; refusals. The layouts moe_ep
repacks (gpt-oss, Nemotron-H, transposed weights): tests/test_transformers_layouts.py."""

import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import moe_ep.integrations.transformers as moe_ep_hf  # noqa: E402

from moe_oracle import oracle_f64, record_outputs, rel_err  # noqa: E402

NAME = moe_ep_hf.register()  # "moe_ep", backend "auto" (the reference backend on CPU)


def _models(layers=2):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "mixtral": (MixtralForCausalLM, MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                      **common)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=48,
                                                          num_experts=8, num_experts_per_tok=3,
                                                          decoder_sparse_step=1, **common)),
    }


def build(key, impl, seed=0, layers=2):
    cls, cfg = _models(layers)[key]
    torch.manual_seed(seed)
    model = cls._from_config(cfg, experts_implementation=impl, dtype=torch.bfloat16).eval()
    for mod in model.modules():  # random experts of a realistic scale (init may leave them tiny)
        if hasattr(mod, "gate_up_proj"):
            with torch.no_grad():
                mod.gate_up_proj.normal_(0, mod.gate_up_proj.shape[-1] ** -0.5)
                mod.down_proj.normal_(0, mod.down_proj.shape[-1] ** -0.5)
    return model


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


@pytest.mark.parametrize("key", ["mixtral", "qwen3_moe"])
def test_logits_match_transformers_eager(key):
    """One decoder layer (with two, a bf16 rounding difference in layer 1 can flip a near-tie in
    layer 2's top-k for a token -- seen with Qwen3-MoE -- and both answers are right): logits and
    the layer's output agree with transformers' own eager experts; a two-layer model agrees after
    its first layer, where routing is identical."""
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    for layers in (1, 2):
        ours = build(key, NAME, layers=layers)
        ref = build(key, "eager", layers=layers)
        ref.load_state_dict(ours.state_dict())  # same weights
        with torch.no_grad():
            a = ours(ids, output_hidden_states=True)
            b = ref(ids, output_hidden_states=True)
        assert torch.isfinite(a.logits).all()
        assert rel_err(a.hidden_states[1].float(), b.hidden_states[1].float()) < 1e-2
        if layers == 1:
            assert rel_err(a.logits.float(), b.logits.float()) < 2e-2, rel_err(a.logits.float(), b.logits.float())
    layers = [getattr(m, "_moe_ep_layer", None) for m in experts_modules(ours)]
    assert all(la is not None and la.backend_name == "reference" for la in layers), layers
    assert moe_ep_hf.release(ours) == len(layers)


def test_experts_block_against_float64():
    """One experts module called as transformers calls it, against float64 math."""
    model = build("qwen3_moe", NAME, seed=3)
    mod = experts_modules(model)[0]
    g = torch.Generator().manual_seed(4)
    T, H, K, E = 37, 64, 3, mod.num_experts
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.randn(T, E, generator=g).topk(K, -1).indices
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    with torch.no_grad():
        got = mod(x, idx, w)
    want = oracle_f64(x, idx, w, mod.gate_up_proj.detach(), mod.down_proj.detach(), "swiglu",
                      mod.down_proj.shape[-1])
    assert got.shape == (T, H) and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2


def test_longer_batch_grows_the_layer_once():
    model = build("mixtral", NAME)
    mod = experts_modules(model)[0]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        mod(torch.randn(8, 64, generator=g).to(torch.bfloat16), torch.randint(0, 8, (8, 2), generator=g),
            torch.rand(8, 2, generator=g))
        first = mod._moe_ep_layer
        assert first.config.max_tokens_per_rank == 256
        x, idx, w = (torch.randn(300, 64, generator=g).to(torch.bfloat16), torch.randint(0, 8, (300, 2), generator=g),
                     torch.rand(300, 2, generator=g))
        with pytest.warns(UserWarning, match="rebuilding the layer"):
            out = mod(x, idx, w)
        assert out.shape == (300, 64) and mod._moe_ep_layer.config.max_tokens_per_rank == 512
        # every token of the grown layer's call, those past the old capacity too
        want = oracle_f64(x, idx, w, mod.gate_up_proj.detach(), mod.down_proj.detach(), "swiglu",
                          mod.down_proj.shape[-1])
        assert rel_err(out, want) < 1e-2 and rel_err(out[256:], want[256:]) < 1e-2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no rebuild for a batch that fits
            mod(torch.randn(5, 64, generator=g).to(torch.bfloat16), torch.randint(0, 8, (5, 2), generator=g),
                torch.rand(5, 2, generator=g))


def test_expert_parallel_sentinel_contributes_nothing():
    model = build("mixtral", NAME)
    mod = experts_modules(model)[0]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 8, (9, 2), generator=g)
    w = torch.rand(9, 2, generator=g)
    masked = idx.clone()
    masked[::2, 1] = mod.num_experts  # owned by another rank
    mod._is_expert_parallel = True
    with torch.no_grad():
        got = mod(x, masked, w)
        w0 = w.clone()
        w0[::2, 1] = 0.0
        mod._is_expert_parallel = False
        want = mod(x, idx, w0)
    assert torch.equal(got, want)
    mod._moe_ep_layer.check_errors()  # nothing recorded as a bad routing value


def test_refusals():
    model = build("mixtral", NAME)
    ids = torch.randint(0, 96, (1, 4))
    with pytest.raises(RuntimeError, match="autograd"):
        model(ids)  # grad enabled, parameters require grad
    mod = experts_modules(model)[0]
    mod.has_post_expert_norm = True
    with torch.no_grad(), pytest.raises(ValueError, match="post-expert norm"):
        model(ids)
    mod.has_post_expert_norm = False
    for m in experts_modules(model):  # what the module computes decides, not the config's name for it
        m.act_fn = torch.nn.ReLU()
    with torch.no_grad(), pytest.raises(ValueError, match="MixtralExperts's gate .* computes none of moe_ep's"):
        model(ids)
    f32 = _models()["mixtral"][0]._from_config(_models()["mixtral"][1], experts_implementation=NAME,
                                               dtype=torch.float32).eval()
    with torch.no_grad(), pytest.raises(TypeError, match=r"hidden_states are torch\.float32; .*dtype=torch\.bfloat16"):
        f32(ids)


def test_importing_moe_ep_does_not_import_transformers():
    code = ("import sys, moe_ep, moe_ep.api, moe_ep.backends, moe_ep.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def _qwen3_experts_on_sm90(name: str) -> tuple:
    """``(name, config, module)``: a Qwen3-30B-A3B-shaped experts module (H 2048, I 768, 128 experts,
    top-8) on the GPU with random weights, its experts function moe_ep's registered as ``name`` on
    sm90_bf16_cutedsl (capacity 512 tokens); skips without an SM90 GPU."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an SM90 GPU")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    name = moe_ep_hf.register(name, backend="sm90_bf16_cutedsl", min_tokens=512)
    cfg = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    cfg._experts_implementation = name
    mod = Qwen3MoeExperts(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        mod.gate_up_proj.normal_(0, 2048 ** -0.5)
        mod.down_proj.normal_(0, 768 ** -0.5)
    return name, cfg, mod


def _qwen3_call(T: int, g: torch.Generator) -> tuple:
    """A call's fresh ``(hidden_states [T, 2048] bf16, top_k_index [T, 8], top_k_weights [T, 8] bf16)``."""
    x = torch.randn(T, 2048, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randn(T, 128, device="cuda", generator=g).topk(8, -1).indices
    w = torch.softmax(torch.randn(T, 8, device="cuda", generator=g), -1).to(torch.bfloat16)
    return x, idx, w


@pytest.mark.gpu
def test_qwen3_moe_block_on_the_h200():
    """A Qwen3-30B-A3B-shaped experts block (H 2048, I 768, 128 experts, top-8) through
    transformers' registry on sm90_bf16_cutedsl, against transformers' grouped_mm experts and
    float64; 512 then 1000 tokens (the layer grows once)."""
    name, cfg, mod = _qwen3_experts_on_sm90("moe_ep_sm90")
    g = torch.Generator(device="cuda").manual_seed(7)
    for T in (512, 1000):
        x, idx, w = _qwen3_call(T, g)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = mod(x, idx, w)
            cfg._experts_implementation = "grouped_mm"
            ref = mod(x, idx, w)
            cfg._experts_implementation = name
        assert mod._moe_ep_layer.backend_name == "sm90_bf16_cutedsl"
        assert rel_err(got, ref) < 1e-2
        if T == 512:  # float64 on the first 64 tokens (a per-pair loop on the CPU)
            want = oracle_f64(x[:64].cpu(), idx[:64].cpu(), w[:64].float().cpu(), mod.gate_up_proj.detach().cpu(),
                              mod.down_proj.detach().cpu(), "swiglu", 768)
            assert rel_err(got[:64].cpu(), want) < 1e-2
    moe_ep_hf.release(mod)


@pytest.mark.gpu
def test_compiled_qwen3_moe_block_on_sm90():
    """The same experts module on sm90_bf16_cutedsl inside torch.compile(fullgraph=True), compiled
    before any eager call (the operator builds the layer on the graph's first run): the graph run
    by Dynamo's FX interpreter and by inductor give the eager bits (the module is only the experts
    call), 256 then 300 tokens (dynamic), and match transformers' grouped_mm experts."""
    name, cfg, mod = _qwen3_experts_on_sm90("moe_ep_sm90c")
    g = torch.Generator(device="cuda").manual_seed(8)
    torch._dynamo.reset()
    runs = {"fx": torch.compile(mod, backend=lambda gm, ex: gm.forward, fullgraph=True, dynamic=True),
            "inductor": torch.compile(mod, fullgraph=True, dynamic=True)}
    for T in (256, 300):
        x, idx, w = _qwen3_call(T, g)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = {k: c(x, idx, w).clone() for k, c in runs.items()}
            eager = mod(x, idx, w)
            cfg._experts_implementation = "grouped_mm"
            ref = mod(x, idx, w)
            cfg._experts_implementation = name
        assert mod._moe_ep_layer.backend_name == "sm90_bf16_cutedsl"
        for k, y in got.items():
            assert torch.equal(y, eager), (k, T)
        assert rel_err(eager, ref) < 1e-2
    moe_ep_hf.release(mod)


# other MoE families whose experts modules go through transformers' registry (one decoder layer,
# tiny widths); each model is built from its config, no download
BASE = dict(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)
FAMILIES = {
    "qwen2_moe": dict(intermediate_size=48, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1),
    "olmoe": dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
                        num_key_value_heads=4),
    "glm4_moe": dict(intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1),
    "phimoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "minimax": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    # newer families through the same registry (47th session: every one of them the default layout)
    "minimax_m2": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16),
    "hunyuan_v1_moe": dict(intermediate_size=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           head_dim=16),
    "solar_open": dict(intermediate_size=32, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                       head_dim=16),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_moe_families(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    def build(impl):
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]})  # one config per model
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation=impl).eval()
        for mod in experts_modules(model):
            with torch.no_grad():
                mod.gate_up_proj.normal_(0, mod.gate_up_proj.shape[-1] ** -0.5)
                mod.down_proj.normal_(0, mod.down_proj.shape[-1] ** -0.5)
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, ref = build(NAME), build("eager")
        ref.load_state_dict(ours.state_dict())
        # each experts module's output: the final norm hides most of a scale error
        got, want = record_outputs(experts_modules(ours)), record_outputs(experts_modules(ref))
        ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a, b = ours(ids).logits.float(), ref(ids).logits.float()
    assert sum("_moe_ep_layer" in m.__dict__ for m in ours.modules()) >= 1, "moe_ep was not called"
    assert torch.isfinite(a).all() and rel_err(a, b) < 2e-2, rel_err(a, b)
    errs = [rel_err(g, w) for g, w in zip(got, want)]
    assert len(got) == len(want) >= 1 and max(errs) < 2e-2, errs


def test_the_compiled_operator_finds_its_module_by_id_and_forgets_freed_ones():
    """``torch.ops.moe_ep.hf_experts`` names its experts module by ``id``: a registry miss scans the
    collector once, registers every instance of the module's class and drops the entries of modules
    freed since; an id that names no live object raises rather than calling something else."""
    import gc

    class Experts:  # any gc-tracked object stands in for an experts block
        pass

    class Other:
        pass

    moe_ep_hf._MODULES.clear()
    blocks, other, freed = [Experts(), Experts()], Other(), Experts()  # all alive at once: distinct ids
    freed_id = id(freed)
    assert moe_ep_hf._find_module(freed_id) is freed and moe_ep_hf._MODULES[freed_id]() is freed
    del freed
    gc.collect()
    assert moe_ep_hf._find_module(id(blocks[1])) is blocks[1]
    assert moe_ep_hf._MODULES.keys() == {id(b) for b in blocks}  # the freed one's entry is gone
    assert all(moe_ep_hf._MODULES[id(b)]() is b for b in blocks)
    assert moe_ep_hf._find_module(id(other)) is other  # another class: registered on its own miss
    assert moe_ep_hf._MODULES.keys() == {id(b) for b in blocks} | {id(other)}
    with pytest.raises(RuntimeError, match="no longer exists"):
        moe_ep_hf._find_module(-1)
    moe_ep_hf._MODULES.clear()


def test_compiled_model_calls_one_operator_per_experts_block():
    """torch.compile(model, fullgraph=True), before any eager call: every experts block is one
    ``torch.ops.moe_ep.hf_experts`` in the one graph, whose first run builds and warms up the
    block's layer; the compiled logits are the eager ones bit for bit (the graph run by Dynamo's FX
    interpreter, so only the experts' path is under test), on the first call and once the layers
    exist. With inductor, one decoder layer agrees to rounding with transformers' own ``grouped_mm``
    experts compiled by inductor the same way (not against eager: inductor's own rounding of attention
    and norms flips near-ties in the top-k -- with two layers on torch 2.13, with one on torch 2.11,
    where transformers' experts move as far, 0.26). transformers' own "eager" experts do not compile
    with fullgraph=True at all (a data-dependent expert loop)."""
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    model = build("qwen3_moe", NAME, seed=6, layers=2)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=capture, fullgraph=True)
        first = compiled(ids).logits  # no layer yet: the operator builds them
        assert all(getattr(m, "_moe_ep_layer", None) is not None for m in experts_modules(model))
        eager = model(ids).logits
        assert torch.equal(first, eager) and torch.equal(compiled(ids).logits, eager)
        assert len(graphs) == 1
        ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert ops.count("moe_ep.hf_experts") == len(experts_modules(model)) == 2
        assert moe_ep_hf.release(model) == 2  # the compiled model builds its layers again
        assert torch.equal(compiled(ids).logits, eager) and len(graphs) == 1
    moe_ep_hf.release(model)
    one = build("qwen3_moe", NAME, seed=6, layers=1)
    theirs = build("qwen3_moe", "grouped_mm", seed=6, layers=1)
    with torch.no_grad():
        torch._dynamo.reset()
        got = torch.compile(one, fullgraph=True)(ids).logits
        want = torch.compile(theirs)(ids).logits
        assert rel_err(got.float(), want.float()) < 2e-2
    moe_ep_hf.release(one)
