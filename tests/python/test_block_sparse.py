"""Block-sparse masks in Python (FlashAttention-4's BlockSparseTensors; flashattn.block_sparse):
the builders (document masking in a packed batch, prefix-LM, sliding window + sink tokens)
give exactly the element mask of their pattern, written here as a brute-force formula;
flash_attn_func with each builder's mask (and with random block masks) matches the fp64
numpy oracle (reference.py) given that dense mask, forward and gradients; opcheck of the
ops with a mask; the numpy binding; errors. CPU backend."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import reference as ref  # noqa: E402
from flashattn import InvalidArgumentError, UnsupportedError, flash_attn_func, ops  # noqa: E402
from flashattn import _C  # noqa: E402
from flashattn import block_sparse as bsm  # noqa: E402

F64 = torch.float64


def np64(t):
    return t.detach().to(F64).numpy()


# ---------------------------------------------------------------- brute-force patterns


def pattern_document(docs, causal):
    """[b, s, s]: same document (and j <= i when causal)."""
    docs = np.asarray(docs)
    same = docs[:, :, None] == docs[:, None, :]
    if causal:
        s = docs.shape[1]
        same &= np.tril(np.ones((s, s), dtype=bool))[None]
    return same


def pattern_prefix_lm(prefix, s_q, s_k):
    """[b, s_q, s_k]: j < prefix[b] or j <= i + s_k - s_q."""
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    return np.stack([(j < p) | (j <= i + s_k - s_q) for p in prefix])


def pattern_window_sinks(s_q, s_k, left, right, sinks):
    """[s_q, s_k]: j < sinks or i + s_k - s_q - left <= j <= i + s_k - s_q + right."""
    return ref.visible(s_q, s_k, False, (left, right)) | (np.arange(s_k)[None, :] < sinks)


def random_docs(rng, b, s, sorted_docs=True):
    if sorted_docs:
        return np.stack([np.cumsum(rng.random(s) < 0.07) for _ in range(b)]).astype(np.int32)
    return rng.integers(0, 4, size=(b, s)).astype(np.int32)


BLOCKS = [(128, 128), (16, 16), (32, 16), (7, 12), (1, 5)]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sorted_docs", [True, False])
def test_document_mask_is_exact(seed, block, causal, sorted_docs):
    rng = np.random.default_rng(seed)
    b, s = 2, int(rng.integers(1, 150))
    docs = random_docs(rng, b, s, sorted_docs)
    m = bsm.document_mask(docs, block, causal=causal)
    assert isinstance(m.mask_block_cnt, np.ndarray)  # numpy in, numpy out
    got = bsm.to_dense(m, s, s, batch=b, heads=3, causal=causal)
    want = pattern_document(docs, causal)
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


def test_document_mask_skips_and_fills_blocks():
    """Documents of 64 tokens, 16 x 16 blocks, causal: blocks inside one document below the
    diagonal are full, those on it partial, the rest skipped."""
    docs = np.repeat(np.arange(4), 64)[None]
    m = bsm.document_mask(docs, (16, 16), causal=True)
    cnt, full = m.mask_block_cnt[0, 0], m.full_block_cnt[0, 0]
    np.testing.assert_array_equal(cnt, np.ones(16))  # the diagonal block
    np.testing.assert_array_equal(full, np.tile(np.arange(4), 4))  # earlier blocks of the doc


@pytest.mark.parametrize("block", BLOCKS)
def test_prefix_lm_mask_is_exact(seed, block):
    rng = np.random.default_rng(seed)
    s_q = int(rng.integers(1, 140))
    s_k = s_q + int(rng.integers(0, 30))
    prefix = rng.integers(0, s_k + 3, size=3)
    m = bsm.prefix_lm_mask(torch.tensor(prefix), s_q, s_k, block)
    assert isinstance(m.mask_block_cnt, torch.Tensor)  # torch in, torch out
    got = bsm.to_dense(m, s_q, s_k, batch=3, heads=2, causal=True)
    want = pattern_prefix_lm(prefix, s_q, s_k)
    np.testing.assert_array_equal(got, np.broadcast_to(want[:, None], got.shape))


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (40, 0), (17, 9), (-1, 3), (30, -1)])
def test_sliding_window_mask_is_exact(seed, block, window):
    rng = np.random.default_rng(seed)
    s_q = int(rng.integers(1, 140))
    s_k = s_q + int(rng.integers(0, 40))
    sinks = int(rng.integers(0, 9))
    left, right = window
    m = bsm.sliding_window_mask(s_q, s_k, left, right, sinks, block, batch=2, device="cpu")
    got = bsm.to_dense(m, s_q, s_k, batch=2, heads=1, window_size=(left, right))
    want = pattern_window_sinks(s_q, s_k, left, right, sinks)
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


def test_sliding_window_skips_blocks():
    """At 16k with a 1k window and 4 sinks, 128 x 128 blocks: a few blocks per row."""
    m = bsm.sliding_window_mask(16384, 16384, 1024, 0, 4, (128, 128))
    visited = m.mask_block_cnt + m.full_block_cnt
    assert visited.max() <= 11
    assert visited.sum() < 0.1 * 128 * 128


# ---------------------------------------------------------------- attention with the masks


def check_call(q, k, v, mask, dense, causal=False, window=(-1, -1), sink=None):
    """flash_attn_func with the block mask against the oracle with the dense element mask
    (fp64): out, lse and the gradients of q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                  return_attn_probs=True, block_sparse_tensors=mask,
                                  learnable_sink=sink)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = ref.attention(np64(q), np64(k), np64(v), dout=np64(dout), element_mask=dense,
                         learnable_sink=None if sink is None else np64(sink))
    np.testing.assert_allclose(np64(out), want["out"], rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(np64(lse), want["lse"], rtol=1e-6)
    for name, t in (("dq", q), ("dk", k), ("dv", v)):
        # (lse is fp32: the backward recomputes P from it, ~1e-7 relative)
        np.testing.assert_allclose(np64(t.grad), want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


def test_document_mask_attention(seed):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b, s, h_q, h_k, d = 2, 97, 4, 2, 16
    docs = torch.from_numpy(random_docs(rng, b, s))
    m = bsm.document_mask(docs, (32, 32), causal=True)
    dense = np.broadcast_to(pattern_document(docs.numpy(), True)[:, None], (b, h_q, s, s))
    check_call(randn(g, b, s, h_q, d), randn(g, b, s, h_k, d), randn(g, b, s, h_k, d), m, dense,
               causal=True)


def test_prefix_lm_attention(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, h, d = 3, 83, 2, 8
    prefix = [0, 30, 83]
    m = bsm.prefix_lm_mask(prefix, s, s, (16, 16), device="cpu")
    dense = np.broadcast_to(pattern_prefix_lm(prefix, s, s)[:, None], (b, h, s, s))
    check_call(randn(g, b, s, h, d), randn(g, b, s, h, d), randn(g, b, s, h, d), m, dense,
               causal=True)


@pytest.mark.parametrize("with_sink", [False, True])
def test_sliding_window_with_sink_tokens_attention(seed, with_sink):
    g = torch.Generator().manual_seed(seed)
    b, s_q, s_k, h, d = 2, 70, 150, 2, 8
    # batch=None: prefix_keys [1] for every sequence.
    m = bsm.sliding_window_mask(s_q, s_k, 20, 0, 3, (16, 32), device="cpu")
    assert m.prefix_keys.shape == (1,)
    dense = np.broadcast_to(pattern_window_sinks(s_q, s_k, 20, 0, 3), (b, h, s_q, s_k))
    sink = torch.randn(h, generator=g, dtype=torch.float32) if with_sink else None
    check_call(randn(g, b, s_q, h, d), randn(g, b, s_k, h, d), randn(g, b, s_k, h, d), m, dense,
               window=(20, 0), sink=sink)


def test_random_block_masks_attention(seed):
    """Random kinds per (b, h, m, n) with causal: to_dense against the oracle."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    b, s_q, s_k, h_q, h_k, d, bq, bk = 2, 77, 91, 4, 2, 8, 16, 24
    M, N = -(-s_q // bq), -(-s_k // bk)
    kinds = rng.integers(0, 3, size=(b, h_q, M, N))
    m = bsm.from_block_kinds(torch.from_numpy(kinds), (bq, bk))
    dense = bsm.to_dense(m, s_q, s_k, batch=b, heads=h_q, causal=True)
    check_call(randn(g, b, s_q, h_q, d), randn(g, b, s_k, h_k, d), randn(g, b, s_k, h_k, d), m,
               dense, causal=True)


def test_fa4_style_mask_object_and_float32(seed):
    """Any object with FA4's fields works (block_size None = 128 x 128); fp32 inputs."""
    from typing import NamedTuple

    class FA4Like(NamedTuple):
        mask_block_cnt: torch.Tensor
        mask_block_idx: torch.Tensor
        full_block_cnt: torch.Tensor = None
        full_block_idx: torch.Tensor = None
        block_size: tuple = None

    g = torch.Generator().manual_seed(seed)
    s = 300
    cnt = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0, 0], [1, 0, 0], [2, 0, 0]]]], dtype=torch.int32)
    fcnt = torch.tensor([[[0, 0, 1]]], dtype=torch.int32)
    fidx = torch.tensor([[[[0, 0, 0], [0, 0, 0], [0, 0, 0]]]], dtype=torch.int32)
    mask = FA4Like(cnt, idx, fcnt, fidx)
    q, k, v = (randn(g, 1, s, 2, 16).float() for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True, block_sparse_tensors=mask)
    dense = bsm.to_dense(bsm.BlockSparseTensorsTorch(cnt, idx, fcnt, fidx), s, s, batch=1,
                         heads=2, causal=True)
    want = ref.attention(np64(q), np64(k), np64(v), element_mask=dense)
    np.testing.assert_allclose(np64(out), want["out"], rtol=2e-4, atol=2e-5)


