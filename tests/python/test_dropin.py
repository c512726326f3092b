"""The flash_attn drop-in's FA2 features of issue 24: cache_leftpad in
flash_attn_with_kvcache, head dims that are not a multiple of 8 on CUDA (zero-padded in the
Python layer), block_table (paged KV) in flash_attn_varlen_func, and S_dmask with dropout.

CUDA tensors take emulations in flashattn.interface (a left-padded cache as a paged cache
of block size 1, padded head dims, S_dmask from the CPU backend); the private switch
interface._EMULATE_CUDA runs them on CPU tensors, so these tests check them here against
the library's own CPU path and the numpy fp64 oracle."""

import contextlib
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (  # noqa: E402
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    interface,
)
import reference as ref  # noqa: E402


def np64(t):
    return t.detach().cpu().double().numpy()


@contextlib.contextmanager
def emulate_cuda(on=True):
    saved = interface._EMULATE_CUDA
    interface._EMULATE_CUDA = on
    try:
        yield
    finally:
        interface._EMULATE_CUDA = saved


# ------------------------------------------------------------------ cache_leftpad


def _leftpad_case(g, dtype, b=3, s_q=2, s_new=2, h_q=4, h_k=2, d=16, s_cache=40,
                  batch_idx=False):
    rows = b + 2 if batch_idx else b
    k_cache = torch.randn(rows, s_cache, h_k, d, generator=g).to(dtype)
    v_cache = torch.randn(rows, s_cache, h_k, d, generator=g).to(dtype)
    seqlens = torch.randint(0, s_cache - s_new + 1, (b,), generator=g, dtype=torch.int32)
    seqlens[0] = s_cache - s_new  # a full row
    leftpad = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=g)[0] for n in seqlens])
    leftpad = leftpad.to(torch.int32)
    leftpad[-1] = seqlens[-1]  # only the new keys
    idx = (torch.randperm(rows, generator=g)[:b].to(torch.int32) if batch_idx else None)
    for i in range(b):  # the padding rows are never read: NaN shows if they are
        r = i if idx is None else int(idx[i])
        k_cache[r, : int(leftpad[i])] = float("nan")
        v_cache[r, : int(leftpad[i])] = float("nan")
    q = torch.randn(b, s_q, h_q, d, generator=g).to(dtype)
    k_new = torch.randn(b, s_new, h_k, d, generator=g).to(dtype) if s_new else None
    v_new = torch.randn(b, s_new, h_k, d, generator=g).to(dtype) if s_new else None
    return q, k_cache, v_cache, k_new, v_new, seqlens, leftpad, idx


