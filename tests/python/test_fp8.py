"""fp8 (e4m3) q, k, v through the torch layer on CPU tensors (issue 21): flash_attn_func and
flash_attn_varlen_func with FlashAttention-3's q_descale / k_descale / v_descale ([b, h_k]
fp32), against an fp64 computation over the dequantized inputs, with causal / window /
GQA / softcap / odd lengths / outliers; bf16 and fp16 outputs; the ops under opcheck; and
the rules (no autograd through fp8, CUDA declines)."""

import math

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import UnsupportedError, flash_attn_func, flash_attn_varlen_func, ops  # noqa: E402
from flashattn.fp8 import quantize_e4m3  # noqa: E402

F8 = torch.float8_e4m3fn


def attention64(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """fp64 attention of one sequence: q [s_q, h_q, d], k [s_k, h_k, d], v [s_k, h_k, d_v]."""
    s_q, h_q, _ = q.shape
    s_k, h_k, _ = k.shape
    r = h_q // h_k
    k = k.repeat_interleave(r, dim=1)
    v = v.repeat_interleave(r, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(s_q)[:, None] + s_k - s_q
    j = torch.arange(s_k)[None, :]
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(s_q, s_k, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, v), lse


def dequant(x8, descale, h_of_group):
    """x8 [b, s, h, d] e4m3 with descale [b, h_k] -> fp64 values."""
    ds = descale.double()[:, None, :].repeat_interleave(h_of_group, dim=2)[..., None]
    return x8.double() * ds


CASES = [
    # b, s_q, s_k, h_q, h_k, d, causal, window, softcap, out dtype, outliers
    (2, 37, 53, 2, 2, 32, False, (-1, -1), 0.0, torch.bfloat16, False),
    (2, 65, 129, 6, 2, 64, True, (-1, -1), 0.0, torch.float16, False),
    (3, 1, 200, 8, 1, 64, False, (-1, -1), 0.0, torch.bfloat16, False),
    (2, 50, 80, 4, 2, 24, False, (17, 3), 5.0, torch.bfloat16, False),
    (2, 64, 96, 4, 2, 64, True, (-1, -1), 0.0, torch.bfloat16, True),
]


@pytest.mark.parametrize("b,s_q,s_k,h_q,h_k,d,causal,window,softcap,out_dtype,outliers", CASES)
def test_flash_attn_func_fp8_matches_fp64(b, s_q, s_k, h_q, h_k, d, causal, window, softcap,
                                          out_dtype, outliers):
    g = torch.Generator().manual_seed(s_q * 1000 + s_k)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((s_q, h_q), (s_k, h_k), (s_k, h_k)))
    # descales that differ per (sequence, KV head)
    q = q * torch.tensor([1.0, 4.0, 0.25])[:b, None, None, None]
    k = k * torch.linspace(0.5, 3.0, h_k)[None, None, :, None]
    if outliers:
        q[..., :3] *= 50
        k[..., 5] *= 50
    q8, qs = quantize_e4m3(q, h_k)
    k8, ks = quantize_e4m3(k, h_k)
    v8, vs = quantize_e4m3(v, h_k)
    scale = 0.02 if outliers else d ** -0.5
    out, lse, _ = flash_attn_func(q8, k8, v8, softmax_scale=scale, causal=causal,
                                  window_size=window, softcap=softcap, q_descale=qs,
                                  k_descale=ks, v_descale=vs, out_dtype=out_dtype,
                                  return_attn_probs=True)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    assert out.shape == (b, s_q, h_q, d) and lse.shape == (b, h_q, s_q)
    qd, kd, vd = dequant(q8, qs, h_q // h_k), dequant(k8, ks, 1), dequant(v8, vs, 1)
    eps = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    for i in range(b):
        o64, l64 = attention64(qd[i], kd[i], vd[i], scale, causal, window, softcap)
        tol = 2 * eps * o64.abs().max().item() + 1e-6
        assert (out[i].double() - o64).abs().max().item() <= tol
        assert (lse[i].double() - l64).abs().max().item() <= 1e-4 * max(1.0, l64.abs().max().item())


def test_varlen_fp8_matches_fp64():
    g = torch.Generator().manual_seed(5)
    lens_q, lens_k, h_q, h_k, d = [17, 1, 40], [23, 9, 40], 4, 2, 32
    cu_q = torch.tensor([0, 17, 18, 58], dtype=torch.int32)
    cu_k = torch.tensor([0, 23, 32, 72], dtype=torch.int32)
    q = torch.randn(58, h_q, d, generator=g)
    k = torch.randn(72, h_k, d, generator=g)
    v = torch.randn(72, h_k, d, generator=g)
    qs = torch.rand(3, h_k, generator=g) + 0.01
    ks = torch.rand(3, h_k, generator=g) + 0.01
    vs = torch.rand(3, h_k, generator=g) + 0.01
    q8, k8, v8 = (x.to(F8) for x in (q * 8, k * 8, v * 8))
    out = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 40, 40, causal=True, q_descale=qs,
                                 k_descale=ks, v_descale=vs)
    assert out.dtype == torch.bfloat16
    for i in range(3):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        ka, ke = int(cu_k[i]), int(cu_k[i + 1])
        qd = q8[a:e].double() * qs[i].double().repeat_interleave(2)[None, :, None]
        kd = k8[ka:ke].double() * ks[i].double()[None, :, None]
        vd = v8[ka:ke].double() * vs[i].double()[None, :, None]
        o64, _ = attention64(qd, kd, vd, d ** -0.5, causal=True)
        tol = 2 * 2.0 ** -8 * max(o64.abs().max().item(), 1e-30) + 1e-6
        assert (out[a:e].double() - o64).abs().max().item() <= tol


def test_descales_default_to_one():
    g = torch.Generator().manual_seed(6)
    q8, k8, v8 = (torch.randn(1, 9, 2, 8, generator=g).to(F8) for _ in range(3))
    ones = torch.ones(1, 2)
    a = flash_attn_func(q8, k8, v8)
    b = flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones)
    assert torch.equal(a, b)
    c = flash_attn_func(q8, k8, v8, v_descale=ones * 2)
    torch.testing.assert_close(c.float(), 2 * a.float(), rtol=2 ** -7, atol=0)


