"""flashattn._C with numpy arrays (through DLPack) on the CPU backend, against the fp64
numpy oracle in reference.py. Needs no torch: this is what CI runs."""

import numpy as np
import pytest

import flashattn
from flashattn import _C
import reference as ref

TOL64 = dict(rtol=1e-10, atol=1e-11)


def poisoned(shape, dtype=np.float64):
    return np.full(shape, np.nan, dtype=dtype)


def rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def assert_written(*arrays):
    for a in arrays:
        assert not np.isnan(a).any(), "an output element was not written"


def dense_problem(rng, b=2, s_q=13, s_k=17, h_q=4, h_k=2, d=24, dtype=np.float64):
    return rand(rng, b, s_q, h_q, d, dtype=dtype), rand(rng, b, s_k, h_k, d, dtype=dtype), \
        rand(rng, b, s_k, h_k, d, dtype=dtype)


def test_version_and_cuda_flag():
    assert flashattn.__version__ == _C.version()
    assert flashattn.__version__.count(".") == 2
    assert isinstance(_C.cuda_available(), bool)


MASKS = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(window=(4, -1), causal=True),
    dict(window=(0, 0)),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: str(m) or "full")
@pytest.mark.parametrize("shape", [(2, 13, 17, 4, 2, 24), (1, 19, 7, 3, 3, 5), (3, 1, 33, 2, 1, 64)])
def test_forward_fp64(seed, mask, shape):
    rng = np.random.default_rng(seed)
    b, s_q, s_k, h_q, h_k, d = shape
    q, k, v = dense_problem(rng, b, s_q, s_k, h_q, h_k, d)
    out, lse = poisoned(q.shape), poisoned((b, h_q, s_q), np.float32)
    window = mask.get("window", (-1, -1))
    _C.forward(q, k, v, out, lse, causal=mask.get("causal", False), window_left=window[0],
               window_right=window[1])
    want = ref.attention(q, k, v, causal=mask.get("causal", False), window=window)
    assert_written(out, lse)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    # lse is fp32: its rounding is the tolerance; empty rows must be exactly -inf.
    np.testing.assert_allclose(lse, want["lse"], rtol=2e-7, atol=0)


def test_forward_options_fp64(seed):
    rng = np.random.default_rng(seed)
    q, k, v = dense_problem(rng, 2, 11, 29, 6, 3, 16)
    slopes = rng.uniform(0.05, 0.5, size=(2, 6)).astype(np.float32)
    out, lse = poisoned(q.shape), poisoned((2, 6, 11), np.float32)
    kw = dict(softmax_scale=0.3, causal=True, softcap=2.5)
    _C.forward(q, k, v, out, lse, alibi_slopes=slopes, **kw)
    want = ref.attention(q, k, v, alibi_slopes=slopes.astype(np.float64), **kw)
    assert_written(out, lse)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    np.testing.assert_allclose(lse, want["lse"], rtol=2e-7)


def test_empty_rows_are_zero_not_nan(seed):
    rng = np.random.default_rng(seed)
    q, k, v = dense_problem(rng, 1, 9, 4, 2, 2, 8)  # causal with s_q > s_k: 5 empty rows
    out, lse = poisoned(q.shape), poisoned((1, 2, 9), np.float32)
    _C.forward(q, k, v, out, lse, causal=True)
    assert np.all(out[:, :5] == 0.0)
    assert np.all(lse[:, :, :5] == -np.inf)
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 5:]).all()


def test_dropout_matches_philox_oracle(seed):
    rng = np.random.default_rng(seed)
    q, k, v = dense_problem(rng, 2, 21, 18, 2, 1, 8)
    philox_seed = int(rng.integers(0, 1 << 63))
    philox_offset = int(rng.integers(0, 1 << 63))
    p = 0.3
    out, lse = poisoned(q.shape), poisoned((2, 2, 21), np.float32)
    probs = poisoned((2, 2, 21, 18), np.float32)
    _C.forward(q, k, v, out, lse, dropout_p=p, seed=philox_seed, offset=philox_offset,
               return_probs=probs, causal=True)
    want = ref.attention(q, k, v, dropout_p=p, seed=philox_seed, offset=philox_offset,
                         causal=True)
    assert_written(out, lse, probs)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    np.testing.assert_allclose(probs, want["probs"], rtol=2e-7, atol=1e-30)
    kept = want["probs"] > 0
    dropped = (want["probs"] == 0) & (ref.attention(q, k, v, causal=True)["probs"] > 0)
    assert kept.any() and dropped.any()
    # Another seed gives another mask.
    probs2 = poisoned(probs.shape, np.float32)
    _C.forward(q, k, v, poisoned(q.shape), None, dropout_p=p, seed=philox_seed ^ 1,
               offset=philox_offset, return_probs=probs2, causal=True)
    assert ((probs2 > 0) != (probs > 0)).any()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, softcap=1.5), dict(window=(2, 3)),
                                dict(dropout_p=0.25, alibi=True)],
                         ids=["plain", "causal-softcap", "window", "dropout-alibi"])
