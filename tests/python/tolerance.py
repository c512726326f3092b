"""The FlashAttention tolerance rule for fp16 / bf16 results (docs/semantics.md, Precision):
a result is accepted when its largest error against the fp64 oracle is at most twice that of
the naive computation in the same precision (S and P rounded to the input type, as an
unfused framework computes it) plus a rounding floor, eps of the dtype times the largest
exact value. The bound follows from the data of each run, not from a constant picked for one
seed (test_torch.py and test_sink.py apply the same rule to the CUDA kernels)."""

import numpy as np
import torch

import reference as ref

# (error / bound) of every check made since the last reset: the seed sweeps read how close
# a run came to its bound (1.0 = at the bound).
MARGINS = []


def naive_attention(q, k, v, scale, causal=False, window=(-1, -1), qv=None, softcap=0.0):
    """Unfused attention in q's dtype: q [b, s_q, h_q, d], k [b, s_k, h_k, d], v [b, s_k,
    h_k, d_v] (GQA: h_q a multiple of h_k), qv (MLA: scores q . k + qv . v) like q with d_v.
    S = scale * (q k^T [+ qv v^T]) and P = softmax(S) are each rounded to the dtype, then
    P v; a row that sees no key gives 0."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if qv is not None:
        s = s + torch.einsum("bqhd,bkhd->bhqk", qv, v)
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = torch.as_tensor(ref.visible(q.shape[1], k.shape[1], causal, window), device=s.device)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _np64(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_within_rule(got, naive, exact, dtype, what="out"):
    """max|got - exact| <= 2 max|naive - exact| + eps(dtype) max|exact| (got, naive: tensors
    or arrays of the same shape as the fp64 `exact`)."""
    got, naive, exact = _np64(got), _np64(naive), _np64(exact)
    assert got.shape == exact.shape and naive.shape == exact.shape, (got.shape, naive.shape,
                                                                     exact.shape)
    eps = float(torch.finfo(dtype).eps)
    err = float(np.abs(got - exact).max(initial=0.0))
    naive_err = float(np.abs(naive - exact).max(initial=0.0))
    top = float(np.abs(exact).max(initial=0.0))
    bound = 2 * naive_err + eps * top
    MARGINS.append(err / bound if bound > 0 else (0.0 if err == 0 else np.inf))
    assert err <= bound, (f"{what}: max error {err:.3e} > bound {bound:.3e} = 2 * naive "
                          f"{naive_err:.3e} + {eps:.1e} * max|exact| {top:.3e}")