@pytest.mark.parametrize("emulate", [False, True], ids=["library", "as_paged"])
@pytest.mark.parametrize("causal,window,alibi", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                 (False, (5, 2), False), (True, (7, 0), True)])
@pytest.mark.parametrize("batch_idx", [False, True])
def test_cache_leftpad_matches_the_oracle(seed, emulate, causal, window, alibi, batch_idx):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, idx = _leftpad_case(g, torch.float64,
                                                            batch_idx=batch_idx)
    slopes = torch.rand(3, 4, generator=g, dtype=torch.float32) * 0.3 if alibi else None
    want, kc_want, vc_want = ref.kvcache_attention(
        np64(q), np64(kc), np64(vc), seqlens.numpy(), np64(kn), np64(vn),
        cache_batch_idx=None if idx is None else idx.numpy(), cache_leftpad=leftpad.numpy(),
        causal=causal, window=window, alibi_slopes=None if slopes is None else slopes.numpy())
    with emulate_cuda(emulate):
        out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                           cache_batch_idx=idx, cache_leftpad=leftpad,
                                           causal=causal, window_size=window,
                                           alibi_slopes=slopes, num_splits=int(seed % 3),
                                           return_softmax_lse=True)
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=3e-7, atol=1e-7)  # lse is fp32
    np.testing.assert_array_equal(np64(kc), kc_want)  # NaN padding untouched, append at seqlens
    np.testing.assert_array_equal(np64(vc), vc_want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_leftpad_half_precision_emulation_equals_library(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, idx = _leftpad_case(g, dtype, s_q=3, s_new=3, d=64)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    outs = []
    for emulate, (k_cache, v_cache) in zip((False, True), caches):
        with emulate_cuda(emulate):
            outs.append(flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn,
                                                cache_seqlens=seqlens, cache_leftpad=leftpad,
                                                causal=True, return_softmax_lse=True))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)
    assert torch.equal(caches[0][0].isnan(), caches[1][0].isnan())
    torch.testing.assert_close(caches[0][0], caches[1][0], rtol=0, atol=0, equal_nan=True)
    want, _, _ = ref.kvcache_attention(np64(q), np64(kc), np64(vc), seqlens.numpy(), np64(kn),
                                       np64(vn), cache_leftpad=leftpad.numpy(), causal=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    np.testing.assert_allclose(np64(outs[0][0]), want["out"], atol=tol, rtol=tol)


def test_cache_leftpad_rotary_positions_are_the_cache_rows(seed):
    """flash_attn rotates the new keys at cache_seqlens + t and q at cache_seqlens (+ i
    when causal) whatever the left padding: the rows' absolute positions."""
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, _ = _leftpad_case(g, torch.float64, d=32)
    cos, sin = (f(torch.rand(40, 8, generator=g, dtype=torch.float64) * 6)
                for f in (torch.cos, torch.sin))
    from flashattn.rotary import apply_rotary_emb
    q_ro = apply_rotary_emb(q, cos, sin, interleaved=True, seqlen_offsets=seqlens)
    k_ro = apply_rotary_emb(kn, cos, sin, interleaved=True, seqlen_offsets=seqlens)
    want, _, _ = ref.kvcache_attention(np64(q_ro), np64(kc), np64(vc), seqlens.numpy(),
                                       np64(k_ro), np64(vn), cache_leftpad=leftpad.numpy(),
                                       causal=True)
    for emulate in (False, True):
        with emulate_cuda(emulate):
            out = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=seqlens,
                                          cache_leftpad=leftpad, causal=True)
        np.testing.assert_allclose(np64(out), want["out"], rtol=1e-9, atol=1e-10)


def test_cache_leftpad_fp8_per_row_scales(seed):
    """An fp8 cache with per-(cache row, head) scales through the as-paged emulation
    (the scales become per-slot) equals the library's own cache_leftpad."""
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, _ = _leftpad_case(g, torch.bfloat16)
    kc8, vc8 = (c.nan_to_num(0.0).float().mul(4).to(torch.float8_e4m3fn) for c in (kc, vc))
    ks, vs = (torch.rand(3, 2, generator=g) * 0.1 + 0.05 for _ in range(2))
    res = []
    for emulate in (False, True):
        k8, v8 = kc8.clone(), vc8.clone()
        with emulate_cuda(emulate):
            out = flash_attn_with_kvcache(q, k8, v8, kn, vn, cache_seqlens=seqlens,
                                          cache_leftpad=leftpad, k_scale=ks, v_scale=vs)
        res.append((out, k8.view(torch.uint8), v8.view(torch.uint8)))
    for a, b in zip(*res):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b)


