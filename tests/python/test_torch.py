"""The torch layer: the flash_attn 2.x interface, autograd, gradcheck (fp64, CPU backend),
torch.library.opcheck, torch.compile(fullgraph=True), dropout through torch's generator,
the KV-cache call with rotary embeddings, and on CUDA: fp16/bf16 accuracy and CUDA graphs.
Skipped when torch is not installed (CI without torch runs test_binding_numpy.py)."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    ops,
)
import reference as ref  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device or a build without CUDA")
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def np64(t):
    return t.detach().cpu().double().numpy()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float64, device="cpu", requires_grad=False):
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    return t.requires_grad_(requires_grad)


# ------------------------------------------------------------------ CPU, fp64


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(3, 1)),
                                dict(softcap=2.0, causal=True), dict(alibi=True)],
                         ids=["full", "causal", "window", "softcap", "alibi"])
def test_flash_attn_func_matches_oracle(seed, kw):
    g = gen(seed)
    q, k, v = randn(g, 2, 9, 4, 16), randn(g, 2, 12, 2, 16), randn(g, 2, 12, 2, 16)
    slopes = torch.rand(4, generator=g, dtype=torch.float32) if kw.get("alibi") else None
    args = {key: val for key, val in kw.items() if key != "alibi"}
    out, lse, probs = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True,
                                      **args)
    want = ref.attention(np64(q), np64(k), np64(v), causal=args.get("causal", False),
                         window=args.get("window_size", (-1, -1)),
                         softcap=args.get("softcap", 0.0),
                         alibi_slopes=None if slopes is None else np64(slopes))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert probs.shape == (2, 4, 9, 12) and probs.dtype == torch.float32
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=2e-7)
    np.testing.assert_allclose(np64(probs), want["probs"], rtol=2e-7, atol=1e-30)
    plain = flash_attn_func(q, k, v, alibi_slopes=slopes, **args)
    assert torch.equal(plain, out)


def test_gradcheck_dense(seed):
    g = gen(seed)
    q = randn(g, 2, 5, 4, 8, requires_grad=True)
    k = randn(g, 2, 7, 2, 8, requires_grad=True)
    v = randn(g, 2, 7, 2, 8, requires_grad=True)
    slopes = torch.rand(2, 4, generator=g, dtype=torch.float32)
    for kw in (dict(causal=True), dict(window_size=(2, 1), softcap=1.5),
               dict(alibi_slopes=slopes, deterministic=True)):
        assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, **kw),
                                        (q, k, v)), kw


def test_gradcheck_packed(seed):
    g = gen(seed)
    qkv = randn(g, 1, 6, 3, 2, 8, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: flash_attn_qkvpacked_func(x, causal=True), (qkv,))
    q = randn(g, 1, 4, 4, 8, requires_grad=True)
    kv = randn(g, 1, 6, 2, 2, 8, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, kv: flash_attn_kvpacked_func(q, kv), (q, kv))


def test_gradcheck_varlen(seed):
    g = gen(seed)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    q = randn(g, 8, 4, 8, requires_grad=True)
    k = randn(g, 11, 2, 8, requires_grad=True)
    v = randn(g, 11, 2, 8, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True), (q, k, v))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qkv = randn(g, 9, 3, 2, 8, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: flash_attn_varlen_qkvpacked_func(x, cu, 5, softcap=3.0), (qkv,))
    kv = randn(g, 11, 2, 2, 8, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, kv: flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 5, 5), (q, kv))


def test_gradcheck_with_dropout_fixed_rng_state(seed):
    """With rng_state fixed, dropout is a deterministic function: its gradient checks."""
    g = gen(seed)
    q = randn(g, 1, 6, 2, 8, requires_grad=True)
    k = randn(g, 1, 9, 1, 8, requires_grad=True)
    v = randn(g, 1, 9, 1, 8, requires_grad=True)
    rng_state = torch.tensor([seed, seed * 7 + 1], dtype=torch.int64)

    def f(q, k, v):
        return ops.fwd(q, k, v, None, rng_state, 8**-0.5, False, -1, -1, 0.0, 0.3, False,
                       False)[0]

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_dropout_uses_torch_generator_and_backward_reuses_the_mask(seed):
    g = gen(seed)
    q = randn(g, 2, 7, 2, 8, requires_grad=True)
    k = randn(g, 2, 10, 2, 8, requires_grad=True)
    v = randn(g, 2, 10, 2, 8, requires_grad=True)
    p = 0.4
    torch.manual_seed(seed)
    out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    torch.manual_seed(seed)
    rng_seed, rng_offset = torch.randint(0, 1 << 62, (2,), dtype=torch.int64).tolist()
    dout = randn(g, *out.shape)
    out.backward(dout)
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, dropout_p=p, seed=rng_seed,
                         offset=rng_offset, dout=np64(dout))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        np.testing.assert_allclose(np64(t.grad), want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # A fresh draw gives a fresh mask; the same torch seed gives the same output.
    again = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert not torch.equal(again, out)
    torch.manual_seed(seed)
    assert torch.equal(flash_attn_func(q, k, v, dropout_p=p, causal=True), out)


def test_return_attn_probs_with_dropout(seed):
    g = gen(seed)
    q, k, v = randn(g, 1, 18, 2, 8), randn(g, 1, 18, 2, 8), randn(g, 1, 18, 2, 8)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p=0.5, return_attn_probs=True)
    full = flash_attn_func(q, k, v, return_attn_probs=True)[2]
    kept = probs > 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(probs[kept], full[kept], rtol=0, atol=0)
    # out = (probs / (1 - p)) v, per head
    scaled = probs.double() * float(np.float32(1) / (np.float32(1) - np.float32(0.5)))
    want = torch.einsum("bhqk,bkhd->bqhd", scaled, v)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)


def test_flash_attn_with_kvcache_dense_append_rotary(seed):
    g = gen(seed)
    b, s_q, h_q, h_k, d, s_new = 2, 3, 4, 2, 16, 3
    q = randn(g, b, s_q, h_q, d)
    k_cache, v_cache = randn(g, b, 20, h_k, d), randn(g, b, 20, h_k, d)
    k_new, v_new = randn(g, b, s_new, h_k, d), randn(g, b, s_new, h_k, d)
    lens = torch.tensor([4, 11], dtype=torch.int32)
    rot = 8
    angle = torch.rand(32, rot // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angle.cos(), angle.sin()
    for interleaved in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos,
                                           rotary_sin=sin, cache_seqlens=lens, causal=True,
                                           rotary_interleaved=interleaved,
                                           return_softmax_lse=True)
        # The oracle: rotate q and k_new by the formula, then the numpy KV-cache reference.
        qr = rotate_np(np64(q), np64(cos), np64(sin), lens.numpy()[:, None] + np.arange(s_q),
                       interleaved)
        kr = rotate_np(np64(k_new), np64(cos), np64(sin),
                       lens.numpy()[:, None] + np.arange(s_new), interleaved)
        want, k_after, v_after = ref.kvcache_attention(qr, np64(k_cache), np64(v_cache),
                                                       lens.numpy(), kr, np64(v_new),
                                                       causal=True)
        np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
        np.testing.assert_allclose(np64(lse), want["lse"], rtol=2e-7)
        np.testing.assert_allclose(np64(kc), k_after, rtol=1e-15, atol=1e-15)
        np.testing.assert_array_equal(np64(vc), v_after)
    # Not causal: every query sits at position cache_seqlens.
    kc, vc = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=lens)
    qr = rotate_np(np64(q), np64(cos), np64(sin), np.repeat(lens.numpy()[:, None], s_q, 1), True)
    kr = rotate_np(np64(k_new), np64(cos), np64(sin), lens.numpy()[:, None] + np.arange(s_new),
                   True)
    want, _, _ = ref.kvcache_attention(qr, np64(k_cache), np64(v_cache), lens.numpy(), kr,
                                       np64(v_new))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)


def rotate_np(x, cos, sin, pos, interleaved):
    """Rotary embedding by its definition, one feature pair at a time (the oracle)."""
    x = x.copy()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            c, s = cos[pos[b, t]], sin[pos[b, t]]
            for i in range(half):
                a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                x1, x2 = x[b, t, :, a_idx].copy(), x[b, t, :, b_idx].copy()
                x[b, t, :, a_idx] = x1 * c[i] - x2 * s[i]
                x[b, t, :, b_idx] = x1 * s[i] + x2 * c[i]
    return x


def test_flash_attn_with_kvcache_paged_int_seqlens(seed):
    g = gen(seed)
    q = randn(g, 2, 1, 2, 8)
    k_cache, v_cache = randn(g, 6, 4, 1, 8), randn(g, 6, 4, 1, 8)
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=9, block_table=table,
                                  num_splits=2)
    want, _, _ = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), [9, 9],
                                       block_table=table.numpy())
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)


def test_interface_errors():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'k'"):
        flash_attn_func(q, q[..., :4], q[..., :4])
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'k'.*num_blocks"):
        flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                               torch.tensor([0, 4], dtype=torch.int32), 4, 4,
                               block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'cache_leftpad'.*int32"):
        flash_attn_with_kvcache(q, q, q, cache_seqlens=1, cache_leftpad=torch.zeros(1))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, q.clone(), q.clone(), q[:, :1], q[:, :1])


def test_non_contiguous_last_dim_is_copied(seed):
    g = gen(seed)
    q = randn(g, 1, 5, 2, 16).transpose(-1, -3).contiguous().transpose(-1, -3)
    assert q.stride(-1) != 1
    out = flash_attn_func(q, q, q)
    np.testing.assert_allclose(np64(out), ref.attention(np64(q), np64(q), np64(q))["out"],
                               rtol=1e-10, atol=1e-11)


# ------------------------------------------------------------------ direct calls (ops.call)


def _spy_dispatch(monkeypatch):
    """Counts the calls that go through torch's dispatcher (CustomOpDef.__call__)."""
    from torch._library.custom_ops import CustomOpDef

    seen = []
    orig = CustomOpDef.__call__

    def spy(self, *args, **kwargs):
        seen.append(self._qualname)
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(CustomOpDef, "__call__", spy)
    return seen


