"""Head dims in the torch layer: v with another head dim d_v than q and k (FlashAttention-3
allows it; DeepSeek-V3's (192, 128)), head dims up to 512, and MLA decode through
FlashAttention-3's qv in flash_attn_with_kvcache (scores = scale * (q . k + qv . v), default
scale 1/sqrt(d + d_v)). The flash_attn functions (dense, varlen, KV cache dense and paged)
against the fp64 numpy oracle (reference.py), autograd gradients (dv of d_v) against the
oracle and by gradcheck, torch.library.opcheck of every op with d_v != d (the fake kernels
give out's shape with d_v), torch.compile(fullgraph=True), the numpy binding, and errors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (  # noqa: E402
    InvalidArgumentError,
    UnsupportedError,
    _C,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    ops,
)
import reference as ref  # noqa: E402
import tolerance as tol  # noqa: E402


def np64(t):
    return t.detach().cpu().double().numpy()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float64, requires_grad=False):
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(
        requires_grad)


def close(got, want, tol):
    np.testing.assert_allclose(np64(got), want, rtol=tol, atol=tol)


DIMS = [(192, 128), (64, 32), (40, 72), (8, 24), (512, 512), (512, 64)]


@pytest.mark.parametrize("d,d_v", DIMS, ids=[f"d{d}_dv{dv}" for d, dv in DIMS])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(5, 2), softcap=3.0)],
                         ids=["full", "causal", "window_softcap"])
def test_flash_attn_func_matches_oracle(seed, d, d_v, kw):
    g = gen(seed)
    q = randn(g, 2, 11, 4, d, requires_grad=True)
    k = randn(g, 2, 14, 2, d, requires_grad=True)  # GQA 2
    v = randn(g, 2, 14, 2, d_v, requires_grad=True)
    dout = randn(g, 2, 11, 4, d_v)
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert out.shape == (2, 11, 4, d_v)
    out.backward(dout)
    assert v.grad.shape == v.shape and k.grad.shape == k.shape and q.grad.shape == q.shape
    # The interface's default scale is d ** -0.5 (in fp64, then fp32): the oracle takes it.
    want = ref.attention(np64(q), np64(k), np64(v), softmax_scale=d ** -0.5,
                         causal=kw.get("causal", False),
                         window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0),
                         dout=np64(dout))
    close(out, want["out"], 1e-9)
    close(lse, want["lse"], 1e-6)  # lse is fp32
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        close(t.grad, want[name], 1e-6)  # the backward reads the fp32 lse


def test_flash_attn_func_bf16_and_default_scale(seed):
    g = gen(seed)
    q, k = randn(g, 1, 9, 2, 192, dtype=torch.bfloat16), randn(g, 1, 12, 1, 192, dtype=torch.bfloat16)
    v = randn(g, 1, 12, 1, 128, dtype=torch.bfloat16)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 9, 2, 128)
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, softmax_scale=192 ** -0.5)
    close(out, want["out"], 2e-2)
    # The default scale is 1/sqrt(d) of q and k (192), not of v (128).
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, softmax_scale=192 ** -0.5))
    assert not torch.equal(out, flash_attn_func(q, k, v, causal=True, softmax_scale=128 ** -0.5))


def test_varlen_matches_oracle_with_grads(seed):
    g = gen(seed)
    lens_q, lens_k = [3, 0, 9, 1], [5, 2, 9, 0]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = randn(g, sum(lens_q), 6, 40, requires_grad=True)
    k = randn(g, sum(lens_k), 3, 40, requires_grad=True)
    v = randn(g, sum(lens_k), 3, 72, requires_grad=True)
    dout = randn(g, sum(lens_q), 6, 72)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
    assert out.shape == (sum(lens_q), 6, 72)
    out.backward(dout)
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, dout=np64(dout),
                         softmax_scale=40 ** -0.5, cu_seqlens_q=cu_q.numpy(), cu_seqlens_k=cu_k.numpy())
    close(out, want["out"], 1e-9)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        close(t.grad, want[name], 1e-6)  # the backward reads the fp32 lse


def test_gradcheck_d_v_differs():
    g = gen(3)
    q = randn(g, 1, 4, 2, 6, requires_grad=True)
    k = randn(g, 1, 5, 1, 6, requires_grad=True)
    v = randn(g, 1, 5, 1, 3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                                    (q, k, v))


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_d_v_differs_with_append(seed, paged):
    g = gen(seed)
    b, h_q, h_k, d, d_v = 3, 8, 2, 24, 56
    lens = torch.tensor([7, 0, 19], dtype=torch.int32)
    q, k_new, v_new = randn(g, b, 2, h_q, d), randn(g, b, 2, h_k, d), randn(g, b, 2, h_k, d_v)
    if paged:
        k_cache, v_cache = randn(g, 9, 8, h_k, d), randn(g, 9, 8, h_k, d_v)
        table = torch.tensor([[4, 0, 8], [1, 2, 3], [7, 6, 5]], dtype=torch.int32)
        extra = dict(block_table=table)
    else:
        k_cache, v_cache = randn(g, b, 24, h_k, d), randn(g, b, 24, h_k, d_v)
        table, extra = None, {}
    want, kc, vc = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), lens.numpy(),
                                         np64(k_new), np64(v_new),
                                         block_table=None if table is None else table.numpy(),
                                         causal=True, softmax_scale=d ** -0.5)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                       causal=True, return_softmax_lse=True, **extra)
    assert out.shape == (b, 2, h_q, d_v)
    close(out, want["out"], 1e-9)
    close(lse, want["lse"], 1e-6)
    close(k_cache, kc, 0)
    close(v_cache, vc, 0)


# ---------------------------------------------------------------- MLA (qv)


def mla_inputs(g, dtype=torch.float64, b=3, s_q=1, h_q=16, d=64, d_v=128, block=16, blocks=40):
    """DeepSeek's MLA decode at reduced size: k_cache the rope part (d), v_cache the latent
    (d_v), one latent head (h_k = 1), paged."""
    q, qv = randn(g, b, s_q, h_q, d, dtype=dtype), randn(g, b, s_q, h_q, d_v, dtype=dtype)
    k_cache, v_cache = randn(g, blocks, block, 1, d, dtype=dtype), randn(g, blocks, block, 1, d_v, dtype=dtype)
    table = torch.randperm(blocks, generator=g)[: b * 8].reshape(b, 8).to(torch.int32)
    lens = torch.tensor([37, 0, 120][:b], dtype=torch.int32)
    return q, qv, k_cache, v_cache, table, lens


@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_mla_paged_decode_matches_oracle(seed, num_splits):
    g = gen(seed)
    q, qv, k_cache, v_cache, table, lens = mla_inputs(g)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                       qv=qv, num_splits=num_splits, return_softmax_lse=True)
    assert out.shape == (3, 1, 16, 128)
    want, _, _ = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), lens.numpy(),
                                       block_table=table.numpy(), qv=np64(qv),
                                       softmax_scale=(64 + 128) ** -0.5)
    close(out, want["out"], 1e-9)
    close(lse, want["lse"], 1e-6)


def test_mla_deepseek_shapes_bf16(seed):
    """DeepSeek-V3's decode shapes (rope d = 64, latent d_v = 512, 128 query heads over one
    latent head, 64-row blocks) in bf16 against a torch fp64 computation of its own, within
    the FlashAttention rule (tolerance.py: twice the error of the naive bf16 computation of
    the same inputs, plus eps * max|exact|)."""
    g = gen(seed)
    b, h_q, d, d_v, bs, nb = 2, 128, 64, 512, 64, 12
    q, qv = randn(g, b, 1, h_q, d, dtype=torch.bfloat16), randn(g, b, 1, h_q, d_v, dtype=torch.bfloat16)
    kc, vc = randn(g, nb, bs, 1, d, dtype=torch.bfloat16), randn(g, nb, bs, 1, d_v, dtype=torch.bfloat16)
    table = torch.randperm(nb, generator=g)[:10].reshape(b, 5).to(torch.int32)
    lens = torch.tensor([300, 77], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, qv=qv)
    for i in range(b):
        n = int(lens[i])
        rows = [(int(table[i][t // bs]), t % bs) for t in range(n)]
        k = torch.stack([kc[r, c, 0] for r, c in rows]).double()
        v = torch.stack([vc[r, c, 0] for r, c in rows]).double()
        s = (q[i, 0].double() @ k.T + qv[i, 0].double() @ v.T) * (d + d_v) ** -0.5
        want = torch.softmax(s, -1) @ v
        naive = tol.naive_attention(q[i:i + 1], k.bfloat16()[None, :, None], v.bfloat16()[None, :, None],
                                    (d + d_v) ** -0.5, qv=qv[i:i + 1])
        tol.assert_within_rule(out[i, 0], naive[0, 0], want, torch.bfloat16, f"sequence {i}")


def test_mla_default_scale_is_one_over_sqrt_of_both_dims(seed):
    g = gen(seed)
    q, qv, k_cache, v_cache, table, lens = mla_inputs(g, dtype=torch.float32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, qv=qv)
    same = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                   qv=qv, softmax_scale=(64 + 128) ** -0.5)
    other = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                    qv=qv, softmax_scale=64 ** -0.5)
    assert torch.equal(out, same)
    assert not torch.equal(out, other)


def test_mla_bf16_multi_token_causal_with_append(seed):
    g = gen(seed)
    q, qv, k_cache, v_cache, table, lens = mla_inputs(g, dtype=torch.bfloat16, s_q=3)
    k_new, v_new = randn(g, 3, 3, 1, 64, dtype=torch.bfloat16), randn(g, 3, 3, 1, 128, dtype=torch.bfloat16)
    want, kc, vc = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), lens.numpy(),
                                         np64(k_new), np64(v_new), block_table=table.numpy(),
                                         causal=True, qv=np64(qv), softmax_scale=(64 + 128) ** -0.5)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                  block_table=table, causal=True, qv=qv)
    close(out, want["out"], 3e-2)
    close(v_cache, vc, 0)


def test_mla_qv_with_grad_is_a_clear_error():
    g = gen(1)
    q, qv, k_cache, v_cache, table, lens = mla_inputs(g)
    qv.requires_grad_()
    with pytest.raises(UnsupportedError, match="argument 'qv': expected a tensor that does not "
                                               "require grad") as info:
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, qv=qv)
    assert info.value.argument == "qv"
    with torch.no_grad():  # inference: fine
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, qv=qv)


def test_mla_qv_shape_error_names_qv():
    g = gen(2)
    q, qv, k_cache, v_cache, table, lens = mla_inputs(g)
    with pytest.raises(InvalidArgumentError, match=r"argument 'qv': expected shape \[3, 1, 16, 128\]"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                qv=qv[..., :64])


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, window_size=(6, 0))], ids=["full", "causal_window"])
def test_flash_attn_func_and_varlen_with_qv(seed, kw):
    """FlashAttention-3's flash_attn_func / varlen take qv too (forward only)."""
    g = gen(seed)
    q, k = randn(g, 2, 7, 8, 16), randn(g, 2, 19, 1, 16)
    v, qv = randn(g, 2, 19, 1, 48), randn(g, 2, 7, 8, 48)
    out, lse, _ = flash_attn_func(q, k, v, qv=qv, return_attn_probs=True, **kw)
    assert out.shape == (2, 7, 8, 48)
    want = ref.attention(np64(q), np64(k), np64(v), qv=np64(qv), softmax_scale=(16 + 48) ** -0.5,
                         causal=kw.get("causal", False), window=kw.get("window_size", (-1, -1)))
    close(out, want["out"], 1e-9)
    close(lse, want["lse"], 1e-6)
    cu_q = torch.tensor([0, 7, 14], dtype=torch.int32)
    cu_k = torch.tensor([0, 19, 38], dtype=torch.int32)
    vout = flash_attn_varlen_func(q.reshape(14, 8, 16), k.reshape(38, 1, 16), v.reshape(38, 1, 48),
                                  cu_q, cu_k, 7, 19, qv=qv.reshape(14, 8, 48), **kw)
    close(vout, want["out"].reshape(14, 8, 48), 1e-9)