def test_cache_leftpad_fp8_q_as_paged(seed, monkeypatch):
    """fp8 q over an fp8 cache (FlashAttention-3's descales [b, h_k]) through the as-paged
    emulation that CUDA tensors take equals the library's own cache_leftpad: out, lse and
    the appended cache bytes, bit for bit; the padding rows (NaN bytes) are never read."""
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, _ = _leftpad_case(g, torch.float32)
    f8 = torch.float8_e4m3fn
    q8, kn8, vn8 = (t.mul(2).to(f8) for t in (q, kn, vn))
    kc8, vc8 = (c.mul(2).to(f8) for c in (kc, vc))  # NaN padding stays NaN in e4m3
    ds = [torch.rand(3, 2, generator=g) * 0.5 + 0.25 for _ in range(3)]
    res, as_paged = [], interface._leftpad_as_paged
    calls = []
    monkeypatch.setattr(interface, "_leftpad_as_paged",
                        lambda *a, **k: calls.append(1) or as_paged(*a, **k))
    for emulate in (False, True):
        k8, v8 = kc8.clone(), vc8.clone()
        with emulate_cuda(emulate):
            out, lse = flash_attn_with_kvcache(q8, k8, v8, kn8, vn8, cache_seqlens=seqlens,
                                               cache_leftpad=leftpad, causal=True,
                                               q_descale=ds[0], k_descale=ds[1],
                                               v_descale=ds[2], return_softmax_lse=True)
        assert out.dtype == torch.bfloat16 and not out.isnan().any()
        res.append((out.view(torch.uint16), lse, k8.view(torch.uint8), v8.view(torch.uint8)))
        assert len(calls) == int(emulate)  # the CUDA-tensor path took the emulation
    for a, b in zip(*res):
        assert torch.equal(a, b) if not a.is_floating_point() else torch.equal(a.isnan(), b.isnan()) \
            and torch.equal(a.nan_to_num(), b.nan_to_num())
    for i in range(3):  # the appended bytes at rows cache_seqlens[i] .. + s_new
        n = int(seqlens[i])
        assert torch.equal(res[1][2][i, n:n + 2], kn8[i].view(torch.uint8))
        assert torch.equal(res[1][3][i, n:n + 2], vn8[i].view(torch.uint8))


@pytest.mark.parametrize("emulate", [False, True], ids=["library", "as_paged"])
def test_cache_leftpad_errors(emulate):
    g = torch.Generator().manual_seed(0)
    q, kc, vc, kn, vn, seqlens, leftpad, _ = _leftpad_case(g, torch.float32)
    cases = [
        (leftpad.float(), flashattn.InvalidArgumentError, "dtype int32"),
        (leftpad[:2], flashattn.InvalidArgumentError, "[3]"),
        (torch.tensor([0, -1, 0], dtype=torch.int32), flashattn.InvalidArgumentError,
         "cache_leftpad[1] = -1"),
        (seqlens + 1, flashattn.InvalidArgumentError, "values in [0, cache_seqlens[i]]"),
    ]
    with emulate_cuda(emulate):
        for bad, cls, text in cases:
            with pytest.raises(cls, match=r"argument 'cache_leftpad'") as e:
                flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                        cache_leftpad=bad)
            assert text in str(e.value)
            assert isinstance(e.value, RuntimeError)  # as flash_attn's TORCH_CHECK
        # A paged cache with left padding: flash_attn refuses it too.
        kp, vp = kc.reshape(-1, 8, 2, 16), vc.reshape(-1, 8, 2, 16)
        table = torch.arange(15, dtype=torch.int32).reshape(3, 5)
        with pytest.raises(flashattn.UnsupportedError, match=r"argument 'cache_leftpad'"):
            flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seqlens,
                                    cache_leftpad=leftpad, block_table=table)


def test_cache_leftpad_op_opcheck(seed):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, leftpad, _ = _leftpad_case(g, torch.float32)
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    torch.library.opcheck(
        flashattn.ops.kvcache_fwd,
        (q, kc, vc, seqlens, None, None, kn, vn, None, 0.25, True, -1, -1, 0.0, 1),
        dict(cache_leftpad=leftpad),
        test_utils=("test_schema", "test_faketensor"))


# ------------------------------------------------------------------ head dims % 8 != 0


@pytest.fixture
def recorded_head_dims(monkeypatch):
    """The head dims of q that the ops of flashattn.interface receive."""
    seen = []
    real = interface._call

    def spy(op, *args):
        seen.append(int(args[0].shape[-1]))
        return real(op, *args)

    monkeypatch.setattr(interface, "_call", spy)
    return seen


@pytest.mark.parametrize("d", [59, 111, 33, 301])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_padded_head_dim_forward_backward(seed, d, dtype, recorded_head_dims):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 37, 4, d, generator=g).to(dtype)
    k = torch.randn(2, 45, 2, d, generator=g).to(dtype)
    v = torch.randn(2, 45, 2, d, generator=g).to(dtype)
    dout = torch.randn(2, 37, 4, d, generator=g).to(dtype)
    res = []
    for emulate in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with emulate_cuda(emulate):
            torch.manual_seed(seed)  # the same dropout pair
            out = flash_attn_func(qq, kk, vv, dropout_p=0.2, causal=True, window_size=(20, 3),
                                  softcap=5.0)
        out.backward(dout)
        assert out.shape == (2, 37, 4, d)
        res.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert recorded_head_dims == [d, (d + 7) // 8 * 8]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=0, atol=2e-2)
    for got, want, name in zip(res[1], res[0], ("out", "dq", "dk", "dv")):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, **tol, msg=name)


