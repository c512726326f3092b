"""seqused_q in the varlen calls (FlashAttention-4's name, issue 22): only the first
seqused_q[b] query slots of sequence b are computed, as a sequence of that many queries;
the rows past them get out 0, lse -inf and dq 0, and are not read. Against the numpy oracle
on the compacted sequences, gradcheck, the op's fake implementation (torch.compile), and the
argument errors. CPU backend."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import flash_attn_varlen_func, ops  # noqa: E402
import reference as ref  # noqa: E402


def np64(t):
    return t.detach().cpu().double().numpy()


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [5, 0, 9, 4], [6, 3, 9, 0]
    used_q = [2, 0, 9, 0]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(int(cu_k[-1]), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(int(cu_k[-1]), 2, 8, generator=g, dtype=torch.float64)
    return q, k, v, cu_q, cu_k, lens_q, used_q, torch.tensor(used_q, dtype=torch.int32)


def _used_rows(cu_q, used_q):
    return np.concatenate([np.arange(int(cu_q[b]), int(cu_q[b]) + u) for b, u in enumerate(used_q)])


@pytest.mark.parametrize("causal", [False, True])
def test_seqused_q_matches_the_compacted_sequences(seed, causal):
    q, k, v, cu_q, cu_k, lens_q, used_q, seqused_q = _case(seed)
    rows = _used_rows(cu_q, used_q)
    unused = np.setdiff1d(np.arange(q.shape[0]), rows)
    q[unused] = float("nan")  # never read
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=causal,
                                         window_size=(3, -1), return_attn_probs=True,
                                         seqused_q=seqused_q)
    cu_used = np.concatenate([[0], np.cumsum(used_q)])
    want = ref.attention(np64(q)[rows], np64(k), np64(v), causal=causal, window=(3, -1),
                         cu_seqlens_q=cu_used, cu_seqlens_k=cu_k.numpy())
    np.testing.assert_allclose(np64(out)[rows], want["out"], rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(np64(lse)[:, rows], want["lse"], rtol=2e-7)
    assert torch.all(out[unused] == 0)
    assert torch.all(lse[:, unused] == float("-inf"))


def test_seqused_q_gradients(seed):
    q, k, v, cu_q, cu_k, lens_q, used_q, seqused_q = _case(seed)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                               seqused_q=seqused_q), (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True, seqused_q=seqused_q)
    out.sum().backward()
    unused = np.setdiff1d(np.arange(q.shape[0]), _used_rows(cu_q, used_q))
    assert torch.all(q.grad[unused] == 0)
    assert q.grad[_used_rows(cu_q, used_q)].abs().max() > 0


def test_seqused_q_under_torch_compile(seed):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k, lens_q, used_q, seqused_q = _case(seed)
    q.requires_grad_()

    def f(q):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                      seqused_q=seqused_q).sum()

    (g_eager,) = torch.autograd.grad(f(q), q)
    (g_comp,) = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q), q)
    torch.testing.assert_close(g_comp, g_eager)


def test_seqused_q_errors():
    q, k, v, cu_q, cu_k, *_ = _case(0)
    with pytest.raises(flashattn.InvalidArgumentError, match="seqused_q\\[0\\] in \\[0, 5\\]"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9,
                               seqused_q=torch.tensor([6, 0, 0, 0], dtype=torch.int32))
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'seqused_q'"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9,
                               seqused_q=torch.tensor([1, 0, 0], dtype=torch.int32))
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'seqused_q'.*dtype int32"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, 9, 9, 1.0, False, -1, -1, 0.0, 0.0,
                       False, False, None, torch.tensor([1, 0, 0, 0], dtype=torch.float32))
    # int64 has no library dtype: the binding names the argument (a DTypeError).
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'seqused_q'"):
        ops.varlen_fwd(q, k, v, cu_q, cu_k, None, None, None, 9, 9, 1.0, False, -1, -1, 0.0, 0.0,
                       False, False, None, torch.tensor([1, 0, 0, 0], dtype=torch.int64))