def test_backward_through_qv_is_a_clear_error():
    g = gen(4)
    q, k = randn(g, 1, 3, 2, 8, requires_grad=True), randn(g, 1, 5, 1, 8, requires_grad=True)
    v, qv = randn(g, 1, 5, 1, 16, requires_grad=True), randn(g, 1, 3, 2, 16)
    out = flash_attn_func(q, k, v, qv=qv)
    with pytest.raises(UnsupportedError, match="argument 'qv': expected None for a call that is "
                                               "differentiated") as info:
        out.sum().backward()
    assert info.value.argument == "qv"
    cu = torch.tensor([0, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 5], dtype=torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu_k, 3, 5, qv=qv[0])
    with pytest.raises(UnsupportedError, match="argument 'qv'"):
        out.sum().backward()
    with torch.no_grad():
        flash_attn_func(q, k, v, qv=qv)  # inference: fine
    # The library's backward refuses qv too (the numpy binding reaches it directly).
    x = np.zeros((1, 3, 2, 8))
    with pytest.raises(NotImplementedError, match="argument 'opts.qv': expected an undefined "
                                                  r"tensor \(qv has no backward"):
        _C.backward(x, x, np.zeros((1, 5, 1, 8)), np.zeros((1, 5, 1, 8)), x,
                    np.zeros((1, 2, 3), dtype=np.float32), np.zeros_like(x),
                    np.zeros((1, 5, 1, 8)), np.zeros((1, 5, 1, 8)), None, qv=x)