def test_call_is_direct_without_autograd_and_matches_the_op(seed, monkeypatch):
    g = gen(seed)
    q, k, v = (randn(g, 2, 5, 4, 16) for _ in range(3))
    args = (q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False, False)
    want = ops.fwd(*args)
    seen = _spy_dispatch(monkeypatch)
    got = ops.call(ops.fwd, *args)
    with torch.no_grad():
        got_interface = flash_attn_func(q, k, v, softmax_scale=0.25, causal=True)
    assert seen == []
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        assert not a.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got_interface, want[0], rtol=0, atol=0)


def test_call_goes_through_the_op_when_the_dispatcher_matters(seed, monkeypatch):
    g = gen(seed)
    q, k, v = (randn(g, 1, 4, 2, 8) for _ in range(3))
    seen = _spy_dispatch(monkeypatch)
    # autograd: an input requiring grad with grad mode on
    qg = q.clone().requires_grad_()
    out = flash_attn_func(qg, k, v)
    assert seen == ["flashattn::fwd"] and out.requires_grad
    # ... and its backward: the bwd op runs directly (grad mode is off in the backward)
    out.sum().backward()
    assert seen == ["flashattn::fwd"] and qg.grad is not None
    # a profiler names the op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flash_attn_func(q, k, v)
    assert seen[-1] == "flashattn::fwd"
    assert any(e.name == "flashattn::fwd" for e in prof.events())
    # a tensor subclass, a dispatch mode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    n = len(seen)
    flash_attn_func(torch.nn.Parameter(q, requires_grad=False), k, v)
    with Mode():
        flash_attn_func(q, k, v)
    assert len(seen) == n + 2
    # functorch transforms
    with warnings.catch_warnings():  # (no batching rule: torch runs the op per element)
        warnings.simplefilter("ignore")
        torch.func.vmap(lambda x: flash_attn_func(x, k, v))(torch.stack([q, q]))
    assert len(seen) == n + 3