@pytest.mark.parametrize("d", [59, 111, 33, 301])
def test_padded_head_dim_varlen(seed, d, recorded_head_dims):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
    q = torch.randn(17, 4, d, generator=g, dtype=torch.float64)
    k = torch.randn(20, 1, d, generator=g, dtype=torch.float64)
    v = torch.randn(20, 1, d, generator=g, dtype=torch.float64)
    res = []
    for emulate in (False, True):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with emulate_cuda(emulate):
            out = flash_attn_varlen_func(qq, kk, vv, cu_q, cu_k, 12, 9, causal=True,
                                         softmax_scale=0.3)
        out.sum().backward()
        res.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert recorded_head_dims == [d, (d + 7) // 8 * 8]
    for got, want in zip(res[1], res[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    want = ref.attention(np64(q), np64(k), np64(v), softmax_scale=0.3, causal=True,
                         cu_seqlens_q=cu_q.numpy(), cu_seqlens_k=cu_k.numpy())
    np.testing.assert_allclose(np64(res[1][0]), want["out"], rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("d", [59, 111, 33, 301])
@pytest.mark.parametrize("leftpad", [False, True])
def test_padded_head_dim_kvcache(seed, d, leftpad, recorded_head_dims):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, lp, idx = _leftpad_case(g, torch.float16, d=d, batch_idx=True)
    if not leftpad:  # the padding rows become keys
        lp, kc, vc = None, kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    caches = [(kc.clone(), vc.clone()) for _ in range(2)]
    outs = []
    for emulate, (k_cache, v_cache) in zip((False, True), caches):
        with emulate_cuda(emulate):
            outs.append(flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn,
                                                cache_seqlens=seqlens, cache_batch_idx=idx,
                                                cache_leftpad=lp, causal=True,
                                                return_softmax_lse=True))
    assert recorded_head_dims == [d, (d + 7) // 8 * 8]
    assert outs[1][0].shape == q.shape
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=2e-3)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)
    for a, b in zip(caches[0], caches[1]):  # the append reached the caller's caches
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
        assert not torch.equal(a.nan_to_num(0), kc.nan_to_num(0)) or kn is None


def test_head_dim_not_padded_on_cpu_or_when_mismatched(recorded_head_dims):
    q = torch.randn(1, 3, 2, 59, dtype=torch.float64)
    flash_attn_func(q, q, q)
    with emulate_cuda(), pytest.raises(flashattn.InvalidArgumentError, match="argument 'k'"):
        flash_attn_func(q, q[..., :58], q[..., :58])
    # KV-cache calls pad up to 512 as the dense and varlen calls do (the CUDA kernels' 512
    # bucket): d = 301 runs at 304; beyond 512 (d = 513) the library gets d as it is.
    q3 = torch.randn(1, 1, 2, 301, dtype=torch.float64)
    kc = torch.randn(1, 8, 2, 301, dtype=torch.float64)
    with emulate_cuda():
        flash_attn_with_kvcache(q3, kc, kc.clone(), cache_seqlens=torch.tensor([5], dtype=torch.int32))
    q4 = torch.randn(1, 1, 2, 513, dtype=torch.float64)
    kc4 = torch.randn(1, 8, 2, 513, dtype=torch.float64)
    with emulate_cuda(), pytest.raises(flashattn.UnsupportedError, match="argument 'q'"):
        flash_attn_with_kvcache(q4, kc4, kc4.clone(), cache_seqlens=torch.tensor([5], dtype=torch.int32))
    assert recorded_head_dims == [59, 59, 304, 513]


# ------------------------------------------------------------------ S_dmask with dropout


def p_from_s(s):
    """The probabilities S_dmask encodes (flash_attn's layout, flashattn's scaling:
    |S_ij| = exp(s_ij - max_j s_ij), so P_ij = |S_ij| / sum_j |S_ij| without a sink)."""
    a = s.abs().double()
    total = a.sum(-1, keepdim=True)
    return torch.where(total > 0, a / torch.where(total > 0, total, 1.0), 0.0)


def _expected_rng(seed):
    torch.manual_seed(seed)
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64).tolist()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [16, 59])
def test_s_dmask_with_dropout(seed, causal, d):
    g = torch.Generator().manual_seed(seed)
    b, s_q, s_k, h_q, h_k, p = 2, 37, 140, 4, 2, 0.3
    q = torch.randn(b, s_q, h_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s_k, h_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s_k, h_k, d, generator=g, dtype=torch.float64)
    rng_seed, rng_offset = _expected_rng(seed)
    torch.manual_seed(seed)
    with emulate_cuda():
        out, lse, s = flash_attn_func(q, k, v, dropout_p=p, causal=causal,
                                      return_attn_probs=True)
    assert s.shape == (b, h_q, 128, 256) and s.dtype == torch.float32
    assert torch.all(s[:, :, s_q:] == 0) and torch.all(s[:, :, :, s_k:] == 0)
    s = s[:, :, :s_q, :s_k].double()
    want = ref.attention(np64(q), np64(k), np64(v), causal=causal)  # P without dropout
    row_max = want["probs"].max(-1, keepdims=True)
    want_s = np.where(row_max > 0, want["probs"] / np.where(row_max > 0, row_max, 1), 0)
    np.testing.assert_allclose(np64(s.abs()), want_s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np64(p_from_s(s)), want["probs"], rtol=1e-6, atol=1e-7)
    # flash_attn's tests normalise S_dmask with _get_block_size_n's blocks: P again.
    from flashattn.compat import _get_block_size_n
    assert _get_block_size_n("cuda", d, True, causal) >= s_k
    for bi in range(b):
        for h in range(h_q):
            keep = ref.dropout_keep(p, rng_seed, rng_offset, bi * h_q + h, s_q, s_k)
            visible = want["probs"][bi, h] > 0
            np.testing.assert_array_equal(np64(s[bi, h])[visible] > 0, keep[visible])
    # The pattern returned is the one the call applied: out = (kept P) v / (1 - p).
    kept = torch.where(s > 0, p_from_s(s), 0.0)
    v_rep = v.repeat_interleave(h_q // h_k, dim=2)
    out_from_s = torch.einsum("bhij,bjhd->bihd", kept, v_rep) / (1 - p)
    np.testing.assert_allclose(np64(out), np64(out_from_s), rtol=1e-5, atol=1e-6)
    dropped = ((s < 0).sum() / (want["probs"] > 0).sum()).item()
    assert abs(dropped - p) < 0.05


def test_s_dmask_varlen_layout_and_private_fwd(seed):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 20], dtype=torch.int32)
    q = torch.randn(17, 2, 16, generator=g, dtype=torch.float64)
    k = torch.randn(20, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(20, 2, 16, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    _, _, probs_cpu = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 9, dropout_p=0.4,
                                             return_attn_probs=True)
    torch.manual_seed(seed)
    with emulate_cuda():
        _, _, s = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 9, dropout_p=0.4,
                                         return_attn_probs=True)
        _, _, none = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 9,
                                            return_attn_probs=True)
    assert none is None  # flash_attn: no S_dmask without dropout
    assert s.shape == (3, 2, 128, 128)
    for i in range(3):  # sequence i's rows are rows 0.. of S[i]; the CPU layout is packed
        q0, q1 = int(cu_q[i]), int(cu_q[i + 1])
        kept_cpu = probs_cpu[:, q0:q1]
        si = s[i, :, : q1 - q0, :9]
        torch.testing.assert_close(torch.where(si > 0, p_from_s(si), 0.0).float(), kept_cpu,
                                   rtol=1e-6, atol=1e-7)
        assert torch.equal(si > 0, kept_cpu > 0)
        assert torch.all(s[i, :, q1 - q0:] == 0)
    # flash_attn_gpu.fwd (the private forward) returns the same layout.
    from flashattn.flash_attn_interface import _flash_attn_forward
    qd = torch.randn(1, 20, 2, 16, generator=g, dtype=torch.float64)
    with emulate_cuda():
        out, lse, s, rng = _flash_attn_forward(qd, qd, qd, 0.5, 0.25, True, -1, -1, 0.0, None,
                                               True)
    assert s.shape == (1, 2, 128, 128)
    keep = ref.dropout_keep(0.5, int(rng[0]), int(rng[1]), 1, 20, 20)
    vis = np.tril(np.ones((20, 20), dtype=bool))
    np.testing.assert_array_equal(np64(s[0, 1, :20, :20])[vis] > 0, keep[vis])