# test_schema compares the outputs with ops torch lacks for float8 on the CPU
# ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): the fake kernels and the
# autograd registration are checked.
_UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_ops_opcheck():
    g = torch.Generator().manual_seed(7)
    q8 = torch.randn(2, 5, 4, 8, generator=g).to(F8)
    k8 = torch.randn(2, 7, 2, 8, generator=g).to(F8)
    v8 = torch.randn(2, 7, 2, 8, generator=g).to(F8)
    ds = torch.rand(2, 2, generator=g) + 0.5
    torch.library.opcheck(ops.fwd_fp8, (q8, k8, v8, ds, ds, None, None, None, 0.3, True, -1,
                                        -1, 0.0, torch.bfloat16),
                          test_utils=_UTILS)
    cu_q = torch.tensor([0, 2, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 9], dtype=torch.int32)
    torch.library.opcheck(ops.varlen_fwd_fp8,
                          (q8.view(10, 4, 8)[:7], k8.view(14, 2, 8)[:9], v8.view(14, 2, 8)[:9],
                           cu_q, cu_k, None, 5, 6, ds, None, ds, None, None, 0.3, False, -1, -1,
                           0.0, torch.float16),
                          test_utils=_UTILS)


def test_fp8_cuda_declines():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q8 = torch.randn(1, 4, 2, 8, device="cuda").to(F8)
    with pytest.raises(UnsupportedError, match="fp8 forward runs on the CPU backend"):
        flash_attn_func(q8, q8, q8)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_accuracy_harness_bound(outliers, causal):
    # The bound docs/fp8.md documents for the CPU backend: the fp8 forward's error against
    # fp64 over the dequantized inputs is the bf16 rounding of the output.
    from flashattn.fp8 import measure

    r = measure(b=2, s_q=96, s_k=160, h_q=4, h_k=2, d=64, causal=causal, outliers=outliers,
                seed=11)
    assert r["fp8"]["max"] <= 2.0 ** -8 * r["ref_max"], r
    assert r["fp8"]["mean"] <= r["bf16"]["mean"], r


# ------------------------------------------------ flash_attn_with_kvcache with fp8 q (FA3)