def test_call_errors_are_the_ops_errors():
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float64)
    for f in (lambda: ops.fwd(q, q[..., :4], q[..., :4], None, None, 1.0, False, -1, -1, 0.0,
                              0.0, False, False),
              lambda: ops.call(ops.fwd, q, q[..., :4], q[..., :4], None, None, 1.0, False, -1,
                               -1, 0.0, 0.0, False, False)):
        with pytest.raises(flashattn.InvalidArgumentError) as e:
            f()
        assert str(e.value) == ("flashattn::forward: argument 'k': expected shape[3] == 8 "
                                "(head dim of q), got 4")


def test_call_bumps_the_kvcache_version_like_the_op(seed):
    g = gen(seed)
    q = randn(g, 2, 1, 4, 16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    counts = []
    for direct in (False, True):
        kc, vc = randn(g, 2, 8, 2, 16), randn(g, 2, 8, 2, 16)
        kn, vn = randn(g, 2, 1, 2, 16), randn(g, 2, 1, 2, 16)
        args = (q, kc, vc, lens, None, None, kn, vn, None, 0.25, True, -1, -1, 0.0, 0)
        before = kc._version, vc._version
        (ops.call if direct else lambda op, *a: op(*a))(ops.kvcache_fwd, *args)
        counts.append((kc._version - before[0], vc._version - before[1]))
        torch.testing.assert_close(kc[0, 3], kn[0, 0], rtol=0, atol=0)
    assert counts[0] == counts[1] and counts[0][0] >= 1
    with torch.inference_mode():  # inference tensors have no version counter
        kc, vc = torch.zeros(2, 8, 2, 16, dtype=torch.float64), torch.zeros(2, 8, 2, 16,
                                                                             dtype=torch.float64)
    ops.call(ops.kvcache_fwd, q, kc, vc, lens, None, None, None, None, None, 0.25, True, -1, -1,
             0.0, 0)


def test_tensors_go_to_the_binding_as_capsules():
    t = torch.zeros(2, 3)
    assert type(ops._dl(t)).__name__ == "PyCapsule"
    assert ops._dl(None) is None
    sparse = t.to_sparse()
    assert ops._dl(sparse) is sparse  # refused by the exporter: the binding reports it


# ------------------------------------------------------------------ custom ops


def _opcheck_cases(device, dtype):
    g = gen(1234)
    mk = lambda *s, rg=True: randn(g, *s, dtype=dtype, device=device, requires_grad=rg)  # noqa
    q, k, v = mk(2, 5, 4, 16), mk(2, 7, 2, 16), mk(2, 7, 2, 16)
    rng_state = torch.tensor([3, 4], dtype=torch.int64)
    p = 0.2 if device == "cpu" else 0.0
    yield ops.fwd, (q, k, v, None, rng_state, 0.25, True, -1, -1, 0.0, p, False,
                    device == "cpu")
    out, lse, _ = ops.fwd(q, k, v, None, rng_state, 0.25, True, -1, -1, 0.0, p, False, False)
    dout = mk(*out.shape, rg=False)
    yield ops.bwd, (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None,
                    rng_state, 0.25, True, -1, -1, 0.0, p, False)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 3, 9], dtype=torch.int32, device=device)
    vq, vk, vv = mk(6, 4, 16), mk(9, 2, 16), mk(9, 2, 16)
    yield ops.varlen_fwd, (vq, vk, vv, cu_q, cu_k, None, None, rng_state, 4, 6, 0.25, False,
                           -1, -1, 1.5, p, False, False)
    vout, vlse, _ = ops.varlen_fwd(vq, vk, vv, cu_q, cu_k, None, None, rng_state, 4, 6, 0.25,
                                   False, -1, -1, 1.5, p, False, False)
    yield ops.varlen_bwd, (mk(6, 4, 16, rg=False), vq.detach(), vk.detach(), vv.detach(),
                           vout.detach(), vlse.detach(), cu_q, cu_k, None, None, rng_state, 4, 6,
                           0.25, False, -1, -1, 1.5, p, False)
    kc, vc = mk(2, 12, 2, 16, rg=False), mk(2, 12, 2, 16, rg=False)
    lens = torch.tensor([3, 7], dtype=torch.int32, device=device)
    yield ops.kvcache_fwd, (mk(2, 2, 4, 16, rg=False), kc, vc, lens, None, None,
                            mk(2, 2, 2, 16, rg=False), mk(2, 2, 2, 16, rg=False), None, 0.25,
                            True, -1, -1, 0.0, 0)
    # fp8 cache with per-(row, head) scales and a draft tree over the 2 new queries.
    kc8 = (mk(2, 12, 2, 16, rg=False) * 8).to(torch.float8_e4m3fn)
    vc8 = (mk(2, 12, 2, 16, rg=False) * 8).to(torch.float8_e4m3fn)
    ks = torch.full((2, 2), 0.125, dtype=torch.float32, device=device)
    vs = torch.full((2, 2), 0.25, dtype=torch.float32, device=device)
    tree = torch.tensor([[[1], [3]], [[1], [2]]], dtype=torch.int32, device=device)
    yield ops.kvcache_fwd, (mk(2, 2, 4, 16, rg=False), kc8, vc8, lens, None, None,
                            mk(2, 2, 2, 16, rg=False), mk(2, 2, 2, 16, rg=False), None, 0.25,
                            False, -1, -1, 0.0, 2, ks, vs, tree)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(6), ids=["fwd", "bwd", "varlen_fwd", "varlen_bwd",
                                                "kvcache_fwd", "kvcache_fwd_fp8_tree"])