# ------------------------------------------------------------------ paged varlen


def _paged_case(g, dtype, block_size, lens_q=(5, 0, 12, 1), lens_k=(9, 3, 40, 0), h_q=4,
                h_k=2, d=16, share=True):
    b = len(lens_q)
    max_blocks = max((n + block_size - 1) // block_size for n in lens_k) + 1
    num_blocks = b * max_blocks + 3
    k_pool = torch.randn(num_blocks, block_size, h_k, d, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, h_k, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: b * max_blocks].reshape(b, max_blocks)
    if share and block_size <= lens_k[0] and block_size <= lens_k[2]:
        table[2, 0] = table[0, 0]  # a prefix block shared between two sequences
    table = table.to(torch.int32)
    used = set()
    for i, n in enumerate(lens_k):
        used |= {int(table[i, t]) for t in range((n + block_size - 1) // block_size)}
    for blk in range(num_blocks):  # blocks no sequence uses: NaN shows if read
        if blk not in used:
            k_pool[blk] = float("nan")
            v_pool[blk] = float("nan")
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h_q, d, generator=g).to(dtype)
    # The dense gather: sequence i's keys, packed.
    rows = [(int(table[i, j // block_size]), j % block_size) for i, n in enumerate(lens_k)
            for j in range(n)]
    k_dense = torch.stack([k_pool[r, c] for r, c in rows]) if rows else k_pool[:0, 0]
    v_dense = torch.stack([v_pool[r, c] for r, c in rows]) if rows else v_pool[:0, 0]
    return q, k_pool, v_pool, table, cu_q, cu_k, k_dense, v_dense, max(lens_q), max(lens_k)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (6, 0))])
def test_varlen_block_table_matches_the_dense_gather(seed, block_size, causal, window):
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, table, cu_q, cu_k, kd, vd, mq, mk = _paged_case(g, torch.float64, block_size)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    qa, kpa, vpa = (t.clone().requires_grad_() for t in (q, kp, vp))
    out, lse, probs = flash_attn_varlen_func(qa, kpa, vpa, cu_q, cu_k, mq, mk, causal=causal,
                                             window_size=window, block_table=table,
                                             return_attn_probs=True)
    want = ref.attention(np64(q), np64(kd), np64(vd), causal=causal, window=window,
                         dout=np64(dout), cu_seqlens_q=cu_q.numpy(), cu_seqlens_k=cu_k.numpy())
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=3e-7, atol=1e-7)
    assert probs.shape == (4, q.shape[0], mk)
    np.testing.assert_allclose(np64(probs), want["probs"], rtol=1e-6, atol=1e-7)
    out.backward(dout)
    np.testing.assert_allclose(np64(qa.grad), want["dq"], rtol=2e-6, atol=1e-6)  # lse is fp32
    # dk, dv of the pool: each key's gradient lands in its block (summed where shared).
    dk_pool = torch.zeros_like(kp)
    dv_pool = torch.zeros_like(vp)
    j = 0
    for i, n in enumerate(np.diff(cu_k.numpy())):
        for t in range(n):
            r, c = int(table[i, t // block_size]), t % block_size
            dk_pool[r, c] += torch.from_numpy(want["dk"][j])
            dv_pool[r, c] += torch.from_numpy(want["dv"][j])
            j += 1
    np.testing.assert_allclose(np64(kpa.grad), np64(dk_pool), rtol=2e-6, atol=1e-6)  # lse is fp32
    np.testing.assert_allclose(np64(vpa.grad), np64(dv_pool), rtol=2e-6, atol=1e-6)  # lse is fp32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_varlen_block_table_half_precision_and_seqused_k(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, table, cu_q, cu_k, kd, vd, mq, mk = _paged_case(g, dtype, 8)
    seqused = torch.tensor([4, 3, 33, 0], dtype=torch.int32)
    out = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, mk, causal=True, block_table=table,
                                 seqused_k=seqused)
    want = ref.attention(np64(q), np64(kd), np64(vd), causal=True, cu_seqlens_q=cu_q.numpy(),
                         cu_seqlens_k=cu_k.numpy(), seqused_k=seqused.numpy())
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    np.testing.assert_allclose(np64(out), want["out"], rtol=tol, atol=tol)
    # The private forward (flash_attn_gpu.varlen_fwd) takes the same block table.
    from flashattn.flash_attn_interface import _flash_attn_varlen_forward
    out2 = _flash_attn_varlen_forward(q, kp, vp, cu_q, cu_k, mq, mk, 0.0, 16 ** -0.5, True,
                                      block_table=table, seqused_k=seqused)[0]
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_varlen_block_table_s_dmask_emulated(seed):
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, table, cu_q, cu_k, kd, vd, mq, mk = _paged_case(g, torch.float64, 4)
    torch.manual_seed(seed)
    _, _, s_paged = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, mk, dropout_p=0.3,
                                           block_table=table, return_attn_probs=True)
    torch.manual_seed(seed)
    _, _, s_dense = flash_attn_varlen_func(q, kd, vd, cu_q, cu_k, mq, mk, dropout_p=0.3,
                                           return_attn_probs=True)
    torch.testing.assert_close(s_paged, s_dense, rtol=0, atol=0)
    torch.manual_seed(seed)
    with emulate_cuda():
        _, _, s = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, mk, dropout_p=0.3,
                                         block_table=table, return_attn_probs=True)
    assert s.shape == (4, 4, 128, 128)


