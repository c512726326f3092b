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