def test_opcheck_with_block_mask(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, 2, 9, 2, 8), randn(g, 2, 11, 1, 8), randn(g, 2, 11, 1, 8)
    m = bsm.prefix_lm_mask([3, 5], 9, 11, (4, 4), device="cpu")
    m2 = bsm.document_mask(torch.tensor([[0] * 5 + [1] * 4, [0] * 9]), (4, 4))
    bs = (m.mask_block_cnt, m.mask_block_idx, m.full_block_cnt, m.full_block_idx, 4, 4, None,
          None, m.prefix_keys)
    args = (q, k, v, None, None, 0.25, True, -1, -1, 0.0, 0.0, False, False, None, None)  # sink, qv
    torch.library.opcheck(ops.fwd, args + bs)
    out, lse, _ = ops.fwd(*args, *bs)
    dout = randn(g, *out.shape)
    torch.library.opcheck(ops.bwd, (dout, q, k, v, out, lse, None, None, 0.25, True, -1, -1,
                                    0.0, 0.0, False, None) + bs)
    # Document ids, with q requiring grad (the autograd formula passes the mask on).
    qs, ks = randn(g, 2, 9, 2, 8), randn(g, 2, 9, 1, 8)
    bs2 = (m2.mask_block_cnt, m2.mask_block_idx, m2.full_block_cnt, m2.full_block_idx, 4, 4,
           m2.q_doc_ids, m2.k_doc_ids, None)
    torch.library.opcheck(ops.fwd, (qs.requires_grad_(), ks.requires_grad_(), ks.clone(), None,
                                    None, 0.25, True, -1, -1, 0.0, 0.0, False, False, None, None) + bs2)