def test_varlen_block_table_errors():
    g = torch.Generator().manual_seed(0)
    q, kp, vp, table, cu_q, cu_k, kd, vd, mq, mk = _paged_case(g, torch.float32, 8)
    E = flashattn.InvalidArgumentError
    bad = table.clone()
    bad[2, 1] = kp.shape[0]
    cases = [
        (dict(block_table=table.long()), "block_table", "dtype int32"),
        (dict(block_table=table[:3]), "block_table", "shape[0] == 4"),
        (dict(block_table=bad), "block_table", f"block_table[2][1] = {kp.shape[0]}"),
        (dict(block_table=table[:, :2]), "block_table", "cu_seqlens_k[3] - cu_seqlens_k[2] = 40"),
        (dict(block_table=table, max_seqlen_k=39), "cu_seqlens_k", "<= 39 (max_seqlen_k)"),
    ]
    for change, name, text in cases:
        kw = dict(block_table=table, max_seqlen_k=mk)
        kw.update(change)
        with pytest.raises(E, match=f"argument '{name}'") as e:
            flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, mq, kw["max_seqlen_k"],
                                   block_table=kw["block_table"])
        assert text in str(e.value), str(e.value)
        assert isinstance(e.value, RuntimeError)


def test_kvcache_block_table_too_small_is_a_runtime_error_naming_block_table():
    """flash_attn's test_flash_attn_kvcache_paged_block_table_bounds: cache_seqlens (+ new
    keys) past max_blocks_per_seq * block_size raises a RuntimeError mentioning block_table."""
    q = torch.randn(1, 1, 1, 64, dtype=torch.float16)
    kp, vp = torch.randn(4, 256, 1, 64, dtype=torch.float16), torch.randn(4, 256, 1, 64, dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32)
    kn = vn = torch.randn(1, 1, 1, 64, dtype=torch.float16)
    for seqlens, new in ((257, None), (256, kn)):
        with pytest.raises(RuntimeError, match="block_table"):
            flash_attn_with_kvcache(q, kp, vp, new, None if new is None else vn,
                                    cache_seqlens=torch.tensor([seqlens], dtype=torch.int32),
                                    block_table=table)
    out = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=torch.tensor([256], dtype=torch.int32),
                                  block_table=table)
    assert not out.isnan().any()