def test_backward_fp64(seed, kw):
    rng = np.random.default_rng(seed)
    q, k, v = dense_problem(rng, 2, 14, 19, 4, 2, 12)
    window = kw.get("window", (-1, -1))
    slopes = rng.uniform(0.1, 1.0, size=4).astype(np.float32) if kw.get("alibi") else None
    common = dict(causal=kw.get("causal", False), softcap=kw.get("softcap", 0.0),
                  dropout_p=kw.get("dropout_p", 0.0), seed=12345, offset=678)
    out, lse = poisoned(q.shape), poisoned((2, 4, 14), np.float32)
    _C.forward(q, k, v, out, lse, window_left=window[0], window_right=window[1],
               alibi_slopes=slopes, **common)
    dout = rand(rng, *q.shape)
    dq, dk, dv = poisoned(q.shape), poisoned(k.shape), poisoned(v.shape)
    _C.backward(dout, q, k, v, out, lse, dq, dk, dv, window_left=window[0],
                window_right=window[1], alibi_slopes=slopes, **common)
    want = ref.attention(q, k, v, window=window, dout=dout,
                         alibi_slopes=None if slopes is None else slopes.astype(np.float64),
                         **common)
    assert_written(dq, dk, dv)
    # The backward reads fp32 lse: its rounding (2^-24 relative) bounds the agreement.
    tol = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dq, want["dq"], **tol)
    np.testing.assert_allclose(dk, want["dk"], **tol)
    np.testing.assert_allclose(dv, want["dv"], **tol)


def test_backward_workspace_size_is_an_int():
    q = np.zeros((1, 4, 2, 8))
    assert isinstance(_C.backward_workspace_size(q, q, q), int)


@pytest.mark.parametrize("dtype,eps", [(np.float32, 2.0**-24), (np.float16, 2.0**-11)])
def test_forward_low_precision_within_twice_naive(seed, dtype, eps):
    rng = np.random.default_rng(seed)
    q, k, v = dense_problem(rng, 2, 31, 45, 2, 2, 32, dtype=dtype)
    out = poisoned(q.shape, dtype)
    _C.forward(q, k, v, out, None, causal=True)
    assert_written(out)
    want = ref.attention(q, k, v, causal=True)["out"]
    # The naive computation in the same precision: S and P rounded to the dtype.
    s = np.einsum("bqhd,bkhd->bhqk", q, k).astype(dtype) * dtype(1 / np.sqrt(32))
    s = np.where(ref.visible(31, 45, causal=True), s, -np.inf).astype(dtype)
    pr = np.exp(s - s.max(-1, keepdims=True)).astype(dtype)
    pr = (pr / pr.sum(-1, keepdims=True)).astype(dtype)
    naive = np.einsum("bhqk,bkhd->bqhd", pr, v).astype(dtype)
    naive_err = np.abs(naive.astype(np.float64) - want).max()
    err = np.abs(out.astype(np.float64) - want).max()
    assert err <= 2 * naive_err + eps * np.abs(want).max(), (err, naive_err)