def test_opcheck(device, case):
    dtype = torch.float64 if device == "cpu" else torch.float16
    op, args = list(_opcheck_cases(device, dtype))[case]
    try:
        op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    except flashattn.UnsupportedError as e:
        pytest.skip(f"{op} on {device} not in this build: {e}")
    if case == 5:
        # test_schema compares the mutated caches with ops torch lacks for float8 on the CPU
        # ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn): the other checks run.
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration",
                                                    "test_faketensor", "test_aot_dispatch_dynamic"))
        return
    torch.library.opcheck(op, args)


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4, kv_heads=2):  # head dim 64: in every CUDA build
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim)
        kv = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim)
        y = flash_attn_kvpacked_func(q, kv, causal=True)
        return self.o(y.reshape(b, s, -1)) + x


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device, seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = TinyAttention().to(device=device, dtype=dtype)
    x = torch.randn(2, 33, 256, device=device, dtype=dtype, requires_grad=True)
    # CPU: aot_eager (traces through the fake kernels and autograd, no C++ codegen);
    # CUDA: inductor.
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y_eager = model(x)
    (gx_eager,) = torch.autograd.grad(y_eager.sum(), x)
    y = compiled(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    # Inductor fuses the linear layers' epilogues differently from eager: in bf16 the two
    # agree to a few roundings of the values' magnitude.
    eps = torch.finfo(dtype).eps
    for got, want in ((y, y_eager), (gx, gx_eager)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps * scale)


def test_torch_compile_kvcache_and_varlen():
    torch._dynamo.reset()
    q = torch.randn(2, 1, 2, 8, dtype=torch.float64)
    kc, vc = torch.randn(2, 6, 1, 8, dtype=torch.float64), torch.randn(2, 6, 1, 8, dtype=torch.float64)
    kn, vn = torch.randn(2, 1, 1, 8, dtype=torch.float64), torch.randn(2, 1, 1, 8, dtype=torch.float64)
    lens = torch.tensor([2, 4], dtype=torch.int32)

    def step(q, kc, vc, kn, vn, lens):
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc2, vc2, kn, vn, lens)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, kn, vn, lens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(kc, kc2, rtol=0, atol=0)  # the in-place append survived

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    x = torch.randn(8, 2, 8, dtype=torch.float64, requires_grad=True)
    f = lambda x: flash_attn_varlen_func(x, x, x, cu, cu, 5, 5, causal=True).sum()  # noqa
    (g_eager,) = torch.autograd.grad(f(x), x)
    (g,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x), x)
    torch.testing.assert_close(g, g_eager)


