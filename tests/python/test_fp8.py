"""fp8 (e4m3) q, k, v through the torch layer on CPU tensors (issue 21): flash_attn_func and
flash_attn_varlen_func with FlashAttention-3's q_descale / k_descale / v_descale ([b, h_k]
fp32), against an fp64 computation over the dequantized inputs, with causal / window /
GQA / softcap / odd lengths / outliers; bf16 and fp16 outputs; the ops under opcheck; and
the rules (no autograd through fp8). On an sm90 GPU (else skipped), the same functions on
CUDA tensors (the sm90 fp8 kernel) against fp64 over the dequantized inputs within the
bound of a kernel that rounds P to e4m3 (fp8_bound, as tests/support/fp8_bound.hpp); on any
GPU, the options the CUDA fp8 forward declines, and flash_attn_with_kvcache with fp8 q (the
decode kernel) against the CPU backend."""

import math

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import UnsupportedError, flash_attn_func, flash_attn_varlen_func, ops  # noqa: E402
from flashattn.fp8 import quantize_e4m3  # noqa: E402

F8 = torch.float8_e4m3fn


def masked_scores(q, k, scale, causal=False, window=(-1, -1), softcap=0.0):
    """Scores [h_q, s_q, s_k] of one sequence (q [s_q, h_q, d], k [s_k, h_k, d]), -inf where
    masked, and k repeated over the query heads of each group."""
    s_q, h_q, _ = q.shape
    s_k, h_k, _ = k.shape
    k = k.repeat_interleave(h_q // h_k, dim=1)
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
    return s.masked_fill(~visible, -math.inf), k


def attention64(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """fp64 attention of one sequence: q [s_q, h_q, d], k [s_k, h_k, d], v [s_k, h_k, d_v]."""
    s, _ = masked_scores(q, k, scale, causal, window, softcap)
    v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
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
    # The trailing arguments: dropout, probs, a block mask; seqused_q (varlen).
    rng = torch.tensor([5, 9], dtype=torch.int64)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    torch.library.opcheck(ops.fwd_fp8, (q8, k8, v8, ds, ds, ds, None, None, 0.3, False, -1,
                                        -1, 0.0, torch.bfloat16, rng, 0.25, True, cnt, idx,
                                        None, None, 4, 4),
                          test_utils=_UTILS)
    torch.library.opcheck(ops.varlen_fwd_fp8,
                          (q8.view(10, 4, 8)[:7], k8.view(14, 2, 8)[:9], v8.view(14, 2, 8)[:9],
                           cu_q, cu_k, None, 5, 6, ds, None, ds, None, None, 0.3, False, -1, -1,
                           0.0, torch.float16, rng, 0.1, True,
                           torch.tensor([1, 4], dtype=torch.int32)),
                          test_utils=_UTILS)


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


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_kvcache_fp8_q_cuda_matches_cpu(paged, out_dtype):
    # CUDA tensors run the decode kernel: out / lse as the CPU backend's (both within the
    # output's rounding of fp64), the appended bytes the same; non-contiguous descales are
    # made contiguous by the torch layer.
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(41 + paged)
    b, s_q, s_new, h_q, h_k, d, cap = 3, 2, 3, 8, 2, 64, 1040
    lens = [1, 77, 1000]
    q8 = torch.randn(b, s_q, h_q, d, generator=g).to(F8)
    k_new = torch.randn(b, s_new, h_k, d, generator=g).to(F8)
    v_new = torch.randn(b, s_new, h_k, d, generator=g).to(F8)
    ds = [(torch.rand(h_k, b, generator=g) * 0.2 + 0.002).t() for _ in range(3)]  # strided
    if paged:
        bs = 16
        per = cap // bs
        block_table = torch.randperm(b * per, generator=g).view(b, per).to(torch.int32)
        k_cache = torch.randn(b * per, bs, h_k, d, generator=g).to(F8)
    else:
        block_table = None
        k_cache = torch.randn(b, cap, h_k, d, generator=g).to(F8)
    v_cache = torch.randn(k_cache.shape, generator=g).to(F8)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    results = {}
    for dev in ("cpu", "cuda"):
        kc, vc = k_cache.clone().to(dev), v_cache.clone().to(dev)
        out, lse = flashattn.flash_attn_with_kvcache(
            q8.to(dev), kc, vc, k_new.to(dev), v_new.to(dev), cache_seqlens=seqlens.to(dev),
            block_table=None if block_table is None else block_table.to(dev), causal=True,
            num_splits=0, return_softmax_lse=True, q_descale=ds[0].to(dev),
            k_descale=ds[1].to(dev), v_descale=ds[2].to(dev), out_dtype=out_dtype)
        results[dev] = (out.cpu(), lse.cpu(), kc.cpu(), vc.cpu())
    (oc, lc, kcc, vcc), (og, lg, kcg, vcg) = results["cpu"], results["cuda"]
    assert og.dtype == out_dtype
    assert torch.equal(kcg.view(torch.uint8), kcc.view(torch.uint8))
    assert torch.equal(vcg.view(torch.uint8), vcc.view(torch.uint8))
    eps = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    assert (og.double() - oc.double()).abs().max().item() <= 4 * eps * oc.double().abs().max().item() + 1e-6
    assert (lg.double() - lc.double()).abs().max().item() <= 1e-4 * max(1.0, lc.abs().max().item())


def test_kvcache_fp8_q_cuda_declines_d_v():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    q8 = torch.randn(1, 1, 2, 64, device="cuda").to(F8)
    k8 = torch.randn(1, 16, 2, 64, device="cuda").to(F8)
    v8 = torch.randn(1, 16, 2, 128, device="cuda").to(F8)
    with pytest.raises(UnsupportedError, match="'v_cache'"):
        flashattn.flash_attn_with_kvcache(q8, k8, v8, cache_seqlens=4)


# ------------------------------- dropout, probs, block masks, seqused_q, paged varlen (fp8)


def _softmax64(q, k, scale, visible):
    """fp64 P [h_q, s_q, s_k] of one sequence (q [s_q, h_q, d], k [s_k, h_k, d]) with the
    element mask visible [h_q or 1, s_q, s_k]; rows that see nothing are 0."""
    r = q.shape[1] // k.shape[1]
    s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(r, dim=1)) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0), lse


