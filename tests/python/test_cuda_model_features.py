"""Model features on CUDA tensors through the flash_attn-style functions (issue 22): v with
its own head dim (DeepSeek-V3's (192, 128)), forward and gradients, and in
flash_attn_with_kvcache with an append; varlen seqused_q; a block-sparse mask (document
masking within a packed row) in the forward. Each against the
fp64 oracle under the FlashAttention tolerance rule (tolerance.py: twice the error of the
unfused computation in the same precision, plus eps * max). Skipped without a GPU (CI);
scripts/gpu.sh runs them (python step)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import block_sparse as bsm  # noqa: E402
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
import reference as ref  # noqa: E402
from tolerance import assert_within_rule, naive_attention  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device or a build without CUDA")


def np64(t):
    return t.detach().cpu().double().numpy()


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [(192, 128), (64, 128)], ids=["deepseek_192_128", "d64_dv128"])
def test_cuda_head_dim_of_v_forward_and_gradients(seed, dtype, dims):
    d, d_v = dims
    g = gen(seed)
    b, s_q, s_k, h_q, h_k = 2, 173, 251, 8, 2
    q64, k64 = torch.randn(b, s_q, h_q, d, generator=g), torch.randn(b, s_k, h_k, d, generator=g)
    v64, dout64 = torch.randn(b, s_k, h_k, d_v, generator=g), torch.randn(b, s_q, h_q, d_v, generator=g)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (q64, k64, v64)]
    out = flash_attn_func(*leaves, causal=True)
    assert out.shape == (b, s_q, h_q, d_v)
    grads = torch.autograd.grad(out, leaves, dout64.to("cuda", dtype))
    naive_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    naive = naive_attention(*naive_leaves, d ** -0.5, causal=True)
    naive_grads = torch.autograd.grad(naive, naive_leaves, dout64.to("cuda", dtype))
    want = ref.attention(*(np64(t.to(dtype)) for t in (q64, k64, v64)), causal=True,
                         dout=np64(dout64.to(dtype)))
    assert_within_rule(out, naive, want["out"], dtype, "out")
    for name, got, base in zip(("dq", "dk", "dv"), grads, naive_grads):
        assert_within_rule(got, base, want[name], dtype, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s_q", [1, 7], ids=["decode", "chunk"])
def test_cuda_kvcache_head_dim_of_v_with_append(seed, dtype, s_q):
    """A dense cache with d_v != d (the fused forward runs it): the appended caches exactly
    the new rows (K of d, V of d_v), out within the rule of the unfused computation over
    each sequence's keys."""
    g = gen(seed)
    b, h_q, h_k, d, d_v, s_cache = 3, 8, 2, 192, 128, 300
    lens = torch.tensor([int(torch.randint(1, 250, (), generator=g)), 0, 177], dtype=torch.int32)
    q = torch.randn(b, s_q, h_q, d, generator=g).to(dtype)
    k_new, v_new = (torch.randn(b, s_q, h_k, x, generator=g).to(dtype) for x in (d, d_v))
    k_cache = torch.randn(b, s_cache, h_k, d, generator=g).to(dtype)
    v_cache = torch.randn(b, s_cache, h_k, d_v, generator=g).to(dtype)
    want, kc, vc = ref.kvcache_attention(np64(q), np64(k_cache), np64(v_cache), lens.numpy(),
                                         np64(k_new), np64(v_new), causal=True,
                                         softmax_scale=d ** -0.5)
    kc_dev, vc_dev = k_cache.cuda(), v_cache.cuda()
    out = flash_attn_with_kvcache(q.cuda(), kc_dev, vc_dev, k_new.cuda(), v_new.cuda(),
                                  cache_seqlens=lens.cuda(), causal=True)
    assert out.shape == (b, s_q, h_q, d_v)
    assert torch.equal(kc_dev.cpu(), torch.from_numpy(kc).to(dtype))
    assert torch.equal(vc_dev.cpu(), torch.from_numpy(vc).to(dtype))
    naive = torch.cat([naive_attention(q[i:i + 1].cuda(), kc_dev[i:i + 1, :int(lens[i]) + s_q],
                                       vc_dev[i:i + 1, :int(lens[i]) + s_q], d ** -0.5, causal=True)
                       for i in range(b)])
    assert_within_rule(out, naive, want["out"], dtype, "out")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_seqused_q_rows_are_the_compacted_sequences(seed, dtype):
    g = gen(seed)
    lens_q, lens_k = [70, 0, 203, 12], [90, 40, 200, 16]
    used_q = [int(torch.randint(1, 70, (), generator=g)), 0, 131, 12]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 64, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), 2, 64, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), 2, 64, generator=g).to(dtype)
    rows = np.concatenate([np.arange(int(cu_q[i]), int(cu_q[i]) + u) for i, u in enumerate(used_q)])
    for i, u in enumerate(used_q):  # rows past seqused_q hold NaN: never read
        q[int(cu_q[i]) + u:int(cu_q[i + 1])] = float("nan")
    out = flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(),
                                 max(lens_q), max(lens_k), causal=True,
                                 seqused_q=torch.tensor(used_q, dtype=torch.int32).cuda()).cpu()
    unused = np.setdiff1d(np.arange(q.shape[0]), rows)
    assert torch.all(out[unused] == 0)
    # The used rows as sequences of seqused_q queries (s_q = seqused_q in the causal rule).
    cu_used = np.concatenate([[0], np.cumsum(used_q)])
    want = ref.attention(np64(q[rows]), np64(k), np64(v), causal=True, cu_seqlens_q=cu_used,
                         cu_seqlens_k=cu_k.numpy())
    naive = torch.zeros(len(rows), 4, 64, dtype=dtype)
    for i, u in enumerate(used_q):
        if u == 0 or lens_k[i] == 0:
            continue
        qs = q[int(cu_q[i]):int(cu_q[i]) + u][None]
        ks, vs = k[int(cu_k[i]):int(cu_k[i + 1])][None], v[int(cu_k[i]):int(cu_k[i + 1])][None]
        naive[int(cu_used[i]):int(cu_used[i + 1])] = naive_attention(qs, ks, vs, 64 ** -0.5,
                                                                     causal=True)[0]
    assert_within_rule(out[rows], naive, want["out"], dtype, "out")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_block_sparse_document_mask_forward(seed, dtype):
    g = gen(seed)
    b, s, h, d = 2, 640, 4, 64
    docs = torch.cumsum((torch.rand(b, s, generator=g) < 0.01).to(torch.int32), dim=1)
    mask = bsm.document_mask(docs.cuda(), causal=True)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3))
    out = flash_attn_func(q.cuda(), k.cuda(), v.cuda(), causal=True, block_sparse_tensors=mask)
    dense = bsm.to_dense(mask, s, s, batch=b, heads=h, causal=True)
    want = ref.attention(np64(q), np64(k), np64(v), element_mask=dense)
    # The unfused computation under the same element mask, in the dtype.
    sc = torch.einsum("bqhd,bkhd->bhqk", q.cuda(), k.cuda()) * d ** -0.5
    sc = sc.masked_fill(~torch.as_tensor(dense, device="cuda"), float("-inf"))
    naive = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(sc, dim=-1).nan_to_num(0.0), v.cuda())
    assert_within_rule(out, naive, want["out"], dtype, "out")
