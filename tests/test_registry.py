"""Backend registry (CPU): order, explain() verdicts, select("auto") and its BackendWarning."""

import dataclasses
import warnings

import pytest
import torch

from moe_ep.api import EPGroup, MoEConfig, MoELayer
from moe_ep.backends import (BackendSpec, BackendWarning, UnsupportedBackendError, Verdict, available, explain, get,
                             register, registry, select, unregister)

CFG = MoEConfig(num_experts=8, hidden=32, intermediate=16, top_k=2, max_tokens_per_rank=16)
GROUP = EPGroup.single()
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_warnings():
    registry.reset_warnings()
    yield
    registry.reset_warnings()


@pytest.fixture
def fakes(monkeypatch):
    """An empty registry (the real one comes back afterwards) and a helper that registers a fake
    backend refusing with ``reasons[name]`` (a mutable dict) or accepting when that is None."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    reasons: dict[str, str | None] = {}

    def add(name: str, priority: int, reason: str | None) -> BackendSpec:
        reasons[name] = reason

        def check(config, group, device):
            assert (config, group, device) == (CFG, GROUP, CPU)
            if reasons[name] is not None:
                raise UnsupportedBackendError(reasons[name])

        return register(BackendSpec(name=name, description=f"fake {name}", priority=priority, check=check,
                                    factory=lambda *a, **k: None))

    add.reasons = reasons
    return add


def _select(name):
    """select() and the BackendWarnings it emitted (every one recorded: no filter dedup)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = select(name, CFG, GROUP, CPU)
    return spec, [w for w in caught if issubclass(w.category, BackendWarning)]


def test_order_and_verdicts(fakes):
    fakes("mid", 20, None)
    fakes("low", 10, "needs 16 experts")
    fakes("top", 30, "needs an SM90 GPU")
    assert available() == ["top", "mid", "low"]
    assert explain(CFG, GROUP, CPU) == [
        Verdict("top", 30, False, "needs an SM90 GPU"),
        Verdict("mid", 20, True, ""),
        Verdict("low", 10, False, "needs 16 experts"),
    ]
    with pytest.raises(dataclasses.FrozenInstanceError):
        explain(CFG, GROUP, CPU)[0].ok = True
    unregister("top")
    unregister("top")  # unknown names are ignored
    assert [v.name for v in explain(CFG, GROUP, CPU)] == ["mid", "low"]


def test_auto_warns_once_per_backend_and_reason(fakes):
    fakes("top", 30, "needs an SM90 GPU")
    fakes("mid", 20, None)
    fakes("low", 10, "needs 16 experts")
    spec, said = _select("auto")
    assert spec.name == "mid"
    assert len(said) == 1  # the lower-priority refusal is not news
    msg = str(said[0].message)
    assert "'mid'" in msg and "'top'" in msg and "needs an SM90 GPU" in msg and "needs 16" not in msg
    assert _select("auto") == (spec, [])  # said once
    fakes.reasons["top"] = "CUDA is not available"  # a new reason is news again
    spec, said = _select("auto")
    assert len(said) == 1 and "CUDA is not available" in str(said[0].message)
    registry.reset_warnings()
    assert len(_select("auto")[1]) == 1


def test_auto_warns_about_each_passed_over_backend(fakes):
    fakes("a", 40, "reason a")
    fakes("b", 30, "reason b")
    fakes("c", 20, None)
    spec, said = _select("auto")
    assert spec.name == "c"
    assert [str(w.message).split(": ")[-1] for w in said] == ["reason a", "reason b"]


def test_no_warning_when_nothing_better_was_refused(fakes):
    fakes("top", 30, None)
    fakes("low", 10, "needs 16 experts")
    assert _select("auto")[0].name == "top"
    fakes.reasons["low"] = None
    spec, said = _select("auto")
    assert spec.name == "top" and said == []


def test_named_backend_never_warns(fakes):
    fakes("top", 30, "needs an SM90 GPU")
    fakes("low", 10, None)
    spec, said = _select("low")
    assert spec.name == "low" and said == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UnsupportedBackendError, match="needs an SM90 GPU"):
            select("top", CFG, GROUP, CPU)
    assert caught == []
    with pytest.raises(ValueError, match=r"unknown moe_ep backend 'nope'; available: \['top', 'low'\]"):
        get("nope")


def test_error_lists_every_refusal_when_none_fits(fakes):
    fakes("top", 30, "needs an SM90 GPU")
    fakes("low", 10, "needs 16 experts")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(UnsupportedBackendError) as ei:
            select("auto", CFG, GROUP, CPU)
    assert str(ei.value) == ("no registered backend supports this configuration: "
                             "top: needs an SM90 GPU; low: needs 16 experts")
    assert caught == []
    assert not any(v.ok for v in explain(CFG, GROUP, CPU))


def test_register_rules(fakes):
    spec = fakes("x", 1, None)
    with pytest.raises(ValueError, match="already registered"):
        register(spec)
    register(dataclasses.replace(spec, priority=5), replace=True)
    assert get("x").priority == 5
    with pytest.raises(TypeError, match="BackendSpec"):
        register("x")


def test_real_backends_on_cpu():
    """On this CPU-only machine the SM90 backend refuses and "auto" says so once."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    verdicts = explain(CFG, GROUP, CPU)
    assert [v.name for v in verdicts] == available()
    by_name = {v.name: v for v in verdicts}
    assert by_name["reference"] == Verdict("reference", 0, True, "")
    sm90 = by_name["sm90_bf16_cutedsl"]
    assert not sm90.ok and sm90.reason and sm90.priority > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layers = [MoELayer(CFG, GROUP, backend="auto", device="cpu") for _ in range(2)]
        named = MoELayer(CFG, GROUP, backend="reference", device="cpu")
    said = [w for w in caught if issubclass(w.category, BackendWarning)]
    assert [lay.backend_name for lay in layers] == ["reference", "reference"]
    assert len(said) == 1
    assert "'reference'" in str(said[0].message) and "'sm90_bf16_cutedsl'" in str(said[0].message)
    assert sm90.reason in str(said[0].message)
    assert said[0].filename == __file__  # attributed to the MoELayer(...) call
    for layer in (*layers, named):
        layer.destroy()