# ------------------------------------------------------------------ CUDA tensors
# The real paths of the emulations above (skipped without a GPU): CUDA results against
# the CPU backend on the same inputs, within the rounding of fp16 / bf16 kernels.

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and flashattn.cuda_available()),
                          reason="needs a CUDA device and flashattn's CUDA backend")


def _close_half(got, want, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), rtol=tol, atol=tol)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_cache_leftpad(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, kc, vc, kn, vn, seqlens, lp, idx = _leftpad_case(g, dtype, s_q=3, s_new=3, d=64,
                                                        batch_idx=True)
    kcc, vcc = kc.cuda(), vc.cuda()
    out = flash_attn_with_kvcache(q.cuda(), kcc, vcc, kn.cuda(), vn.cuda(),
                                  cache_seqlens=seqlens.cuda(), cache_batch_idx=idx.cuda(),
                                  cache_leftpad=lp.cuda(), causal=True, num_splits=0)
    want = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                   cache_batch_idx=idx, cache_leftpad=lp, causal=True)
    _close_half(out, want, dtype)
    torch.testing.assert_close(kcc.cpu(), kc, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vcc.cpu(), vc, rtol=0, atol=0, equal_nan=True)


@cuda
@pytest.mark.parametrize("d", [59, 111, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_padded_head_dims(seed, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 50, 4, d, generator=g).to(dtype) for _ in range(4))
    res = []
    for device in ("cuda", "cpu"):
        qq, kk, vv = (t.to(device).requires_grad_() for t in (q, k, v))
        out = flash_attn_func(qq, kk, vv, causal=True)
        out.backward(dout.to(device))
        res.append((out, qq.grad, kk.grad, vv.grad))
    for got, want in zip(*res):
        assert got.shape[-1] == d
        _close_half(got, want, dtype)
    kc, vc = (torch.randn(2, 64, 4, d, generator=g).to(dtype) for _ in range(2))
    kn, vn = (torch.randn(2, 2, 4, d, generator=g).to(dtype) for _ in range(2))
    seqlens = torch.tensor([10, 61], dtype=torch.int32)
    kcc, vcc = kc.cuda(), vc.cuda()
    out = flash_attn_with_kvcache(q[:, :2].cuda(), kcc, vcc, kn.cuda(), vn.cuda(),
                                  cache_seqlens=seqlens.cuda(), causal=True)
    want = flash_attn_with_kvcache(q[:, :2], kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    _close_half(out, want, dtype)
    torch.testing.assert_close(kcc.cpu(), kc, rtol=0, atol=0)


@cuda
def test_cuda_s_dmask_is_the_applied_dropout(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 70, 4, 64, generator=g, dtype=torch.float16).cuda()
               for _ in range(3))
    out, lse, s = flash_attn_func(q, k, v, dropout_p=0.25, causal=True, return_attn_probs=True)
    assert s.shape == (2, 4, 128, 128) and s.device.type == "cuda"
    kept = torch.where(s[:, :, :70, :70] > 0, p_from_s(s[:, :, :70, :70]), 0.0).double()
    out_from_s = torch.einsum("bhij,bjhd->bihd", kept, v.double()) / 0.75
    torch.testing.assert_close(out.double(), out_from_s, rtol=4e-3, atol=4e-3)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_varlen_block_table(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    q, kp, vp, table, cu_q, cu_k, kd, vd, mq, mk = _paged_case(g, dtype, 16, d=64)
    out = flash_attn_varlen_func(q.cuda(), kp.cuda(), vp.cuda(), cu_q.cuda(), cu_k.cuda(), mq,
                                 mk, causal=True, block_table=table.cuda())
    want = flash_attn_varlen_func(q, kd, vd, cu_q, cu_k, mq, mk, causal=True)
    _close_half(out, want, dtype)