# ------------------------------------------------------------------ CUDA


def _naive_same_precision(q, k, v, causal):
    """An unfused attention in q's dtype (S and P rounded to it), as a framework does."""
    h_ratio = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(h_ratio, 2)
    v = v.repeat_interleave(h_ratio, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    if causal:
        mask = torch.as_tensor(ref.visible(q.shape[1], k.shape[1], causal=True), device=q.device)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_cuda_forward_backward_within_twice_naive(seed, dtype, causal, d):
    g = gen(seed)
    b, s_q, s_k, h_q, h_k = 2, 173, 251, 4, 2
    q64, k64, v64 = randn(g, b, s_q, h_q, d), randn(g, b, s_k, h_k, d), randn(g, b, s_k, h_k, d)
    dout64 = randn(g, b, s_q, h_q, d)
    leaves = [t.to(device="cuda", dtype=dtype).requires_grad_() for t in (q64, k64, v64)]
    out = flash_attn_func(*leaves, causal=causal)
    grads = torch.autograd.grad(out, leaves, dout64.to("cuda", dtype))
    naive_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    naive = _naive_same_precision(*naive_leaves, causal)
    naive_grads = torch.autograd.grad(naive, naive_leaves, dout64.to("cuda", dtype))
    want = ref.attention(np64(q64.to(dtype)), np64(k64.to(dtype)), np64(v64.to(dtype)),
                         causal=causal, dout=np64(dout64.to(dtype)))
    eps = torch.finfo(dtype).eps
    for name, got, base in (("out", out, naive), ("dq", grads[0], naive_grads[0]),
                            ("dk", grads[1], naive_grads[1]), ("dv", grads[2], naive_grads[2])):
        exact = want[name]
        err = np.abs(np64(got) - exact).max()
        naive_err = np.abs(np64(base) - exact).max()
        assert err <= 2 * naive_err + eps * np.abs(exact).max(), (name, err, naive_err)


@needs_cuda
def test_cuda_graph_captures_forward_and_backward(seed):
    g = gen(seed)
    dtype = torch.float16
    mk = lambda *s: randn(g, *s, dtype=dtype, device="cuda")  # noqa: E731
    q, k, v, dout = (mk(2, 64, 4, 64), mk(2, 96, 2, 64), mk(2, 96, 2, 64), mk(2, 64, 4, 64))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = flash_attn_func(*leaves, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, leaves, dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        for t, src in zip(leaves + [dout], (mk(2, 64, 4, 64), mk(2, 96, 2, 64), mk(2, 96, 2, 64),
                                            mk(2, 64, 4, 64))):
            with torch.no_grad():
                t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(captured, eager):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
def test_cuda_graph_captures_kvcache(seed):
    g = gen(seed)
    dtype = torch.bfloat16
    mk = lambda *s: randn(g, *s, dtype=dtype, device="cuda")  # noqa: E731
    q, kn, vn = mk(2, 1, 4, 128), mk(2, 1, 2, 128), mk(2, 1, 2, 128)
    kc, vc = mk(2, 256, 2, 128), mk(2, 256, 2, 128)
    lens = torch.tensor([17, 100], dtype=torch.int32, device="cuda")
    try:
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens,
                                causal=True)
    except flashattn.UnsupportedError as e:
        pytest.skip(f"CUDA KV cache not in this build: {e}")
    kc0, vc0 = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    kc.copy_(kc0)
    vc.copy_(vc0)
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True)
    kc.copy_(kc0)
    vc.copy_(vc0)
    graph.replay()
    torch.cuda.synchronize()
    kc_e, vc_e = kc0.clone(), vc0.clone()
    eager = flash_attn_with_kvcache(q, kc_e, vc_e, kn, vn, cache_seqlens=lens, causal=True)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(kc, kc_e, rtol=0, atol=0)
    # The next decoding step: new lengths and a new token, same graph.
    lens.add_(1)
    q.copy_(mk(2, 1, 4, 128))
    kn.copy_(mk(2, 1, 2, 128))
    kc_e, vc_e = kc.clone(), vc.clone()
    graph.replay()
    torch.cuda.synchronize()
    eager = flash_attn_with_kvcache(q, kc_e, vc_e, kn, vn, cache_seqlens=lens, causal=True)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