def test_strided_views_of_packed_qkv(seed):
    rng = np.random.default_rng(seed)
    qkv = rand(rng, 2, 10, 3, 4, 16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out = poisoned((2, 10, 4, 16))
    _C.forward(q, k, v, out, None, causal=True)
    np.testing.assert_allclose(out, ref.attention(q, k, v, causal=True)["out"], **TOL64)
    # A padded output row: out is a view into a wider buffer.
    wide = poisoned((2, 10, 4, 24))
    _C.forward(q, k, v, wide[..., :16], None, causal=True)
    np.testing.assert_allclose(wide[..., :16], out, **TOL64)
    assert np.isnan(wide[..., 16:]).all()


def varlen_problem(rng, lens_q, lens_k, h_q=4, h_k=2, d=16):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rand(rng, int(cu_q[-1]), h_q, d)
    k = rand(rng, int(cu_k[-1]), h_k, d)
    v = rand(rng, int(cu_k[-1]), h_k, d)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_backward_fp64(seed, causal):
    rng = np.random.default_rng(seed)
    lens_q, lens_k = [5, 0, 17, 1], [9, 3, 11, 1]
    q, k, v, cu_q, cu_k = varlen_problem(rng, lens_q, lens_k)
    max_q, max_k = max(lens_q), max(lens_k)
    kw = dict(causal=causal, dropout_p=0.2, seed=99, offset=7)
    out, lse = poisoned(q.shape), poisoned((4, q.shape[0]), np.float32)
    probs = poisoned((4, q.shape[0], max_k), np.float32)
    _C.varlen_forward(q, k, v, cu_q, cu_k, None, max_q, max_k, out, lse, return_probs=probs, **kw)
    dout = rand(rng, *q.shape)
    want = ref.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dout=dout, **kw)
    assert_written(out, lse)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    np.testing.assert_allclose(lse, want["lse"], rtol=2e-7)
    np.testing.assert_allclose(probs, want["probs"], rtol=2e-7, atol=1e-30)
    dq, dk, dv = poisoned(q.shape), poisoned(k.shape), poisoned(v.shape)
    _C.varlen_backward(q, k, v, cu_q, cu_k, None, max_q, max_k, dout, out, lse, dq, dk, dv,
                       **kw)
    assert_written(dq, dk, dv)
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_varlen_seqused_k(seed):
    rng = np.random.default_rng(seed)
    q, k, v, cu_q, cu_k = varlen_problem(rng, [4, 6], [10, 8])
    used = np.array([3, 8], dtype=np.int32)
    out = poisoned(q.shape)
    _C.varlen_forward(q, k, v, cu_q, cu_k, used, 6, 10, out, None)
    want = ref.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used)
    np.testing.assert_allclose(out, want["out"], **TOL64)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_kvcache_append_and_attend(seed, paged, num_splits):
    rng = np.random.default_rng(seed)
    b, s_q, h_q, h_k, d, s_new = 3, 2, 4, 2, 16, 3
    cache_seqlens = np.array([5, 0, 12], dtype=np.int32)
    q = rand(rng, b, s_q, h_q, d)
    k_new, v_new = rand(rng, b, s_new, h_k, d), rand(rng, b, s_new, h_k, d)
    if paged:
        block_size, num_blocks = 4, 13
        k_cache, v_cache = rand(rng, num_blocks, block_size, h_k, d), rand(rng, num_blocks, block_size, h_k, d)
        block_table = rng.permutation(num_blocks)[: b * 4].reshape(b, 4).astype(np.int32)
        batch_idx = None
    else:
        k_cache, v_cache = rand(rng, 4, 16, h_k, d), rand(rng, 4, 16, h_k, d)
        block_table = None
        batch_idx = np.array([2, 0, 3], dtype=np.int32)
    want, k_after, v_after = ref.kvcache_attention(
        q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=block_table,
        cache_batch_idx=batch_idx, causal=True)
    out, lse = poisoned(q.shape), poisoned((b, h_q, s_q), np.float32)
    _C.kvcache_forward(q, k_cache, v_cache, cache_seqlens, block_table, batch_idx, k_new, v_new,
                       num_splits, out, lse, causal=True)
    assert_written(out, lse)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    np.testing.assert_allclose(lse, want["lse"], rtol=2e-7)
    # The append happened in place, and only there.
    np.testing.assert_array_equal(k_cache, k_after)
    np.testing.assert_array_equal(v_cache, v_after)
    np.testing.assert_array_equal(cache_seqlens, [5, 0, 12])