# ---------------------------------------------------------------- ops: opcheck, compile


def test_opcheck_d_v_differs():
    g = gen(7)
    q = randn(g, 1, 5, 2, 8, requires_grad=True)
    k = randn(g, 1, 6, 1, 8, requires_grad=True)
    v = randn(g, 1, 6, 1, 12, requires_grad=True)
    torch.library.opcheck(ops.fwd, (q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False, False))
    out, lse, _ = ops.fwd(q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False, False)
    assert out.shape == (1, 5, 2, 12)
    dout = randn(g, 1, 5, 2, 12)
    torch.library.opcheck(ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out.detach(),
                                    lse.detach(), None, None, 0.25, True, -1, -1, 0.0, 0.0, False))
    cu, cu_k = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 6], dtype=torch.int32)
    torch.library.opcheck(ops.varlen_fwd, (q[0], k[0], v[0], cu, cu_k, None, None, None, 5, 6,
                                           0.25, True, -1, -1, 0.0, 0.0, False, False))
    vout, vlse, _ = ops.varlen_fwd(q[0], k[0], v[0], cu, cu_k, None, None, None, 5, 6, 0.25,
                                   True, -1, -1, 0.0, 0.0, False, False)
    torch.library.opcheck(ops.varlen_bwd, (dout[0], q[0].detach(), k[0].detach(), v[0].detach(),
                                           vout.detach(), vlse.detach(), cu, cu_k, None, None,
                                           None, 5, 6, 0.25, True, -1, -1, 0.0, 0.0, False))
    kc, vc = randn(g, 1, 8, 1, 8), randn(g, 1, 8, 1, 12)
    lens = torch.tensor([6], dtype=torch.int32)
    torch.library.opcheck(ops.kvcache_fwd, (q.detach(), kc, vc, lens, None, None, None, None,
                                            None, 0.25, True, -1, -1, 0.0, 1))
    qv = randn(g, 1, 5, 2, 12)
    torch.library.opcheck(ops.fwd, (q.detach(), k.detach(), v.detach(), None, None, 0.25, True,
                                    -1, -1, 0.0, 0.0, False, False, None, qv))
    torch.library.opcheck(ops.varlen_fwd, (q[0].detach(), k[0].detach(), v[0].detach(), cu, cu_k,
                                           None, None, None, 5, 6, 0.25, True, -1, -1, 0.0, 0.0,
                                           False, False, None, None, qv[0]))
    torch.library.opcheck(ops.kvcache_fwd, (q.detach(), kc, vc, lens, None, None, None, None,
                                            None, 0.25, True, -1, -1, 0.0, 1, None, None, None,
                                            None, qv))