def _kv_reference(q8, qs, keys, values, lens, h_q, h_k, scale, causal, window, softcap):
    """fp64 out [b, s_q, h_q, d_v] from per-sequence dequantized keys / values lists."""
    qd = dequant(q8, qs, h_q // h_k)
    outs, lses = [], []
    for i in range(q8.shape[0]):
        o, l = attention64(qd[i], keys[i][: lens[i]], values[i][: lens[i]], scale, causal,
                           window, softcap)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (9, 0), 4.0)])
def test_kvcache_fp8_q_matches_fp64(paged, out_dtype, causal, window, softcap):
    g = torch.Generator().manual_seed(21 + paged)
    b, s_q, s_new, h_q, h_k, d, cap = 3, 3, 2, 6, 2, 24, 64
    lens = [5, 40, 17]
    # Per-sequence keys / values (the cached ones then the new ones), quantized per
    # (sequence, KV head) with descales that differ by sequence.
    k = torch.randn(b, cap, h_k, d, generator=g) * torch.tensor([1.0, 5.0, 0.2])[:, None, None, None]
    v = torch.randn(b, cap, h_k, d, generator=g)
    q = torch.randn(b, s_q, h_q, d, generator=g)
    k8, ks = quantize_e4m3(k, h_k)
    v8, vs = quantize_e4m3(v, h_k)
    q8, qs = quantize_e4m3(q, h_k)
    k_new = torch.stack([k8[i, lens[i]:lens[i] + s_new] for i in range(b)])
    v_new = torch.stack([v8[i, lens[i]:lens[i] + s_new] for i in range(b)])
    if paged:
        bs, per = 8, cap // 8
        perm = torch.randperm(b * per, generator=g)
        block_table = perm.view(b, per).to(torch.int32)
        k_cache = torch.full((b * per, bs, h_k, d), float("nan")).to(F8)
        v_cache = k_cache.clone()
        for i in range(b):
            for t in range(lens[i]):
                blk, row = int(block_table[i, t // bs]), t % bs
                k_cache[blk, row] = k8[i, t]
                v_cache[blk, row] = v8[i, t]
        kw = dict(block_table=block_table)
    else:
        k_cache = torch.full((b, cap, h_k, d), float("nan")).to(F8)
        v_cache = k_cache.clone()
        for i in range(b):
            k_cache[i, : lens[i]] = k8[i, : lens[i]]
            v_cache[i, : lens[i]] = v8[i, : lens[i]]
        kw = {}
    seqlens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    out, lse = flashattn.flash_attn_with_kvcache(
        q8, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=causal,
        window_size=window, softcap=softcap, num_splits=2, return_softmax_lse=True,
        q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=out_dtype, **kw)
    assert out.dtype == out_dtype and out.shape == (b, s_q, h_q, d)
    # The append copied the new bytes at cache_seqlens.
    for i in range(b):
        for r in range(s_new):
            t = lens[i] + r
            if paged:
                blk, row = int(block_table[i, t // 8]), t % 8
                got_k, got_v = k_cache[blk, row], v_cache[blk, row]
            else:
                got_k, got_v = k_cache[i, t], v_cache[i, t]
            assert torch.equal(got_k.view(torch.uint8), k_new[i, r].view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), v_new[i, r].view(torch.uint8))
    kd, vd = dequant(k8, ks, 1), dequant(v8, vs, 1)
    o64, l64 = _kv_reference(q8, qs, kd, vd, [n + s_new for n in lens], h_q, h_k, scale, causal,
                             window, softcap)
    eps = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    assert (out.double() - o64).abs().max().item() <= 2 * eps * o64.abs().max().item() + 1e-6
    assert (lse.double() - l64).abs().max().item() <= 1e-4 * max(1.0, l64.abs().max().item())


def test_kvcache_fp8_q_leftpad_sink_and_default_descales():
    g = torch.Generator().manual_seed(31)
    b, s_q, h_q, h_k, d, cap = 2, 2, 4, 1, 16, 30
    lens, pads = [20, 9], [6, 0]
    k8 = torch.randn(b, cap, h_k, d, generator=g).to(F8)
    v8 = torch.randn(b, cap, h_k, d, generator=g).to(F8)
    q8 = torch.randn(b, s_q, h_q, d, generator=g).to(F8)
    sink = torch.randn(h_q, generator=g)
    out = flashattn.flash_attn_with_kvcache(
        q8, k8, v8, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32), causal=True,
        learnable_sink=sink)
    assert out.dtype == torch.bfloat16
    scale = d ** -0.5
    for i in range(b):
        qd = q8[i].double()
        kd = k8[i, pads[i]:lens[i]].double()
        vd = v8[i, pads[i]:lens[i]].double()
        s = torch.einsum("ihd,jhd->hij", qd, kd.expand(-1, h_q, -1)) * scale
        n = lens[i] - pads[i]
        visible = torch.arange(n)[None, :] <= torch.arange(s_q)[:, None] + n - s_q
        s = s.masked_fill(~visible, -math.inf)
        m = torch.maximum(s.amax(-1), sink.double()[:, None])
        p = torch.exp(s - m[..., None])
        denom = p.sum(-1) + torch.exp(sink.double()[:, None] - m)
        o64 = torch.einsum("hij,jhd->ihd", p / denom[..., None], vd.expand(-1, h_q, -1))
        assert (out[i].double() - o64).abs().max().item() <= 2 * 2.0 ** -8 * o64.abs().max().item() + 1e-6


def test_kvcache_fp8_q_rules():
    q8 = torch.randn(1, 1, 2, 8).to(F8)
    c8 = torch.randn(1, 16, 2, 8).to(F8)
    c16 = torch.randn(1, 16, 2, 8).to(torch.bfloat16)
    lens = torch.tensor([4], dtype=torch.int32)
    ds = torch.ones(1, 2)
    # fp8 q needs an fp8 cache.
    with pytest.raises(flashattn.InvalidArgumentError, match="'k_cache'.*float8_e4m3"):
        flashattn.flash_attn_with_kvcache(q8, c16, c16, cache_seqlens=lens)
    # no k_scale / v_scale with fp8 q.
    with pytest.raises(flashattn.InvalidArgumentError, match="'k_scale'.*q is float8_e4m3"):
        flashattn.flash_attn_with_kvcache(q8, c8, c8, cache_seqlens=lens,
                                          k_scale=torch.ones(2), v_scale=torch.ones(2))
    # descales [b, h_k].
    with pytest.raises(flashattn.InvalidArgumentError, match="'k_descale'.*\\[1, 2\\]"):
        flashattn.flash_attn_with_kvcache(q8, c8, c8, cache_seqlens=lens,
                                          k_descale=torch.ones(2))
    # out_dtype bf16 / fp16 only.
    with pytest.raises(flashattn.InvalidArgumentError, match="'out_dtype'"):
        flashattn.flash_attn_with_kvcache(q8, c8, c8, cache_seqlens=lens, out_dtype=torch.float32)
    # descales without fp8 q.
    with pytest.raises(flashattn.InvalidArgumentError, match="'q_descale'.*not float8_e4m3"):
        flashattn.flash_attn_with_kvcache(q8.to(torch.bfloat16), c16, c16, cache_seqlens=lens,
                                          q_descale=ds)
    # rotary: rotate before quantizing.
    cos = torch.ones(32, 4)
    with pytest.raises(UnsupportedError, match="'rotary_cos'"):
        flashattn.flash_attn_with_kvcache(q8, c8, c8, q8.view(1, 1, 2, 8)[:, :, :2],
                                          q8.view(1, 1, 2, 8)[:, :, :2], rotary_cos=cos,
                                          rotary_sin=cos, cache_seqlens=lens)


def test_kvcache_fp8_q_opcheck():
    g = torch.Generator().manual_seed(41)
    q8 = torch.randn(2, 2, 4, 8, generator=g).to(F8)
    kc = torch.randn(2, 16, 2, 8, generator=g).to(F8)
    vc = torch.randn(2, 16, 2, 8, generator=g).to(F8)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    ds = torch.rand(2, 2, generator=g) + 0.5
    torch.library.opcheck(ops.kvcache_fwd,
                          (q8, kc, vc, lens, None, None, None, None, None, 0.3, True, -1, -1,
                           0.0, 1, None, None, None, None, None, None, ds, ds, ds,
                           torch.float16),
                          test_utils=_UTILS)


def test_kvcache_fp8_q_cuda_declines():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q8 = torch.randn(1, 1, 2, 8, device="cuda").to(F8)
    c8 = torch.randn(1, 16, 2, 8, device="cuda").to(F8)
    with pytest.raises(UnsupportedError, match="'q'"):
        flashattn.flash_attn_with_kvcache(q8, c8, c8, cache_seqlens=4)