@needs_cuda
def test_cuda_bad_indices_are_raised_by_check_errors(seed):
    """CUDA calls check their index tensors on the device and do not synchronise: a bad
    block-table entry is no error of the call but of flashattn.check_errors() after the
    stream's work; an append whose targets conflict (two sequences appending to one block)
    writes nothing to the caches."""
    g = gen(seed)
    dtype = torch.float16
    try:
        flashattn.check_errors()  # what an earlier test may have left
    except flashattn.InvalidArgumentError:
        pass
    q = randn(g, 2, 1, 4, 64, dtype=dtype, device="cuda")
    kc, vc = randn(g, 8, 16, 2, 64, dtype=dtype, device="cuda"), randn(g, 8, 16, 2, 64, dtype=dtype, device="cuda")
    kn, vn = randn(g, 2, 1, 2, 64, dtype=dtype, device="cuda"), randn(g, 2, 1, 2, 64, dtype=dtype, device="cuda")
    lens = torch.tensor([20, 5], dtype=torch.int32, device="cuda")  # new keys: block column 1, 0
    table = torch.tensor([[7, 2], [0, 6]], dtype=torch.int32, device="cuda")
    try:
        flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, block_table=table)
    except flashattn.UnsupportedError as e:
        pytest.skip(f"CUDA KV cache not in this build: {e}")
    torch.cuda.synchronize()
    assert flashattn.check_errors() is None

    bad = table.clone()
    bad[0, 0] = 99  # read by sequence 0
    out = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=lens, block_table=bad)
    torch.cuda.synchronize()
    assert not out.isnan().any()  # the call ran, with the entry clamped
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        flashattn.check_errors()
    e = info.value
    assert e.argument == "block_table" and "got block_table[0][0] = 99" in str(e), str(e)
    assert "device check of an earlier kvcache_forward call" in str(e), str(e)
    assert flashattn.check_errors() is None  # raised once

    dup = torch.tensor([[7, 2], [2, 6]], dtype=torch.int32, device="cuda")  # both append to block 2
    kc2, vc2 = kc.clone(), vc.clone()
    flash_attn_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=lens, block_table=dup)
    torch.cuda.synchronize()
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc), "a conflicting append wrote"
    with pytest.raises(flashattn.InvalidArgumentError, match="append targets") as info:
        flashattn.check_errors(0)
    assert info.value.argument == "block_table"
    assert "block_table[0][1] = block 2" in str(info.value) and "block_table[1][0] = block 2" in str(info.value)