def _causal(s_q, s_k):
    return (torch.arange(s_k)[None, :] <= torch.arange(s_q)[:, None] + s_k - s_q)[None]


def _quantized(g, b, s_q, s_k, h_q, h_k, d):
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((s_q, h_q), (s_k, h_k), (s_k, h_k)))
    q = q * torch.linspace(0.5, 2.0, b)[:, None, None, None]
    q8, qs = quantize_e4m3(q, h_k)
    k8, ks = quantize_e4m3(k, h_k)
    v8, vs = quantize_e4m3(v, h_k)
    return (q8, k8, v8), (qs, ks, vs), (dequant(q8, qs, h_q // h_k), dequant(k8, ks, 1),
                                        dequant(v8, vs, 1))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_fp8_probs_and_dropout_match_fp64(out_dtype):
    b, s_q, s_k, h_q, h_k, d, p = 2, 29, 47, 4, 2, 16, 0.3
    g = torch.Generator().manual_seed(51)
    (q8, k8, v8), (qs, ks, vs), (qd, kd, vd) = _quantized(g, b, s_q, s_k, h_q, h_k, d)
    kw = dict(causal=True, q_descale=qs, k_descale=ks, v_descale=vs, out_dtype=out_dtype,
              return_attn_probs=True)
    eps = 2.0 ** -8 if out_dtype == torch.bfloat16 else 2.0 ** -11
    # Without dropout: probs are P over the dequantized inputs.
    _, lse0, probs0 = flash_attn_func(q8, k8, v8, **kw)
    assert probs0.dtype == torch.float32 and probs0.shape == (b, h_q, s_q, s_k)
    # With dropout: the kept set comes from torch's default generator (reproducible), probs
    # are P where kept and 0 where dropped, out = sum_j probs_ij v_j / (1 - p).
    torch.manual_seed(1234)
    out, lse, probs = flash_attn_func(q8, k8, v8, dropout_p=p, **kw)
    torch.manual_seed(1234)
    out2, _, probs2 = flash_attn_func(q8, k8, v8, dropout_p=p, **kw)
    assert torch.equal(out.view(torch.uint8), out2.view(torch.uint8)) and torch.equal(probs, probs2)
    torch.manual_seed(1235)
    _, _, probs3 = flash_attn_func(q8, k8, v8, dropout_p=p, **kw)
    assert not torch.equal(probs, probs3)
    # The 16-bit path seeds its dropout the same way: same seed, same kept set.
    torch.manual_seed(1234)
    _, _, probs16 = flash_attn_func(qd.float(), kd.float(), vd.float(), dropout_p=p,
                                    causal=True, return_attn_probs=True)
    visible = _causal(s_q, s_k)
    dropped = 0
    for i in range(b):
        p64, l64 = _softmax64(qd[i], kd[i], d ** -0.5, visible)
        assert (probs0[i].double() - p64).abs().max().item() <= 1e-5
        assert (lse0[i].double() - l64).abs().max().item() <= 1e-4 * l64.abs().max().item()
        assert torch.equal(lse[i], lse0[i])  # lse is that of P, before dropout
        kept = probs[i] != 0
        assert torch.equal(kept, probs16[i] != 0)
        assert (probs[i].double() - p64 * kept).abs().max().item() <= 1e-5
        dropped += ((~kept) & (p64 > 0)).sum().item()
        vr = vd[i].repeat_interleave(h_q // h_k, dim=1)
        o64 = torch.einsum("hij,jhd->ihd", p64 * kept / (1 - p), vr)
        assert (out[i].double() - o64).abs().max().item() <= 2 * eps * o64.abs().max().item() + 1e-6
    n = visible.sum().item() * b * h_q
    assert abs(dropped / n - p) < 0.05, dropped / n


def test_fp8_block_sparse_matches_fp64():
    from flashattn.block_sparse import BlockSparseTensorsTorch

    b, s_q, s_k, h_q, h_k, d, bq, bk = 2, 37, 70, 4, 2, 32, 16, 16
    g = torch.Generator().manual_seed(61)
    (q8, k8, v8), (qs, ks, vs), (qd, kd, vd) = _quantized(g, b, s_q, s_k, h_q, h_k, d)
    M, N = -(-s_q // bq), -(-s_k // bk)
    # Per (batch, head, query block): a random set of partial key blocks and one full block.
    cnt = torch.zeros(b, h_q, M, dtype=torch.int32)
    idx = torch.zeros(b, h_q, M, N, dtype=torch.int32)
    fcnt = torch.zeros(b, h_q, M, dtype=torch.int32)
    fidx = torch.zeros(b, h_q, M, N, dtype=torch.int32)
    visible = torch.zeros(b, h_q, s_q, s_k, dtype=torch.bool)
    listed = torch.zeros(b, N, dtype=torch.bool)
    causal = _causal(s_q, s_k)[0]
    for i in range(b):
        for h in range(h_q):
            for m in range(M):
                perm = torch.randperm(N - 1, generator=g)  # key block N - 1 is never listed
                n = int(torch.randint(0, 4, (1,), generator=g))
                part, full = perm[:n], perm[n:n + 1]
                cnt[i, h, m], fcnt[i, h, m] = n, 1
                idx[i, h, m, :n], fidx[i, h, m, :1] = part, full
                rows = slice(m * bq, (m + 1) * bq)
                for blk in part.tolist():
                    cols = slice(blk * bk, (blk + 1) * bk)
                    visible[i, h, rows, cols] = causal[rows, cols]
                    listed[i, blk] = True
                visible[i, h, rows, full.item() * bk:(full.item() + 1) * bk] = True
    # Unlisted keys are never read: NaN there would poison out.
    v8 = v8.clone()
    v8[:, (N - 1) * bk:] = float("nan")
    mask = BlockSparseTensorsTorch(cnt, idx, fcnt, fidx, block_size=(bq, bk))
    out, lse, probs = flash_attn_func(q8, k8, v8, causal=True, q_descale=qs, k_descale=ks,
                                      v_descale=vs, block_sparse_tensors=mask,
                                      return_attn_probs=True)
    assert torch.isfinite(out.float()).all()
    for i in range(b):
        p64, l64 = _softmax64(qd[i], kd[i], d ** -0.5, visible[i])
        o64 = torch.einsum("hij,jhd->ihd", p64, vd[i].repeat_interleave(h_q // h_k, dim=1))
        assert (out[i].double() - o64).abs().max().item() <= 2 * 2.0 ** -8 * o64.abs().max().item() + 1e-6
        assert (probs[i].double() - p64).abs().max().item() <= 1e-5
        fin = torch.isfinite(l64)
        assert torch.equal(torch.isfinite(lse[i]), fin)
        assert (lse[i].double()[fin] - l64[fin]).abs().max().item() <= 1e-4 * l64[fin].abs().max().item()


def _varlen_fp8_case(seed, lens_q, lens_k, h_q, h_k, d):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h_q, d, generator=g)
    k = torch.randn(int(cu_k[-1]), h_k, d, generator=g) * 3
    v = torch.randn(int(cu_k[-1]), h_k, d, generator=g)
    b = len(lens_q)
    descales = [torch.rand(b, h_k, generator=g) * 0.5 + 0.05 for _ in range(3)]
    q8, k8, v8 = (x.to(F8) for x in (q * 4, k, v * 16))
    return g, cu_q, cu_k, (q8, k8, v8), descales


def _varlen_seq64(q8, k8, v8, descales, i, cu_q, cu_k, h_q, h_k):
    qs, ks, vs = descales
    a, e, ka, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
    qd = q8[a:e].double() * qs[i].double().repeat_interleave(h_q // h_k)[None, :, None]
    kd = k8[ka:ke].double() * ks[i].double()[None, :, None]
    vd = v8[ka:ke].double() * vs[i].double()[None, :, None]
    return qd, kd, vd


def test_varlen_fp8_seqused_q_probs_dropout_match_fp64():
    lens_q, lens_k, h_q, h_k, d = [17, 1, 40, 6], [23, 9, 40, 30], 4, 2, 24
    g, cu_q, cu_k, (q8, k8, v8), (qs, ks, vs) = _varlen_fp8_case(71, lens_q, lens_k, h_q, h_k, d)
    used_q = torch.tensor([11, 1, 0, 6], dtype=torch.int32)
    used_k = torch.tensor([23, 5, 40, 17], dtype=torch.int32)
    p, max_k = 0.2, 40
    torch.manual_seed(99)
    out, lse, probs = flash_attn_varlen_func(
        q8, k8, v8, cu_q, cu_k, 40, max_k, dropout_p=p, causal=True, return_attn_probs=True,
        seqused_q=used_q, seqused_k=used_k, q_descale=qs, k_descale=ks, v_descale=vs,
        out_dtype=torch.float16)
    assert out.dtype == torch.float16 and probs.shape == (h_q, int(cu_q[-1]), max_k)
    for i in range(len(lens_q)):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        qd, kd, vd = _varlen_seq64(q8, k8, v8, (qs, ks, vs), i, cu_q, cu_k, h_q, h_k)
        nq, nk = int(used_q[i]), int(used_k[i])
        # Rows past seqused_q: out 0, lse -inf, probs 0.
        assert torch.equal(out[a + nq:e].float(), torch.zeros_like(out[a + nq:e].float()))
        assert torch.isneginf(lse[:, a + nq:e]).all()
        assert not probs[:, a + nq:e].any()
        if nq == 0:
            continue
        # The sequence has s_q = seqused_q[i] queries and s_k = seqused_k[i] keys (causal
        # aligned to those, docs/semantics.md).
        p64, l64 = _softmax64(qd[:nq], kd[:nk], d ** -0.5, _causal(nq, nk))
        got = probs[:, a:a + nq, :nk]
        kept = got != 0
        assert (got.double() - p64 * kept).abs().max().item() <= 1e-5
        assert not probs[:, a:a + nq, nk:].any()
        fin = torch.isfinite(l64)
        assert (lse[:, a:a + nq].double()[fin] - l64[fin]).abs().max().item() <= 1e-4 * l64[fin].abs().max().item()
        vr = vd[:nk].repeat_interleave(h_q // h_k, dim=1)
        o64 = torch.einsum("hij,jhd->ihd", p64 * kept / (1 - p), vr)
        tol = 2 * 2.0 ** -11 * o64.abs().max().item() + 1e-6
        assert (out[a:a + nq].double() - o64).abs().max().item() <= tol


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_fp8_block_table_matches_unpaged(block_size):
    lens_q, lens_k, h_q, h_k, d = [5, 1, 33], [21, 9, 40], 6, 2, 16
    g, cu_q, cu_k, (q8, k8, v8), descales = _varlen_fp8_case(81 + block_size, lens_q, lens_k,
                                                             h_q, h_k, d)
    b = len(lens_q)
    per = -(-max(lens_k) // block_size)
    num_blocks = b * per + 3
    # Sequence i's keys scattered over a random permutation of blocks; the rest NaN.
    perm = torch.randperm(num_blocks, generator=g)[: b * per]
    table = perm.view(b, per).to(torch.int32)
    kc = torch.full((num_blocks, block_size, h_k, d), float("nan")).to(F8)
    vc = kc.clone()
    for i in range(b):
        for t in range(lens_k[i]):
            blk, row = int(table[i, t // block_size]), t % block_size
            kc[blk, row] = k8[int(cu_k[i]) + t]
            vc[blk, row] = v8[int(cu_k[i]) + t]
    kw = dict(causal=True, window_size=(12, 0), softcap=3.0, q_descale=descales[0],
              k_descale=descales[1], v_descale=descales[2])
    used_k = torch.tensor([21, 4, 39], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q8, kc, vc, cu_q, cu_k, 33, 40, block_table=table,
                                         seqused_k=used_k, return_attn_probs=True, **kw)
    ref, ref_lse, _ = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 33, 40, seqused_k=used_k,
                                             return_attn_probs=True, **kw)
    # The gather moves bytes: the same keys in the same order give the same result.
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(lse, ref_lse)
    for i in range(b):
        qd, kd, vd = _varlen_seq64(q8, k8, v8, descales, i, cu_q, cu_k, h_q, h_k)
        nk = int(used_k[i])
        o64, _ = attention64(qd, kd[:nk], vd[:nk], d ** -0.5, True, (12, 0), 3.0)
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        assert (out[a:e].double() - o64).abs().max().item() <= 2 * 2.0 ** -8 * o64.abs().max().item() + 1e-6


def test_varlen_fp8_block_sparse_matches_fp64():
    from flashattn.block_sparse import BlockSparseTensorsTorch

    lens_q, lens_k, h_q, h_k, d, bq, bk = [9, 20], [30, 12], 2, 1, 8, 4, 8
    _, cu_q, cu_k, (q8, k8, v8), descales = _varlen_fp8_case(91, lens_q, lens_k, h_q, h_k, d)
    max_q, max_k = 20, 30
    M, N = -(-max_q // bq), -(-max_k // bk)
    # Query block m of every sequence / head visits key block m % N only (partial, causal).
    cnt = torch.ones(1, 1, M, dtype=torch.int32)
    idx = torch.zeros(1, 1, M, N, dtype=torch.int32)
    idx[0, 0, :, 0] = torch.arange(M) % N
    mask = BlockSparseTensorsTorch(cnt, idx, block_size=(bq, bk))
    out = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, max_q, max_k, causal=True,
                                 block_sparse_tensors=mask, q_descale=descales[0],
                                 k_descale=descales[1], v_descale=descales[2])
    for i in range(2):
        qd, kd, vd = _varlen_seq64(q8, k8, v8, descales, i, cu_q, cu_k, h_q, h_k)
        s_q, s_k = lens_q[i], lens_k[i]
        rows, cols = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
        vis = (cols // bk == (rows // bq) % N) & _causal(s_q, s_k)[0]
        p64, _ = _softmax64(qd, kd, d ** -0.5, vis[None])
        o64 = torch.einsum("hij,jhd->ihd", p64, vd.repeat_interleave(h_q // h_k, dim=1))
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        assert (out[a:e].double() - o64).abs().max().item() <= 2 * 2.0 ** -8 * o64.abs().max().item() + 1e-6


def test_fp8_qv_declined():
    q8 = torch.randn(1, 4, 2, 8).to(F8)
    with pytest.raises(UnsupportedError, match="'qv'"):
        flash_attn_func(q8, q8, q8, qv=q8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="'qv'"):
        flash_attn_varlen_func(q8[0], q8[0], q8[0], cu, cu, 4, 4, qv=q8[0])


def test_fp8_has_no_autograd():
    q8 = torch.randn(1, 4, 2, 8).to(F8)
    out, lse, probs = flash_attn_func(q8, q8, q8, dropout_p=0.1, return_attn_probs=True)
    assert not out.requires_grad and probs.shape == (1, 2, 4, 4)


# ------------------------------------------------ CUDA tensors: the sm90 fp8 kernel

_HAS_GPU = torch.cuda.is_available()
_SM90 = _HAS_GPU and torch.cuda.get_device_capability()[0] == 9
needs_gpu = pytest.mark.skipif(not _HAS_GPU, reason="no CUDA device")
needs_sm90 = pytest.mark.skipif(not _SM90, reason="the CUDA fp8 forward runs on sm90 (compute "
                                "capability 9.x)" + ("" if not _HAS_GPU else
                                f"; this GPU is {torch.cuda.get_device_capability()}"))

# The arithmetic margin of the bound (tests/support/fp8_bound.hpp has the derivation): the
# fp8 tensor-core sums keep about 14 bits per k-step of 32 products; margin steps for Q K^T
# (the fp32 scaling) and P V (partial key tiles).
_MMA_EPS, _MMA_K, _QK_EXTRA, _PV_EXTRA = 2.0 ** -13, 32, 1, 8


def fp8_bound(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, out_dtype=torch.bfloat16):
    """For one sequence of fp64 dequantized q [s_q, h_q, d], k [s_k, h_k, d], v [s_k, h_k,
    d_v]: (out64 [s_q, h_q, d_v], lse64 [h_q, s_q], out bound, lse bound) for a kernel that
    rounds the unnormalized P (in [0, 256] against a reference max at most 8 below the row
    max in log2 units) to e4m3 with round-to-nearest before P V, sums the fp32 P and rounds
    out once: per element sum_j (2^-4 p_j + 2^-10) |v_j| / l, grown by the score error
    e^(2 delta) (fp8 MMA accumulation and fp32 roundings), plus the P V accumulation, the
    row sum and the output rounding (2^-8 bf16, 2^-11 fp16) of |out|. Rows that see no
    key: exact (out 0, lse -inf)."""
    d = q.shape[2]
    s, kk = masked_scores(q, k, scale, causal, window, softcap)
    vv = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    lse = torch.logsumexp(s, dim=-1)  # [h, i]
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hij,jhd->ihd", p, vv)
    vis = p > 0
    mag = torch.einsum("hij,jhd->ihd", p, vv.abs())
    abs_v = torch.einsum("hij,jhd->ihd", vis.double(), vv.abs())
    p_max = p.amax(dim=-1)  # 1 / l
    row_max = lse + torch.log(p_max)
    few = 2.0 ** -20
    terms = torch.einsum("ihd,jhd->hij", q.abs(), kk.abs())  # sum_c |q_c k_jc|
    eps_qk = ((d + _MMA_K - 1) // _MMA_K + _QK_EXTRA) * _MMA_EPS
    dj = (eps_qk + few) * scale * terms + few * (s.abs() + row_max.abs()[..., None])
    delta = torch.where(vis, dj, torch.zeros_like(dj)).amax(dim=-1)  # [h, i]
    n = vis.sum(dim=-1).double()
    grow, moved = torch.exp(2 * delta), torch.expm1(2 * delta)
    sums = ((n + _MMA_K - 1) // _MMA_K + _PV_EXTRA) * _MMA_EPS + (n + 8) * 2.0 ** -24
    to_ihd = lambda x: x.T[:, :, None]  # noqa: E731  [h, i] -> [i, h, 1]
    quant = 2.0 ** -4 * mag + 2.0 ** -10 * to_ihd(p_max) * abs_v
    pre = to_ihd(grow) * quant + to_ihd(moved) * mag + to_ihd(sums * grow) * (mag + quant)
    u, floor = (2.0 ** -8, 2.0 ** -134) if out_dtype == torch.bfloat16 else (2.0 ** -11, 2.0 ** -25)
    out_bound = pre + u * (out.abs() + pre) + floor
    lse_bound = delta + (n + 8) * 2.0 ** -24 + 2.0 ** -21 * (lse.abs() + row_max.abs() + 1.0)
    return out, lse, out_bound, lse_bound.nan_to_num(0.0, posinf=0.0)


def assert_within(got, ref, bound, what):
    """|got - ref| <= bound element by element (non-finite ref: matched exactly; no NaN);
    returns the fraction max |got - ref| / bound."""
    got = got.double().cpu()
    assert not torch.isnan(got).any(), f"{what}: NaN in the result (an unwritten or poisoned element)"
    finite = torch.isfinite(ref)
    assert torch.equal(got[~finite], ref[~finite]), f"{what}: rows that see no key differ"
    err = (got - ref).abs()[finite]
    b = bound[finite]
    frac = torch.where(err == 0, torch.zeros_like(err), err / b)
    worst = frac.max().item() if frac.numel() else 0.0
    at = int(frac.argmax()) if frac.numel() else 0
    assert worst <= 1.0, (f"{what}: max |got - ref| / bound = {worst:.4g} (err {err[at].item():.4g}, "
                          f"bound {b[at].item():.4g}; {(frac > 1).sum().item()} of {frac.numel()} over)")
    return worst


def _spread_quantize(g, x, h_k, log2_span, omit=False):
    """x [b, s, h, d] scaled per (sequence, KV head) by 2^U(-span, span), quantized with
    amax / 448 descales; omit: descale 1 (None) instead."""
    b, _, h, _ = x.shape
    f = torch.exp2((torch.rand(b, h_k, generator=g) * 2 - 1) * log2_span)
    x = x * f.repeat_interleave(h // h_k, dim=1)[:, None, :, None]
    if omit:
        return x.to(F8), None
    return quantize_e4m3(x, h_k)


def _model_p_quantizing_kernel(q, k, v, scale, causal, lag, out_dtype):
    """A torch model of the CUDA kernel for one sequence (fp64 dequantized inputs): P' =
    exp(s - (row max - lag)) rounded to e4m3 for P V, the unrounded sum for l, out rounded
    once to out_dtype."""
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, kk) * scale
    if causal:
        s = s.masked_fill(~_causal(q.shape[0], k.shape[0])[0], -math.inf)
    m_ref = s.amax(dim=-1, keepdim=True) - lag
    p = torch.exp(s - m_ref).nan_to_num(0.0)
    p8 = p.float().to(F8).double()
    return (torch.einsum("hij,jhd->ihd", p8, vv) / p.sum(-1).T[:, :, None]).to(out_dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_bound_holds_on_the_cpu_and_for_a_kernel_model(seed, causal):
    # The bound the CUDA tests use, on the host: the CPU backend's fp8 forward (exact but for
    # fp32 and the output rounding) and a model of the P-quantizing kernel stay within it,
    # and P rounded to e4m3 costs a visible part of it.
    g = torch.Generator().manual_seed(seed)
    b, s_q, s_k, h_q, h_k, d = 2, 77, 300, 4, 2, 128
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((s_q, h_q), (s_k, h_k), (s_k, h_k)))
    (q8, qs), (k8, ks), (v8, vs) = (_spread_quantize(g, x, h_k, span) for x, span in
                                    ((q, 1.0), (k, 1.0), (v, 2.0)))
    scale = d ** -0.5
    out, lse, _ = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qs, k_descale=ks,
                                  v_descale=vs, return_attn_probs=True)
    qd, kd, vd = dequant(q8, qs, h_q // h_k), dequant(k8, ks, 1), dequant(v8, vs, 1)
    cpu = model = 0.0
    for i in range(b):
        o64, l64, ob, lb = fp8_bound(qd[i], kd[i], vd[i], scale, causal)
        cpu = max(cpu, assert_within(out[i], o64, ob, "CPU out"))
        assert_within(lse[i], l64, lb, "CPU lse")
        lag = float(torch.rand(1, generator=g)) * 8 * math.log(2)
        m = _model_p_quantizing_kernel(qd[i], kd[i], vd[i], scale, causal, lag, torch.bfloat16)
        model = max(model, assert_within(m, o64, ob, "kernel model out"))
    assert model > cpu and model > 0.05, (cpu, model)


CUDA_CASES = [
    # b, s_q, s_k, h_q, h_k, d, causal, window, softcap, out dtype, omitted descale
    (2, 77, 300, 4, 2, 128, False, (-1, -1), 0.0, torch.bfloat16, None),
    (2, 300, 300, 4, 1, 256, True, (-1, -1), 0.0, torch.float16, None),
    (1, 1000, 1000, 2, 2, 128, False, (100, 17), 0.0, torch.bfloat16, "k"),
    (3, 1, 1000, 8, 2, 128, False, (-1, -1), 0.0, torch.bfloat16, None),
    (1, 77, 300, 4, 4, 256, True, (-1, -1), 30.0, torch.bfloat16, "v"),
    (2, 300, 77, 2, 1, 128, True, (-1, -1), 0.0, torch.bfloat16, "q"),
]


@needs_sm90
@pytest.mark.parametrize("b,s_q,s_k,h_q,h_k,d,causal,window,softcap,out_dtype,omit", CUDA_CASES)
def test_fp8_cuda_within_bound_of_fp64(seed, b, s_q, s_k, h_q, h_k, d, causal, window, softcap,
                                       out_dtype, omit):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((s_q, h_q), (s_k, h_k), (s_k, h_k)))
    q8, qs = _spread_quantize(g, q, h_k, 1.0, omit == "q")
    k8, ks = _spread_quantize(g, k, h_k, 1.0, omit == "k")
    v8, vs = _spread_quantize(g, v, h_k, 2.0, omit == "v")
    ones = torch.ones(b, h_k)
    qd, kd, vd = (dequant(x8, ones if ds is None else ds, r)
                  for x8, ds, r in ((q8, qs, h_q // h_k), (k8, ks, 1), (v8, vs, 1)))
    if ks is not None:
        ks = ks.T.contiguous().T  # a transposed [b, h_k] view: the torch layer makes it contiguous
    scale = d ** -0.5
    dev = [None if t is None else t.cuda() for t in (q8, k8, v8, qs, ks, vs)]
    out, lse, s_dmask = flash_attn_func(*dev[:3], softmax_scale=scale, causal=causal,
                                        window_size=window, softcap=softcap, q_descale=dev[3],
                                        k_descale=dev[4], v_descale=dev[5], out_dtype=out_dtype,
                                        return_attn_probs=True)
    assert out.is_cuda and out.dtype == out_dtype and s_dmask is None
    worst = 0.0
    for i in range(b):
        o64, l64, ob, lb = fp8_bound(qd[i], kd[i], vd[i], scale, causal, window, softcap, out_dtype)
        worst = max(worst, assert_within(out[i], o64, ob, f"out of sequence {i}"))
        assert_within(lse[i], l64, lb, f"lse of sequence {i}")
    print(f"CUDA fp8 max |err| / bound: {worst:.3f}")


@needs_sm90
def test_varlen_fp8_cuda_within_bound_of_fp64(seed):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k, h_q, h_k, d = [1, 77, 300], [300, 1, 1000], 4, 2, 128
    cu_q = torch.tensor([0, 1, 78, 378], dtype=torch.int32)
    cu_k = torch.tensor([0, 300, 301, 1301], dtype=torch.int32)
    used = torch.tensor([150, 1, 999], dtype=torch.int32)
    q8, k8, v8, ds = [], [], [], []
    for i in range(3):  # per sequence: its own descales
        q, k, v = (torch.randn(1, n, h, d, generator=g) for n, h in
                   ((lens_q[i], h_q), (lens_k[i], h_k), (lens_k[i], h_k)))
        parts = [_spread_quantize(g, x, h_k, span) for x, span in ((q, 1.0), (k, 1.0), (v, 2.0))]
        q8.append(parts[0][0][0])
        k8.append(parts[1][0][0])
        v8.append(parts[2][0][0])
        ds.append([pt[1][0] for pt in parts])
    q8, k8, v8 = torch.cat(q8), torch.cat(k8), torch.cat(v8)
    qs, ks, vs = (torch.stack([d_[t] for d_ in ds]) for t in range(3))
    out = flash_attn_varlen_func(q8.cuda(), k8.cuda(), v8.cuda(), cu_q.cuda(), cu_k.cuda(), 300, 1000,
                                 causal=True, seqused_k=used.cuda(), q_descale=qs.cuda(),
                                 k_descale=ks.cuda(), v_descale=vs.cuda())
    assert out.is_cuda and out.dtype == torch.bfloat16
    for i in range(3):
        a, e = int(cu_q[i]), int(cu_q[i + 1])
        ka, n = int(cu_k[i]), int(used[i])
        qd = q8[a:e].double() * qs[i].double().repeat_interleave(h_q // h_k)[None, :, None]
        kd = k8[ka:ka + n].double() * ks[i].double()[None, :, None]
        vd = v8[ka:ka + n].double() * vs[i].double()[None, :, None]
        o64, _, ob, _ = fp8_bound(qd, kd, vd, d ** -0.5, causal=True)
        assert_within(out[a:e], o64, ob, f"out of sequence {i}")


@needs_gpu
def test_fp8_cuda_declines_dropout_and_block_masks():
    # Before any kernel (on any GPU): the CUDA fp8 forward has no dropout or block mask.
    from flashattn.block_sparse import BlockSparseTensorsTorch

    q8 = torch.randn(2, 8, 2, 128, device="cuda").to(F8)
    k8 = torch.randn(2, 8, 1, 128, device="cuda").to(F8)
    ds = torch.ones(2, 1, device="cuda")
    with pytest.raises(UnsupportedError, match="'dropout_p'"):
        flash_attn_func(q8, k8, k8, dropout_p=0.1, q_descale=ds)
    cnt = torch.ones(1, 1, 1, dtype=torch.int32, device="cuda")
    idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(UnsupportedError, match="'block_sparse_tensors'"):
        flash_attn_func(q8, k8, k8, block_sparse_tensors=BlockSparseTensorsTorch(cnt, idx))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device="cuda")
    with pytest.raises(UnsupportedError, match="'dropout_p'"):
        flash_attn_varlen_func(q8.flatten(0, 1), k8.flatten(0, 1), k8.flatten(0, 1), cu, cu, 8, 8,
                               dropout_p=0.5)