def test_fake_kernels_give_d_v():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        q, k, v = torch.empty(2, 3, 4, 16), torch.empty(2, 5, 2, 16), torch.empty(2, 5, 2, 40)
        out, lse, _ = ops.fwd(q, k, v, None, None, 0.25, False, -1, -1, 0.0, 0.0, False, False)
        assert out.shape == (2, 3, 4, 40) and lse.shape == (2, 4, 3)
        out, _ = ops.kvcache_fwd(q, torch.empty(2, 8, 2, 16), torch.empty(2, 8, 2, 40),
                                 torch.zeros(2, dtype=torch.int32), None, None, None, None, None,
                                 0.25, False, -1, -1, 0.0, 1, None, None, None, None,
                                 torch.empty(2, 3, 4, 40))
        assert out.shape == (2, 3, 4, 40)


def test_torch_compile_fullgraph_d_v_differs(seed):
    torch._dynamo.reset()
    g = gen(seed)
    q = randn(g, 1, 7, 2, 16, requires_grad=True)
    k = randn(g, 1, 7, 2, 16, requires_grad=True)
    v = randn(g, 1, 7, 2, 24, requires_grad=True)
    fn = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                       backend="aot_eager")
    out = fn(q, k, v)
    out.sum().backward()
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, dout=np.ones(out.shape))
    close(out, want["out"], 1e-9)
    close(v.grad, want["dv"], 1e-6)


# ---------------------------------------------------------------- numpy binding


def test_numpy_binding_d_v_and_qv():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 4, 2, 8)), rng.standard_normal((1, 6, 1, 8)), rng.standard_normal((1, 6, 1, 20))
    out = np.zeros((1, 4, 2, 20))
    _C.forward(q, k, v, out, None, causal=True)
    np.testing.assert_allclose(out, ref.attention(q, k, v, causal=True)["out"], rtol=1e-10, atol=1e-10)
    kc, vc, qv = k.copy(), v.copy(), rng.standard_normal((1, 4, 2, 20))
    lens = np.array([6], dtype=np.int32)
    out2 = np.zeros((1, 4, 2, 20))
    _C.kvcache_forward(q, kc, vc, lens, None, None, None, None, 1, out2, None, qv=qv,
                       softmax_scale=0.2)
    want, _, _ = ref.kvcache_attention(q, kc, vc, lens, qv=qv, softmax_scale=0.2)
    np.testing.assert_allclose(out2, want["out"], rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match=r"argument 'v': expected head dim d_v in \[1, 512\]"):
        _C.forward(q, k, np.zeros((1, 6, 1, 600)), np.zeros((1, 4, 2, 600)), None)
    with pytest.raises(ValueError, match=r"argument 'out': expected shape \[1, 4, 2, 20\]"):
        _C.forward(q, k, v, np.zeros((1, 4, 2, 8)), None)