@needs_cuda
def test_cuda_kvcache_matches_oracle(seed):
    g = gen(seed)
    dtype = torch.float16
    q = randn(g, 2, 3, 4, 64, dtype=dtype, device="cuda")
    kc, vc = randn(g, 8, 16, 2, 64, dtype=dtype, device="cuda"), randn(g, 8, 16, 2, 64, dtype=dtype, device="cuda")
    kn, vn = randn(g, 2, 3, 2, 64, dtype=dtype, device="cuda"), randn(g, 2, 3, 2, 64, dtype=dtype, device="cuda")
    table = torch.tensor([[7, 2, 5], [0, 6, 1]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([20, 3], dtype=torch.int32, device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()
    try:
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                      causal=True)
    except flashattn.UnsupportedError as e:
        pytest.skip(f"CUDA KV cache not in this build: {e}")
    want, k_after, v_after = ref.kvcache_attention(np64(q), np64(kc0), np64(vc0), [20, 3],
                                                   np64(kn), np64(vn),
                                                   block_table=table.cpu().numpy(), causal=True)
    np.testing.assert_array_equal(np64(kc), k_after)
    np.testing.assert_array_equal(np64(vc), v_after)
    # fp32 accumulation; P rounded to fp16 before P.V (relative eps/2 per term, sum P = 1:
    # at most eps/2 * max|v|) and the output rounded to fp16 (eps/2 * |out|).
    err = np.abs(np64(out) - want["out"]).max()
    eps = torch.finfo(dtype).eps
    bound = eps * (np.abs(v_after).max() + np.abs(want["out"]).max())
    assert err <= bound, (err, bound)


@needs_cuda
def test_cuda_dropout_matches_the_philox_oracle(seed):
    """The CUDA kernels draw the same Philox bits as the CPU backend and the oracle."""
    g = gen(seed)
    dtype = torch.float16
    q, k, v = (randn(g, 2, 77, 4, 64, dtype=dtype, device="cuda"),
               randn(g, 2, 90, 2, 64, dtype=dtype, device="cuda"),
               randn(g, 2, 90, 2, 64, dtype=dtype, device="cuda"))
    p = 0.3
    rng_state = torch.tensor([seed, seed * 31 + 5], dtype=torch.int64)
    try:
        out = ops.fwd(q, k, v, None, rng_state, 64**-0.5, True, -1, -1, 0.0, p, False, False)[0]
    except flashattn.UnsupportedError as e:
        pytest.skip(f"CUDA dropout not in this build: {e}")
    want = ref.attention(np64(q), np64(k), np64(v), causal=True, dropout_p=p, seed=seed,
                         offset=seed * 31 + 5)["out"]
    no_dropout = ref.attention(np64(q), np64(k), np64(v), causal=True)["out"]
    err = np.abs(np64(out) - want).max()
    # As in the KV-cache check, with kept probabilities scaled by 1 / (1 - p); a different
    # mask would miss by the size of the dropout effect itself.
    eps = torch.finfo(dtype).eps
    bound = eps * (np.abs(np64(v)).max() / (1 - p) + np.abs(want).max())
    assert err <= bound, (err, bound)
    assert np.abs(no_dropout - want).max() > 100 * bound


# ------------------------------------------------------------------ fp8 cache, draft trees


def fp8_bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("per_block", [False, True], ids=["per_head", "per_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_with_kvcache_fp8_paged(seed, per_block, dtype):
    g = gen(seed)
    b, s_q, h_q, h_k, d, block_size, max_blocks = 3, 2, 4, 2, 16, 4, 5
    num_blocks = b * max_blocks + 2
    lens = torch.tensor([5, 0, 13], dtype=torch.int32)
    table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].reshape(b, max_blocks)
    table = table.to(torch.int32)
    shape = (num_blocks, h_k) if per_block else (h_k,)
    k_scale = (torch.rand(shape, generator=g) * 0.04 + 0.01).float()
    v_scale = (torch.rand(shape, generator=g) * 0.04 + 0.01).float()
    # e4m3 bytes of N(0, 1) / scale (in range: torch's own conversion, round to nearest even).
    bs = lambda s: s if not per_block else s[:, None, :, None]  # noqa: E731
    sc = lambda s: s[None, None, :, None] if not per_block else bs(s)  # noqa: E731
    k_cache = (randn(g, num_blocks, block_size, h_k, d).float() / sc(k_scale)).to(torch.float8_e4m3fn)
    v_cache = (randn(g, num_blocks, block_size, h_k, d).float() / sc(v_scale)).to(torch.float8_e4m3fn)
    q = randn(g, b, s_q, h_q, d, dtype=dtype)
    k_new, v_new = randn(g, b, s_q, h_k, d, dtype=dtype), randn(g, b, s_q, h_k, d, dtype=dtype)
    k_before = fp8_bytes(k_cache).clone()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                       block_table=table, causal=True, num_splits=2,
                                       k_scale=k_scale, v_scale=v_scale, return_softmax_lse=True)
    assert out.dtype == dtype and not torch.isnan(out).any()
    # The append quantized k_new / v_new with the destination block's scale (compared with
    # torch's float8_e4m3fn conversion) and wrote nothing else.
    expected = k_before.clone()
    for bi in range(b):
        for t in range(s_q):
            j = int(lens[bi]) + t
            blk, row = int(table[bi, j // block_size]), j % block_size
            s = k_scale[blk] if per_block else k_scale
            expected[blk, row] = fp8_bytes((k_new[bi, t].float() / s[:, None]).to(torch.float8_e4m3fn))
    assert torch.equal(fp8_bytes(k_cache), expected)
    # The result is attention over the dequantized cache (value = e4m3 * scale).
    deq_k = k_cache.double() * sc(k_scale).double()
    deq_v = v_cache.double() * sc(v_scale).double()
    want, _, _ = ref.kvcache_attention(np64(q), deq_k.numpy(), deq_v.numpy(),
                                       (lens + s_q).numpy(), block_table=table.numpy(), causal=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np64(out), want["out"], **tol)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=1e-5, atol=1e-5)


def test_flash_attn_with_kvcache_fp8_errors():
    q = torch.zeros(1, 1, 2, 8)
    cache = torch.zeros(1, 8, 2, 8).to(torch.float8_e4m3fn)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=2)
    assert info.value.argument == "k_scale"
    assert info.value.actual == "an undefined tensor"
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'v_scale': expected dtype float32"):
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=2,
                                k_scale=torch.ones(2), v_scale=torch.ones(2, dtype=torch.float64))
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'v_cache': expected dtype float8_e4m3"):
        flash_attn_with_kvcache(q, cache, torch.zeros(1, 8, 2, 8), cache_seqlens=2,
                                k_scale=torch.ones(2), v_scale=torch.ones(2))


@pytest.mark.parametrize("s_q", [3, 40])
def test_flash_attn_with_kvcache_tree_mask(seed, s_q):
    from test_binding_numpy import random_tree_words, tree_oracle

    g = gen(seed)
    rng = np.random.default_rng(seed)
    b, h_q, h_k, d = 2, 4, 2, 16
    lens = torch.tensor([7, 21], dtype=torch.int32)
    k_cache, v_cache = randn(g, b, 64, h_k, d), randn(g, b, 64, h_k, d)
    q, k_new, v_new = randn(g, b, s_q, h_q, d), randn(g, b, s_q, h_k, d), randn(g, b, s_q, h_k, d)
    words, vis = random_tree_words(rng, b, s_q)
    tree = torch.from_numpy(words.copy())
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                  tree_mask=tree, num_splits=3)
    for bi in range(b):
        n = int(lens[bi]) + s_q
        want, _ = tree_oracle(np64(q[bi]), np64(k_cache[bi, :n]), np64(v_cache[bi, :n]), vis[bi])
        np.testing.assert_allclose(np64(out[bi]), want, rtol=1e-10, atol=1e-11)
    # A linear chain of drafts is causal attention.
    linear, _ = random_tree_words(rng, b, s_q, linear=True)
    a = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + s_q,
                                tree_mask=torch.from_numpy(linear.copy()))
    c = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens + s_q, causal=True)
    assert torch.equal(a, c)


def test_torch_compile_kvcache_tree_fp8():
    torch._dynamo.reset()
    q = torch.randn(2, 2, 2, 8, dtype=torch.float32)
    kc = (torch.randn(2, 6, 1, 8) * 4).to(torch.float8_e4m3fn)
    vc = (torch.randn(2, 6, 1, 8) * 4).to(torch.float8_e4m3fn)
    kn, vn = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    lens = torch.tensor([2, 4], dtype=torch.int32)
    ks, vs = torch.full((1,), 0.25), torch.full((1,), 0.5)
    tree = torch.tensor([[[1], [3]], [[1], [2]]], dtype=torch.int32)

    def step(q, kc, vc, kn, vn, lens):
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, k_scale=ks,
                                       v_scale=vs, tree_mask=tree)

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc2, vc2, kn, vn, lens)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, kn, vn, lens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(fp8_bytes(kc), fp8_bytes(kc2))  # the in-place fp8 append survived
