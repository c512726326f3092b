"""Learnable attention sinks in the torch layer (FlashAttention-4's learnable_sink, gpt-oss's
s_aux): the flash_attn functions against the fp64 numpy oracle (reference.py), gradcheck
of q, k, v and the sink (dense, varlen, dropout with a fixed rng_state), the ops' d sink
output, torch.library.opcheck, torch.compile(fullgraph=True), the KV-cache call (dense,
paged, split), a bf16 sink parameter, the Hugging Face attention function with s_aux, and
the errors. CPU backend (CUDA cases run where a GPU and a CUDA build are present)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import flashattn.hf  # noqa: E402
from flashattn import (  # noqa: E402
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    ops,
)
import reference as ref  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def np64(t):
    return t.detach().cpu().double().numpy()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(
        requires_grad)


def sinks(g, h, requires_grad=False):
    """fp32 [h] sink logits in [-1, 2)."""
    s = (torch.rand(h, generator=g, dtype=torch.float32) * 3 - 1)
    return s.requires_grad_(requires_grad)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window_size=(4, 0)),
                                dict(window_size=(3, 2), softcap=2.0)],
                         ids=["full", "causal", "causal_window", "window_softcap"])
def test_flash_attn_func_with_sink_matches_oracle(seed, kw):
    g = gen(seed)
    q, k, v = randn(g, 2, 9, 4, 16), randn(g, 2, 13, 2, 16), randn(g, 2, 13, 2, 16)
    dout = randn(g, 2, 9, 4, 16)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    sink = sinks(g, 4, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink, **kw)
    out.backward(dout)
    want = ref.attention(np64(q), np64(k), np64(v), causal=kw.get("causal", False),
                         window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                         dout=np64(dout), learnable_sink=np64(sink))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=2e-7)
    # The backward reads the fp32 lse: gradients carry ~1e-7 relative error.
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        np.testing.assert_allclose(np64(t.grad), want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert sink.grad is not None and sink.grad.dtype == torch.float32
    np.testing.assert_allclose(np64(sink.grad), want["dsink"], rtol=1e-5, atol=1e-6)
    # The sink changes the result (so the comparisons above are not vacuous).
    plain = flash_attn_func(q, k, v, **kw)
    assert (plain - out).abs().max().item() > 1e-3


def test_gradcheck_dense_with_sink(seed):
    g = gen(seed)
    q = randn(g, 2, 5, 4, 8, requires_grad=True)
    k = randn(g, 2, 7, 2, 8, requires_grad=True)
    v = randn(g, 2, 7, 2, 8, requires_grad=True)
    # The sink is fp32 (the library's dtype), which gradcheck cannot perturb finely enough:
    # its gradient is checked against finite differences in the next test.
    sink = sinks(g, 4)
    for kw in (dict(causal=True), dict(window_size=(2, 1), softcap=1.5),
               dict(deterministic=True)):
        assert torch.autograd.gradcheck(
            lambda q, k, v: flash_attn_func(q, k, v, learnable_sink=sink, **kw), (q, k, v)), kw


def test_sink_gradient_matches_finite_differences(seed):
    """d loss / d sink from the backward against central differences of the forward
    (the sink is fp32: a step of 2^-8 is exact, the loss is computed in fp64)."""
    g = gen(seed)
    q, k, v = randn(g, 2, 6, 4, 8), randn(g, 2, 9, 2, 8), randn(g, 2, 9, 2, 8)
    dout = randn(g, 2, 6, 4, 8)
    sink = sinks(g, 4, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), learnable_sink=sink)
    (out * dout).sum().backward()
    step = 2.0 ** -8
    fd = []
    for h in range(4):
        up, down = sink.detach().clone(), sink.detach().clone()
        up[h] += step
        down[h] -= step
        lp = (flash_attn_func(q, k, v, causal=True, window_size=(3, 0), learnable_sink=up) * dout).sum()
        lm = (flash_attn_func(q, k, v, causal=True, window_size=(3, 0), learnable_sink=down) * dout).sum()
        fd.append((lp - lm).item() / (2 * step))
    # Truncation error of central differences: step^2 / 6 * |f'''| (f''' is O(1) here).
    np.testing.assert_allclose(np64(sink.grad), fd, rtol=1e-4, atol=1e-4)
    assert np.abs(fd).max() > 1e-3


def test_gradcheck_varlen_with_sink_and_dropout(seed):
    g = gen(seed)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    q = randn(g, 8, 4, 8, requires_grad=True)
    k = randn(g, 11, 2, 8, requires_grad=True)
    v = randn(g, 11, 2, 8, requires_grad=True)
    sink = sinks(g, 4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True,
                                               learnable_sink=sink), (q, k, v))
    rng_state = torch.tensor([seed, seed * 3 + 1], dtype=torch.int64)
    sink2 = sinks(g, 2)

    def f(q, k, v):
        return ops.fwd(q, k, v, None, rng_state, 8**-0.5, False, -1, -1, 0.0, 0.3, False,
                       False, sink2)[0]

    qd, kd, vd = (randn(g, 1, 6, 2, 8, requires_grad=True), randn(g, 1, 9, 1, 8, requires_grad=True),
                  randn(g, 1, 9, 1, 8, requires_grad=True))
    assert torch.autograd.gradcheck(f, (qd, kd, vd))


def test_varlen_sink_gradient_matches_oracle(seed):
    g = gen(seed)
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 20], dtype=torch.int32)
    q, k, v = randn(g, 11, 4, 8), randn(g, 20, 1, 8), randn(g, 20, 1, 8)
    dout = randn(g, 11, 4, 8)
    sink = sinks(g, 4, requires_grad=True)
    q.requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 11, causal=True, window_size=(5, 0),
                                 learnable_sink=sink)
    out.backward(dout)
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, window=(5, 0), dout=np64(dout),
                         cu_seqlens_q=cu_q.numpy(), cu_seqlens_k=cu_k.numpy(),
                         learnable_sink=np64(sink))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(np64(q.grad), want["dq"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(sink.grad), want["dsink"], rtol=1e-5, atol=1e-6)


def test_ops_return_the_sink_gradient(seed):
    g = gen(seed)
    q, k, v = randn(g, 1, 5, 2, 8), randn(g, 1, 7, 1, 8), randn(g, 1, 7, 1, 8)
    dout = randn(g, 1, 5, 2, 8)
    sink = sinks(g, 2)
    out, lse, _ = ops.fwd(q, k, v, None, None, 0.3, False, -1, -1, 0.0, 0.0, False, False, sink)
    dq, dk, dv, dsink = ops.bwd(dout, q, k, v, out, lse, None, None, 0.3, False, -1, -1, 0.0,
                                0.0, False, sink)
    want = ref.attention(np64(q), np64(k), np64(v), softmax_scale=0.3, dout=np64(dout),
                         learnable_sink=np64(sink))
    assert dsink.shape == (2,) and dsink.dtype == torch.float32
    np.testing.assert_allclose(np64(dsink), want["dsink"], rtol=1e-5, atol=1e-6)
    # Without a sink: an empty d sink and the same dq as before the sink existed.
    out0, lse0, _ = ops.fwd(q, k, v, None, None, 0.3, False, -1, -1, 0.0, 0.0, False, False)
    *_, none = ops.bwd(dout, q, k, v, out0, lse0, None, None, 0.3, False, -1, -1, 0.0, 0.0, False)
    assert none.shape == (0,)


def test_bf16_sink_parameter_gets_a_bf16_gradient(seed):
    g = gen(seed)
    q = randn(g, 1, 6, 2, 16, dtype=torch.float32)
    k = randn(g, 1, 6, 2, 16, dtype=torch.float32)
    v = randn(g, 1, 6, 2, 16, dtype=torch.float32)
    param = torch.nn.Parameter(torch.tensor([0.5, -0.25], dtype=torch.bfloat16))
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=param)
    out.sum().backward()
    assert param.grad is not None and param.grad.dtype == torch.bfloat16
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, dout=np.ones(q.shape),
                         learnable_sink=np64(param))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np64(param.grad), want["dsink"], rtol=1e-2, atol=1e-3)


def test_qkvpacked_with_sink(seed):
    g = gen(seed)
    qkv = randn(g, 1, 6, 3, 2, 8, requires_grad=True)
    sink = sinks(g, 2)
    assert torch.autograd.gradcheck(
        lambda x: flash_attn_qkvpacked_func(x, causal=True, learnable_sink=sink), (qkv,))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_with_sink_matches_oracle(seed, paged):
    g = gen(seed)
    q = randn(g, 2, 1, 4, 8)
    if paged:
        k_cache, v_cache = randn(g, 6, 4, 2, 8), randn(g, 6, 4, 2, 8)
        table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
        lens = [9, 5]
    else:
        k_cache, v_cache = randn(g, 2, 12, 2, 8), randn(g, 2, 12, 2, 8)
        table = None
        lens = [11, 4]
    sink = sinks(g, 4)
    for splits in (1, 2):
        out, lse = flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
            block_table=table, causal=True, window_size=(6, 0), num_splits=splits,
            return_softmax_lse=True, learnable_sink=sink)
        want, _, _ = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), lens,
                                           block_table=None if table is None else table.numpy(),
                                           causal=True, window=(6, 0),
                                           learnable_sink=np64(sink))
        np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
        np.testing.assert_allclose(np64(lse), want["lse"], rtol=2e-7)


def test_opcheck_with_sink():
    g = gen(7)
    q, k, v = randn(g, 1, 5, 2, 8, requires_grad=True), randn(g, 1, 6, 1, 8, requires_grad=True), \
        randn(g, 1, 6, 1, 8, requires_grad=True)
    sink = sinks(g, 2, requires_grad=True).double().detach().float().requires_grad_()
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False,
                                    False, sink))
    out, lse, _ = ops.fwd(q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False, False, sink)
    dout = randn(g, 1, 5, 2, 8)
    torch.library.opcheck(ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                    lse.detach(), None, None, 0.25, True, -1, -1, 0.0, 0.0,
                                    False, sink.detach()))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 6], dtype=torch.int32)
    torch.library.opcheck(ops.varlen_fwd, (q[0], k[0], v[0], cu, cu_k, None, None, None, 5, 6,
                                           0.25, True, -1, -1, 0.0, 0.0, False, False, sink))
    vout, vlse, _ = ops.varlen_fwd(q[0], k[0], v[0], cu, cu_k, None, None, None, 5, 6, 0.25, True,
                                   -1, -1, 0.0, 0.0, False, False, sink)
    torch.library.opcheck(ops.varlen_bwd, (dout[0], q[0].detach(), k[0].detach(), v[0].detach(),
                                           vout.detach(), vlse.detach(), cu, cu_k, None, None,
                                           None, 5, 6, 0.25, True, -1, -1, 0.0, 0.0, False,
                                           sink.detach()))
    kc, vc = randn(g, 1, 8, 1, 8), randn(g, 1, 8, 1, 8)
    lens = torch.tensor([6], dtype=torch.int32)
    torch.library.opcheck(ops.kvcache_fwd, (q.detach(), kc, vc, lens, None, None, None, None, None,
                                            0.25, True, -1, -1, 0.0, 1, None, None, None,
                                            sink.detach()))


def test_torch_compile_fullgraph_with_sink(seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)

    class SinkAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 3 * 32)
            self.sinks = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 4, 8).unbind(2)
            return flash_attn_func(q, k, v, causal=True, window_size=(5, 0),
                                   learnable_sink=self.sinks).sum()

    model = SinkAttention()
    x = torch.randn(2, 11, 32)
    loss = model(x)
    (g_eager,) = torch.autograd.grad(loss, model.sinks)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c = compiled(x)
    (g_c,) = torch.autograd.grad(loss_c, model.sinks)
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(g_c, g_eager)
    assert g_eager.abs().max().item() > 0


def test_hf_attention_forward_passes_s_aux(seed):
    """transformers' attention signature with gpt-oss's s_aux (the module's sinks)."""
    g = gen(seed)

    class Module(torch.nn.Module):
        is_causal = True

    module = Module().eval()
    query, key, value = randn(g, 2, 4, 7, 8), randn(g, 2, 2, 7, 8), randn(g, 2, 2, 7, 8)
    s_aux = sinks(g, 4, requires_grad=True)
    out, _ = flashattn.hf.attention_forward(module, query, key, value, None, scaling=0.5,
                                            sliding_window=4, s_aux=s_aux)
    q, k, v = (np64(t.transpose(1, 2)) for t in (query, key, value))
    # transformers' sliding window w: the w most recent keys, the query's own included.
    want = ref.attention(q, k, v, softmax_scale=0.5, causal=True, window=(3, 3),
                         dout=np.ones(out.shape), learnable_sink=np64(s_aux))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    out.sum().backward()
    np.testing.assert_allclose(np64(s_aux.grad), want["dsink"], rtol=1e-5, atol=1e-6)
    # With a padding mask (the varlen path): padded query rows are 0, the rest match.
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :3] = False
    out_pad, _ = flashattn.hf.attention_forward(module, query, key, value, mask, scaling=0.5,
                                                s_aux=s_aux.detach())
    want1 = ref.attention(q[1:, 3:], k[1:, 3:], v[1:, 3:], softmax_scale=0.5, causal=True,
                          learnable_sink=np64(s_aux))
    np.testing.assert_allclose(np64(out_pad[1, 3:]), want1["out"][0], rtol=1e-10, atol=1e-11)
    assert torch.all(out_pad[1, :3] == 0)