def test_kvcache_without_new_keys(seed):
    rng = np.random.default_rng(seed)
    q = rand(rng, 2, 1, 2, 8)
    k_cache, v_cache = rand(rng, 2, 9, 1, 8), rand(rng, 2, 9, 1, 8)
    lens = np.array([9, 4], dtype=np.int32)
    before = k_cache.copy()
    out = poisoned(q.shape)
    _C.kvcache_forward(q, k_cache, v_cache, lens, None, None, None, None, 0, out, None,
                       softcap=3.0)
    want, _, _ = ref.kvcache_attention(q, k_cache, v_cache, lens, softcap=3.0)
    np.testing.assert_allclose(out, want["out"], **TOL64)
    np.testing.assert_array_equal(k_cache, before)


# ------------------------------------------------------------------ errors


def test_check_errors_without_cuda():
    """flashattn.check_errors() raises what the device index checks of CUDA calls found; CPU
    calls check their indices on the host and raise from the call, so it has nothing to
    raise after them (and nothing at all in a build or on a machine without CUDA)."""
    if _C.cuda_available():
        try:
            flashattn.check_errors()  # what an earlier GPU test may have left
        except flashattn.InvalidArgumentError:
            pass
    assert flashattn.check_errors() is None
    assert flashattn.check_errors(0) is None
    assert flashattn.check_errors(device=5) is None
    assert _C.check_errors is flashattn.check_errors
    q, cache = np.zeros((1, 1, 2, 8)), np.zeros((2, 4, 2, 8))
    table = np.array([[1, 7]], dtype=np.int32)  # 6 keys: entry [0][1] is used
    with pytest.raises(flashattn.InvalidArgumentError, match=r"got block_table\[0\]\[1\] = 7"):
        _C.kvcache_forward(q, cache, cache.copy(), np.array([6], dtype=np.int32), table, None, None, None, 0,
                           poisoned(q.shape), None)
    assert flashattn.check_errors() is None
    for bad in (-2, 2 ** 31):
        with pytest.raises(flashattn.InvalidArgumentError, match="check_errors: argument 'device'"):
            flashattn.check_errors(bad)
    with pytest.raises(TypeError):
        flashattn.check_errors(0.5)


def test_exception_hierarchy():
    assert issubclass(flashattn.InvalidArgumentError, ValueError)
    assert issubclass(flashattn.UnsupportedError, flashattn.InvalidArgumentError)
    assert issubclass(flashattn.UnsupportedError, NotImplementedError)
    assert issubclass(flashattn.Error, RuntimeError)
    assert issubclass(flashattn.CudaError, flashattn.Error)
    # flash_attn raises RuntimeError for argument problems (TORCH_CHECK): ours are both.
    assert issubclass(flashattn.InvalidArgumentError, RuntimeError)
    assert issubclass(flashattn.DTypeError, flashattn.InvalidArgumentError)
    assert issubclass(flashattn.DTypeError, TypeError)


def test_invalid_argument_keeps_the_message():
    q, k = np.zeros((1, 4, 2, 8)), np.zeros((1, 4, 2, 4))
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.forward(q, k, k, np.zeros_like(q), None)
    e = info.value
    assert str(e) == ("flashattn::forward: argument 'k': expected shape[3] == 8 "
                      "(head dim of q), got 4")
    assert (e.function, e.argument, e.expected, e.actual) == (
        "forward", "k", "shape[3] == 8 (head dim of q)", "4")
    assert isinstance(e, ValueError) and not isinstance(e, NotImplementedError)


def test_overlapping_output_is_rejected():
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError, match="memory disjoint from input 'q'"):
        _C.forward(q, q.copy(), q.copy(), q, None)


def test_dtype_mismatch_is_value_error():
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="argument 'k': expected dtype float64"):
        _C.forward(q, q.astype(np.float32), q, np.zeros_like(q), None)


def test_unsupported_maps_to_not_implemented():
    q = np.zeros((1, 2, 1, 600))
    with pytest.raises(NotImplementedError, match=r"head dim d in \[1, 512\]") as info:
        _C.forward(q, q, q, np.zeros_like(q), None)
    assert isinstance(info.value, flashattn.UnsupportedError)
    assert isinstance(info.value, ValueError)
    assert info.value.argument == "q"


def test_kvcache_rejects_dropout():
    q = np.zeros((1, 1, 1, 8))
    cache = np.zeros((1, 4, 1, 8))
    with pytest.raises(flashattn.UnsupportedError, match="inference only"):
        _C.kvcache_forward(q, cache, cache.copy(), np.array([2], np.int32), None, None, None,
                           None, 0, np.zeros_like(q), None, dropout_p=0.1)


