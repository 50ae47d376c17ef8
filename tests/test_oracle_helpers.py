"""The GPU tests' own checking helpers (tests/moe_oracle.py), on the CPU: each must catch the defect
it exists for, or the GPU tests built on it could not fail."""

import pytest
import torch
from moe_oracle import POISONED_BUFFERS, poison_workspace, rel_err, swiglu_moe_f64, worst_row_err


def test_worst_row_err_sees_one_token_missing_an_expert():
    """At T = 4096 one token that lost one of its 8 experts moves the norm-wise error by ~0.005,
    inside the layer tests' 1e-2; its own row is ~0.35 off, far outside their 3e-2 per token."""
    g = torch.Generator().manual_seed(0)
    T, H, K = 4096, 256, 8
    per_expert = torch.randn(T, K, H, generator=g, dtype=torch.float64)
    w = torch.softmax(torch.randn(T, K, generator=g, dtype=torch.float64), -1)
    want = (per_expert * w[..., None]).sum(1)
    noisy = want * (1 + 2e-3 * torch.randn(T, H, generator=g, dtype=torch.float64))  # bf16-like rounding
    broken = noisy.clone()
    broken[17] -= per_expert[17, 3] * w[17, 3]
    assert rel_err(noisy, want) < 1e-2 and worst_row_err(noisy, want) < 3e-2
    assert rel_err(broken, want) < 1e-2  # the norm alone passes the broken output ...
    assert worst_row_err(broken, want) > 3e-2  # ... the worst token does not
    assert worst_row_err(want[:0], want[:0]) == 0.0


def test_worst_row_err_floors_tiny_rows():
    """A row far below the median norm (a dropped token's zero row, a tiny output) is measured
    against a tenth of the median: its rounding does not count as a 100% error, a real error does."""
    want = torch.ones(8, 64, dtype=torch.float64)
    want[2] = 1e-9
    got = want.clone()
    got[2] = 2e-9  # 100% off a row of 1e-9: noise against the median norm of 8
    assert worst_row_err(got, want) < 1e-7
    got[2] = 0.5  # a row that should be ~0 and is not
    assert worst_row_err(got, want) > 0.5


@pytest.mark.parametrize("quant", [None, (128, torch.float32)])
def test_poison_workspace_fills_the_activation_buffers_only(quant):
    """NaN (e4m3: byte 0x7f) in every activation buffer of a layer's workspace view, the protocol
    state and the index buffers left as they were (a kernel would read garbage there as routing)."""
    from moe_ep.backends.sm90.bf16_cutedsl.workspace import Dims, Workspace

    dims = Dims(256, 128, 2, 1, 16, 4, quant, token_rows=quant is not None, send_rows=quant is not None)
    ws = Workspace(("test",), torch.device("cpu"), 0, 1, None, False)

    class Client:
        pass

    client = Client()
    ws.register(client, dims)
    ws.reserve()
    views = ws.views(dims)
    for name, t in views.items():  # finite values everywhere first
        (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).fill_(1)

    class Impl:
        pass

    impl = Impl()
    impl.ws, impl.dims = ws, dims
    filled = poison_workspace(impl)
    assert set(filled) == {n for n in POISONED_BUFFERS if n in views}
    assert ("xq" in filled) == (quant is not None) and {"xs", "h", "recv_x", "comb"} <= set(filled)
    for name, t in views.items():
        if name in filled:
            assert t.float().isnan().all(), name
        else:
            assert not t.is_floating_point() or not t.isnan().any(), name
            assert (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).eq(1).all(), name


def test_swiglu_moe_f64_is_the_sum_over_experts():
    """The float64 oracle the worst-token checks compare with: token 0 routed to two experts by hand."""
    g = torch.Generator().manual_seed(1)
    E, H, I = 3, 16, 8
    x = torch.randn(1, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    ids, w = torch.tensor([[2, 0]]), torch.tensor([[0.25, 0.75]])
    want = torch.zeros(H, dtype=torch.float64)
    for e, wk in ((2, 0.25), (0, 0.75)):
        h = w13[e].double() @ x[0].double()
        want += wk * (w2[e].double() @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    torch.testing.assert_close(swiglu_moe_f64(x, ids, w, w13, w2, I)[0], want)