def test_torch_compile_fullgraph_with_block_mask(seed):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    m = bsm.sliding_window_mask(40, 40, 8, 0, 2, (8, 8), batch=1, device="cpu")
    q, k, v = (randn(g, 1, 40, 2, 8) for _ in range(3))

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return flash_attn_func(q, k, v, window_size=(8, 0), block_sparse_tensors=m)

    np.testing.assert_allclose(np64(f(q, k, v)), np64(flash_attn_func(
        q, k, v, window_size=(8, 0), block_sparse_tensors=m)), rtol=0, atol=0)


def test_numpy_binding_with_block_mask(seed):
    rng = np.random.default_rng(seed)
    b, s, h, d = 2, 45, 2, 8
    q, k, v = (rng.standard_normal((b, s, h, d)) for _ in range(3))
    docs = random_docs(rng, b, s)
    m = bsm.document_mask(docs, (8, 8), causal=True)
    out = np.full((b, s, h, d), np.nan)
    lse = np.full((b, h, s), np.nan, dtype=np.float32)
    _C.forward(q, k, v, out, lse, causal=True, mask_block_cnt=m.mask_block_cnt,
               mask_block_idx=m.mask_block_idx, full_block_cnt=m.full_block_cnt,
               full_block_idx=m.full_block_idx, block_size_q=8, block_size_k=8,
               q_doc_ids=m.q_doc_ids, k_doc_ids=m.k_doc_ids)
    dense = np.broadcast_to(pattern_document(docs, True)[:, None], (b, h, s, s))
    want = ref.attention(q, k, v, element_mask=dense)
    np.testing.assert_allclose(out, want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(lse, want["lse"], rtol=1e-6)


def test_block_mask_errors():
    q = torch.randn(1, 20, 2, 8, dtype=F64)
    m = bsm.sliding_window_mask(20, 20, 4, 0, 0, (8, 8))
    mt = bsm.from_block_kinds(torch.from_numpy(np.ones((1, 1, 3, 3), dtype=np.int8)), (8, 8))
    # The KV-cache call declines block sparsity, naming the C++ option.
    with pytest.raises(UnsupportedError, match="opts.block_sparse"):
        _C.kvcache_forward(np.zeros((1, 1, 1, 8)), np.zeros((1, 8, 1, 8)), np.zeros((1, 8, 1, 8)),
                           np.array([4], np.int32), None, None, None, None, 1,
                           np.zeros((1, 1, 1, 8)), np.zeros((1, 1, 1), np.float32), None,
                           mask_block_cnt=m.mask_block_cnt, mask_block_idx=m.mask_block_idx)
    # Varlen: a mask for another max_seqlen_k.
    with pytest.raises(InvalidArgumentError, match="max_seqlen_k"):
        _C.varlen_forward(np.zeros((4, 1, 8)), np.zeros((4, 1, 8)), np.zeros((4, 1, 8)),
                          np.array([0, 4], np.int32), np.array([0, 4], np.int32), None, 4, 4,
                          np.zeros((4, 1, 8)), np.zeros((1, 4), np.float32), block_size_q=8,
                          block_size_k=2, mask_block_cnt=m.mask_block_cnt[:, :, :1],
                          mask_block_idx=m.mask_block_idx[:, :, :1])
    # A mask built for other lengths: the block counts disagree.
    with pytest.raises(InvalidArgumentError, match="block_sparse_tensors.mask_block_cnt") as e:
        flash_attn_func(q, q[:, :17], q[:, :17], block_sparse_tensors=bsm.sliding_window_mask(
            30, 30, 4, 0, 0, (8, 8), device="cpu"))
    assert "M = ceil(s_q / block_size_q) = ceil(20 / 8) = 3" in str(e.value)
    # k_doc_ids without q_doc_ids.
    with pytest.raises(InvalidArgumentError, match="block_sparse_tensors.q_doc_ids"):
        flash_attn_func(q, q, q, block_sparse_tensors=mt._replace(
            k_doc_ids=torch.zeros(1, 20, dtype=torch.int32)))
    if flashattn.cuda_available():
        qc = q.cuda().half()
        mc = bsm.sliding_window_mask(20, 20, 4, 0, 0, (8, 8), device="cuda")
        with pytest.raises(UnsupportedError, match="block_sparse_tensors"):
            flash_attn_func(qc, qc, qc, block_sparse_tensors=mc)


def test_varlen_random_block_masks_attention(seed):
    """flash_attn_varlen_func with a block mask over the max_seqlen grid, packed doc ids and
    prefix keys: each sequence against the oracle with its dense element mask."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    lq, lk = [20, 0, 45, 7], [33, 5, 45, 60]
    h_q, h_k, d, bq, bk = 4, 2, 8, 8, 16
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
    max_q, max_k = max(lq), max(lk)
    M, N = -(-max_q // bq), -(-max_k // bk)
    kinds = rng.integers(0, 3, size=(len(lq), h_q, M, N))
    dq_ids = rng.integers(0, 2, size=sum(lq)).astype(np.int32)
    dk_ids = rng.integers(0, 2, size=sum(lk)).astype(np.int32)
    prefix = rng.integers(0, 20, size=len(lq)).astype(np.int32)
    m = bsm.from_block_kinds(torch.from_numpy(kinds), (bq, bk), q_doc_ids=torch.from_numpy(dq_ids),
                             k_doc_ids=torch.from_numpy(dk_ids), prefix_keys=torch.from_numpy(prefix))
    q = randn(g, sum(lq), h_q, d).requires_grad_()
    k = randn(g, sum(lk), h_k, d).requires_grad_()
    v = randn(g, sum(lk), h_k, d).requires_grad_()
    out = flashattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                           block_sparse_tensors=m)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(len(lq)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        s_q, s_k = q1 - q0, k1 - k0
        i = np.arange(s_q)[:, None]
        j = np.arange(s_k)[None, :]
        rule = ((j <= i + s_k - s_q) | (j < prefix[b])) & \
            (dq_ids[q0:q1][:, None] == dk_ids[k0:k1][None, :])
        kind = kinds[b][:, i // bq, j // bk]  # [h_q, s_q, s_k]
        dense = ((kind == 2) | ((kind == 1) & rule[None]))[None]
        want = ref.attention(np64(q[q0:q1])[None], np64(k[k0:k1])[None], np64(v[k0:k1])[None],
                             dout=np64(dout[q0:q1])[None], element_mask=dense)
        np.testing.assert_allclose(np64(out[q0:q1]), want["out"][0], rtol=1e-9, atol=1e-10)
        np.testing.assert_allclose(np64(q.grad[q0:q1]), want["dq"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(k.grad[k0:k1]), want["dk"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np64(v.grad[k0:k1]), want["dv"][0], rtol=1e-5, atol=1e-6)


def test_opcheck_varlen_with_block_mask(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = randn(g, 12, 2, 8), randn(g, 15, 1, 8), randn(g, 15, 1, 8)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 15], dtype=torch.int32)
    m = bsm.from_block_kinds(torch.from_numpy(np.random.default_rng(seed).integers(0, 3, (2, 1, 2, 3))),
                             (4, 4))
    bs = (m.mask_block_cnt, m.mask_block_idx, m.full_block_cnt, m.full_block_idx, 4, 4, None,
          None, None)
    args = (q, k, v, cu_q, cu_k, None, None, None, 7, 9, 0.25, True, -1, -1, 0.0, 0.0, False,
            False, None, None, None)  # sink, seqused_q, qv
    torch.library.opcheck(ops.varlen_fwd, args + bs)
    out, lse, _ = ops.varlen_fwd(*args, *bs)
    torch.library.opcheck(ops.varlen_bwd, (randn(g, 12, 2, 8), q, k, v, out, lse, cu_q, cu_k, None,
                                           None, None, 7, 9, 0.25, True, -1, -1, 0.0, 0.0, False,
                                           None, None) + bs)