def test_unknown_dtype_is_type_error():
    q = np.zeros((1, 4, 2, 8), dtype=np.int64)
    with pytest.raises(TypeError, match="argument 'q': expected dtype float16.*got dtype int64"):
        _C.forward(q, q, q, np.zeros((1, 4, 2, 8)), None)


def test_rank_above_four_is_value_error():
    q = np.zeros((1, 1, 4, 2, 8))
    with pytest.raises(ValueError, match="argument 'q': expected rank 1 .. 4, got rank 5"):
        _C.forward(q, q, q, q.copy(), None)


def test_read_only_output_is_refused():
    q = np.zeros((1, 4, 2, 8))
    out = np.zeros_like(q)
    out.setflags(write=False)
    with pytest.raises(TypeError):
        _C.forward(q, q, q, out, None)


def test_options_are_checked():
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError, match="opts.dropout_p"):
        _C.forward(q, q, q, np.zeros_like(q), None, dropout_p=1.0)
    with pytest.raises(flashattn.InvalidArgumentError, match="opts.window_left"):
        _C.forward(q, q, q, np.zeros_like(q), None, window_left=-2)
    # NaN is not the default scale (None is).
    with pytest.raises(flashattn.InvalidArgumentError, match="opts.softmax_scale.*got nan"):
        _C.forward(q, q, q, np.zeros_like(q), None, softmax_scale=float("nan"))


# ------------------------------------------------------------------ draft trees, fp8 cache