def test_sink_errors():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'opts.learnable_sink'"):
        flash_attn_func(q, q, q, learnable_sink=torch.zeros(3))
    with pytest.raises(flashattn.InvalidArgumentError, match="shape \\[2\\]"):
        flash_attn_func(q, q, q, learnable_sink=torch.zeros(1, 2))
    with pytest.raises(flashattn.InvalidArgumentError, match="learnable_sink"):
        flash_attn_func(q, q, q, learnable_sink=[0.0, 1.0])
    with pytest.raises(flashattn.InvalidArgumentError, match="dtype float32"):
        ops.fwd(q, q, q, None, None, 1.0, False, -1, -1, 0.0, 0.0, False, False,
                torch.zeros(2, dtype=torch.float64))
    with pytest.raises(flashattn.InvalidArgumentError, match="learnable_sink"):
        flash_attn_func(q, q, q, learnable_sink=torch.zeros(2, dtype=torch.int32))


def _naive_with_sink(q, k, v, sink, causal, window):
    """An unfused attention with sinks in q's dtype (S and P rounded to it)."""
    h_ratio = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(h_ratio, 2)
    v = v.repeat_interleave(h_ratio, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    mask = torch.as_tensor(ref.visible(q.shape[1], k.shape[1], causal=causal, window=window),
                           device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    col = sink.to(s.dtype).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device or a build without CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [(-1, -1), (127, 0)], ids=["full", "window_128"])
def test_cuda_sink_within_twice_naive(seed, dtype, window):
    """gpt-oss's attention on CUDA: out, dq, dk, dv and d sink within twice the error of
    an unfused computation in the same precision (+ eps * max), against the fp64 oracle."""
    g = gen(seed)
    b, s_q, s_k, h_q, h_k, d = 2, 173, 251, 16, 2, 64
    q64, k64, v64 = randn(g, b, s_q, h_q, d), randn(g, b, s_k, h_k, d), randn(g, b, s_k, h_k, d)
    dout64 = randn(g, b, s_q, h_q, d)
    sink64 = sinks(g, h_q)
    leaves = [t.to(device="cuda", dtype=dtype).requires_grad_() for t in (q64, k64, v64)]
    sink = sink64.to("cuda").requires_grad_()
    out = flash_attn_func(*leaves, causal=True, window_size=window, learnable_sink=sink)
    grads = torch.autograd.grad(out, leaves + [sink], dout64.to("cuda", dtype))
    naive_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    naive_sink = sink.detach().clone().requires_grad_()
    naive = _naive_with_sink(*naive_leaves, naive_sink, True, window)
    naive_grads = torch.autograd.grad(naive, naive_leaves + [naive_sink], dout64.to("cuda", dtype))
    want = ref.attention(np64(q64.to(dtype)), np64(k64.to(dtype)), np64(v64.to(dtype)),
                         causal=True, window=window, dout=np64(dout64.to(dtype)),
                         learnable_sink=np64(sink64))
    eps = torch.finfo(dtype).eps
    for i, name in enumerate(("out", "dq", "dk", "dv", "dsink")):
        got = out if name == "out" else grads[i - 1]
        base = naive if name == "out" else naive_grads[i - 1]
        exact = want[name]
        err = np.abs(np64(got) - exact).max()
        naive_err = np.abs(np64(base) - exact).max()
        assert err <= 2 * naive_err + eps * np.abs(exact).max(), (name, err, naive_err)