def random_tree_words(rng, b, s_q, linear=False):
    """int32 [b, s_q, ceil(s_q / 32)] ancestor-or-self bitmasks of random parent pointers
    (parent of draft i: -1 or an earlier draft; linear: i - 1), and the boolean
    [b, s_q, s_q] visibility they encode."""
    words = (s_q + 31) // 32
    vis = np.zeros((b, s_q, s_q), dtype=bool)
    for bi in range(b):
        for i in range(s_q):
            parent = i - 1 if linear else (int(rng.integers(-1, i)) if i > 0 else -1)
            if parent >= 0:
                vis[bi, i] = vis[bi, parent]
            vis[bi, i, i] = True
    mask = np.zeros((b, s_q, words), dtype=np.uint32)
    for t in range(s_q):
        mask[:, :, t // 32] |= vis[:, :, t].astype(np.uint32) << np.uint32(t % 32)
    return mask.view(np.int32), vis


def tree_oracle(q, keys, values, vis, causal=False, softmax_scale=None):
    """fp64 attention of q [s_q, h_q, d] over keys/values [s_k, h_k, d] where the last
    s_q keys are drafts seen per vis [s_q, s_q] (and causal, bottom-right). Returns
    (out [s_q, h_q, d], lse [h_q, s_q])."""
    s_q, h_q, d = q.shape
    s_k, h_k = keys.shape[0], keys.shape[1]
    scale = float(np.float32(1.0) / np.sqrt(np.float32(d)) if softmax_scale is None
                  else np.float32(softmax_scale))
    allowed = np.ones((s_q, s_k), dtype=bool)
    for i in range(s_q):
        for j in range(s_k):
            t = j - (s_k - s_q)
            if t >= 0 and not vis[i, t]:
                allowed[i, j] = False
            if causal and j > i + s_k - s_q:
                allowed[i, j] = False
    out = np.zeros((s_q, h_q, d))
    lse = np.full((h_q, s_q), -np.inf)
    for h in range(h_q):
        g = h // (h_q // h_k)
        s = (q[:, h] @ keys[:, g].T) * scale
        for i in range(s_q):
            if not allowed[i].any():
                continue
            x = s[i][allowed[i]]
            m = x.max()
            lse[h, i] = m + np.log(np.exp(x - m).sum())
            p = np.exp(x - lse[h, i])
            out[i, h] = p @ values[allowed[i], g]
    return out, lse


@pytest.mark.parametrize("s_q", [1, 7, 37])
@pytest.mark.parametrize("num_splits", [1, 2, 0])
def test_kvcache_tree_mask(seed, s_q, num_splits):
    rng = np.random.default_rng(seed)
    b, h_q, h_k, d, block_size = 2, 4, 2, 16, 8
    lens = np.array([int(rng.integers(0, 30)), int(rng.integers(0, 30))], dtype=np.int32)
    max_blocks = (30 + s_q + block_size - 1) // block_size
    num_blocks = b * max_blocks + 1
    k_cache = rand(rng, num_blocks, block_size, h_k, d)
    v_cache = rand(rng, num_blocks, block_size, h_k, d)
    table = rng.permutation(num_blocks)[: b * max_blocks].reshape(b, max_blocks).astype(np.int32)
    q, k_new, v_new = rand(rng, b, s_q, h_q, d), rand(rng, b, s_q, h_k, d), rand(rng, b, s_q, h_k, d)
    tree, vis = random_tree_words(rng, b, s_q)
    causal = bool(rng.integers(0, 2))
    out, lse = poisoned(q.shape), poisoned((b, h_q, s_q), np.float32)
    _C.kvcache_forward(q, k_cache, v_cache, lens, table, None, k_new, v_new, num_splits, out,
                       lse, causal=causal, tree_mask=tree)
    assert_written(out, lse)
    for bi in range(b):
        n = int(lens[bi]) + s_q
        rows = [(table[bi, t // block_size], t % block_size) for t in range(n)]
        keys = np.stack([k_cache[r, c] for r, c in rows])
        values = np.stack([v_cache[r, c] for r, c in rows])
        np.testing.assert_array_equal(keys[-s_q:], k_new[bi])  # appended in place
        want_out, want_lse = tree_oracle(q[bi], keys, values, vis[bi], causal)
        np.testing.assert_allclose(out[bi], want_out, **TOL64)
        np.testing.assert_allclose(lse[bi], want_lse, rtol=2e-7)


def test_kvcache_linear_tree_is_causal(seed):
    rng = np.random.default_rng(seed)
    b, s_q, h_q, h_k, d = 2, 33, 2, 1, 8
    k_cache, v_cache = rand(rng, b, 80, h_k, d), rand(rng, b, 80, h_k, d)
    lens = np.array([10, 40], dtype=np.int32)
    q = rand(rng, b, s_q, h_q, d)
    tree, _ = random_tree_words(rng, b, s_q, linear=True)
    a, b_ = poisoned(q.shape), poisoned(q.shape)
    _C.kvcache_forward(q, k_cache, v_cache, lens, None, None, None, None, 1, a, None,
                       tree_mask=tree)
    _C.kvcache_forward(q, k_cache, v_cache, lens, None, None, None, None, 1, b_, None,
                       causal=True)
    np.testing.assert_array_equal(a, b_)


def test_kvcache_tree_mask_errors():
    q = np.zeros((2, 3, 2, 8))
    cache = np.zeros((2, 8, 1, 8))
    lens = np.array([2, 3], np.int32)
    call = lambda **kw: _C.kvcache_forward(q, cache, cache.copy(), lens, None, None, None, None,  # noqa
                                           1, np.zeros_like(q), None, **kw)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        call(tree_mask=np.zeros((2, 3, 2), np.int32))
    assert info.value.argument == "tree_mask"
    assert info.value.expected == "shape [2, 3, 1] ([b, s_q, ceil(s_q / 32)])"
    assert info.value.actual == "[2, 3, 2]"
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'tree_mask': expected dtype int32, got float64"):
        call(tree_mask=np.zeros((2, 3, 1)))
    with pytest.raises(TypeError, match="argument 'tree_mask'.*got dtype uint32"):
        call(tree_mask=np.zeros((2, 3, 1), np.uint32))
    # The workspace query checks the same arguments.
    with pytest.raises(flashattn.InvalidArgumentError, match="kvcache_workspace_size: argument 'tree_mask'"):
        _C.kvcache_workspace_size(q, cache, cache, lens, None, None, None, None, 1,
                                  tree_mask=np.zeros((2, 4, 1), np.int32))


def test_kvcache_scales_need_an_fp8_cache():
    q = np.zeros((1, 1, 2, 8))
    cache = np.zeros((1, 8, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.kvcache_forward(q, cache, cache.copy(), np.array([2], np.int32), None, None, None,
                           None, 1, np.zeros_like(q), None, k_scale=np.ones(2, np.float32),
                           v_scale=np.ones(2, np.float32))
    assert info.value.argument == "k_scale"
    assert "float8_e4m3 cache; k_cache is float64" in info.value.expected


def test_kvcache_uint8_cache_is_not_fp8():
    # numpy has no float8 dtype: a uint8 array is not taken for e4m3 bytes (the fp8 cache
    # goes through torch.float8_e4m3fn, see test_torch.py).
    q = np.zeros((1, 1, 2, 8), np.float32)
    cache = np.zeros((1, 8, 2, 8), np.uint8)
    with pytest.raises(TypeError, match="argument 'k_cache': expected dtype .*float8_e4m3fn.*got dtype uint8"):
        _C.kvcache_forward(q, cache, cache.copy(), np.array([2], np.int32), None, None, None,
                           None, 1, np.zeros_like(q), None, k_scale=np.ones(2, np.float32),
                           v_scale=np.ones(2, np.float32))


# ------------------------------------------------------------------ binding-level checks


@pytest.mark.parametrize("kw, argument, actual", [
    (dict(window_left=2 ** 31), "window_left", "2147483648"),
    (dict(window_right=-2 ** 31 - 1), "window_right", "-2147483649"),
    (dict(seed=2 ** 64), "seed", "18446744073709551616"),
    (dict(seed=-1), "seed", "-1"),
    (dict(offset=2 ** 70), "offset", str(2 ** 70)),
    (dict(num_threads=2 ** 31), "num_threads", "2147483648"),
], ids=["window_left", "window_right", "seed-2^64", "seed-negative", "offset", "num_threads"])
def test_int_out_of_range_names_the_argument(kw, argument, actual):
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.forward(q, q, q, np.zeros_like(q), None, **kw)
    e = info.value
    assert isinstance(e, RuntimeError)
    assert (e.function, e.argument, e.actual) == ("forward", argument, actual)
    assert str(e).startswith(f"flashattn::forward: argument '{argument}': expected an int in [")


def test_seed_up_to_two_to_the_64_is_accepted():
    q = np.random.default_rng(0).standard_normal((1, 4, 2, 8))
    a, b = np.zeros_like(q), np.zeros_like(q)
    _C.forward(q, q, q, a, None, dropout_p=0.5, seed=2 ** 64 - 1, offset=2 ** 63)
    _C.forward(q, q, q, b, None, dropout_p=0.5, seed=np.uint64(2 ** 64 - 1), offset=2 ** 63)
    np.testing.assert_array_equal(a, b)


def test_max_seqlen_and_num_splits_out_of_range():
    q = np.zeros((4, 2, 8))
    cu = np.array([0, 4], np.int32)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.varlen_forward(q, q, q, cu, cu, None, 2 ** 31, 4, np.zeros_like(q), None)
    assert (info.value.function, info.value.argument) == ("varlen_forward", "max_seqlen_q")
    q4, cache = np.zeros((1, 1, 2, 8)), np.zeros((1, 4, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.kvcache_forward(q4, cache, cache.copy(), np.array([2], np.int32), None, None, None,
                           None, 2 ** 40, np.zeros_like(q4), None)
    assert (info.value.function, info.value.argument) == ("kvcache_forward", "num_splits")


def test_float_for_an_int_is_still_a_type_error():
    q = np.zeros((1, 4, 2, 8))
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _C.forward(q, q, q, np.zeros_like(q), None, window_left=1.5)


def test_index_arrays_ask_for_int32():
    q, cache = np.zeros((1, 1, 2, 8)), np.zeros((2, 4, 2, 8))
    with pytest.raises(flashattn.DTypeError) as info:
        _C.kvcache_forward(q, cache, cache.copy(), np.array([6], np.int32),
                           np.array([[1, 0]], np.int64), None, None, None, 0, np.zeros_like(q),
                           None)
    e = info.value
    assert str(e) == ("flashattn::kvcache_forward: argument 'block_table': expected dtype int32, "
                      "got dtype int64")
    assert (e.function, e.argument, e.expected, e.actual) == (
        "kvcache_forward", "block_table", "dtype int32", "dtype int64")
    assert isinstance(e, TypeError) and isinstance(e, RuntimeError)
    cu = np.array([0, 4], np.int64)
    with pytest.raises(TypeError, match="argument 'cu_seqlens_q': expected dtype int32, got dtype int64"):
        _C.varlen_forward(q[0], q[0], q[0], cu, cu, None, 4, 4, np.zeros_like(q[0]), None)


def test_binding_rank_error_is_an_invalid_argument():
    q = np.zeros((1, 1, 4, 2, 8))
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.forward(q, q, q, q.copy(), None)
    assert (info.value.function, info.value.argument, info.value.actual) == ("forward", "q", "rank 5")
    assert isinstance(info.value, RuntimeError)


def test_out_of_range_block_table_is_a_runtime_error():
    q, cache = np.zeros((1, 1, 2, 8)), np.zeros((2, 4, 2, 8))
    with pytest.raises(RuntimeError, match="argument 'block_table'"):
        _C.kvcache_forward(q, cache, cache.copy(), np.array([6], np.int32),
                           np.array([[1, 7]], np.int32), None, None, None, 0, np.zeros_like(q),
                           None)


# ---------------------------------------------------------------- block-sparse masks (numpy only)


def test_block_sparse_builders_and_binding_without_torch():
    """flashattn.block_sparse works on numpy arrays alone: a sliding window + sinks mask, a
    prefix-LM mask and a document mask, each run through the binding (dense) against the
    oracle with the pattern's dense element mask."""
    from flashattn import block_sparse as bsm

    rng = np.random.default_rng(5)
    b, s, h, d = 2, 53, 2, 8
    q, k, v = dense_problem(rng, b, s, s, h, h, d)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    docs = np.stack([np.repeat(np.arange(4), 14)[:s], np.repeat(np.arange(2), 27)[:s]]).astype(np.int32)
    cases = [
        (bsm.sliding_window_mask(s, s, 9, 0, 3, (8, 16)), dict(window_left=9, window_right=0),
         np.broadcast_to((j < 3) | ((j >= i - 9) & (j <= i)), (b, s, s))),
        (bsm.prefix_lm_mask([5, 30], s, s, (16, 8)), dict(causal=True),
         np.stack([(j < p) | (j <= i) for p in (5, 30)])),
        (bsm.document_mask(docs, (8, 8), causal=True), dict(causal=True),
         (docs[:, :, None] == docs[:, None, :]) & (j <= i)[None]),
    ]
    for m, opts, pattern in cases:
        assert isinstance(m.mask_block_cnt, np.ndarray)
        bq, bk = bsm.block_sizes(m.block_size)
        out, lse = poisoned((b, s, h, d)), poisoned((b, h, s), np.float32)
        kw = dict(mask_block_cnt=m.mask_block_cnt, mask_block_idx=m.mask_block_idx,
                  full_block_cnt=m.full_block_cnt, full_block_idx=m.full_block_idx,
                  block_size_q=bq, block_size_k=bk, q_doc_ids=m.q_doc_ids, k_doc_ids=m.k_doc_ids,
                  prefix_keys=m.prefix_keys)
        _C.forward(q, k, v, out, lse, **opts, **kw)
        dense = np.broadcast_to(pattern[:, None], (b, h, s, s))
        want = ref.attention(q, k, v, element_mask=dense)
        np.testing.assert_allclose(out, want["out"], **TOL64)
        np.testing.assert_allclose(lse, want["lse"], rtol=1e-6)
        np.testing.assert_array_equal(
            bsm.to_dense(m, s, s, batch=b, heads=h, causal=opts.get("causal", False),
                         window_size=(opts.get("window_left", -1), opts.get("window_right", -1))),
            dense)


def test_descales_need_fp8_inputs():
    # numpy has no fp8 dtype, so fp8 q, k, v come from torch (tests/python/test_fp8.py); the
    # binding still takes the descale keywords and the library rejects them on fp64 inputs.
    rng = np.random.default_rng(21)
    q, k, v = rand(rng, 1, 4, 2, 8), rand(rng, 1, 5, 1, 8), rand(rng, 1, 5, 1, 8)
    out = np.full((1, 4, 2, 8), np.nan)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        _C.forward(q, k, v, out, None, k_descale=np.ones((1, 1), dtype=np.float32))
    assert info.value.argument == "opts.k_descale"
    assert "an undefined tensor when q is not float8_e4m3" in info.value.expected
    assert np.isnan(out).all()
