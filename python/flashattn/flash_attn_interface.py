"""flash_attn.flash_attn_interface, as other libraries import it (flash_attn 2.7 / 2.8).

Besides the public functions (flashattn.interface's, re-exported), libraries built on
flash_attn (ring attention, sequence parallelism, ...) import its private functions and
its compiled-module handle:

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax)
        -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p, softmax_scale, causal, ...)
        -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                         softmax_scale, causal, window_size_left, window_size_right,
                         softcap, alibi_slopes, deterministic, rng_state=None) -> softmax_d
    _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, ...)
        -> softmax_d
    flash_attn_gpu.{fwd, varlen_fwd, bwd, varlen_bwd, fwd_kvcache}   (flash_attn_2_cuda)

with flash_attn 2.8.3's signatures and semantics: the backward functions write the
gradients into dq, dk, dv (out-parameters; views such as dqkv[:, :, 0] are fine) and
return softmax_d; flash_attn_gpu's functions write into out_ / dq_ / dk_ / dv_ when given
and return lists. They run on flashattn's ops (CPU or CUDA tensors) with no autograd (as
flash_attn's). Differences:
  - rng_state is flashattn's (seed, offset) pair, an int64 CPU tensor [2] (zeros without
    dropout); hand it back to the backward as flash_attn's is.
  - S_dmask: on CPU tensors the probabilities (fp32, [b, h_q, s_q, s_k]; varlen [h_q,
    total_q, max_seqlen_k]) when return_softmax; on CUDA tensors with dropout flash_attn's
    layout (fp32 [b, h_q, round128(s_q), round128(s_k)], exp(s - rowmax), negated where
    dropped) computed by the CPU backend with the call's (seed, offset); else an empty
    tensor.
  - softmax_d = rowsum(dout * out), fp32 [b, h_q, s_q] (varlen [h_q, total_q]), not padded
    to a multiple of 128.
  - gen_ (a torch.Generator) only seeds the dropout pair; block_table in varlen_fwd
    gathers the blocks into a packed k, v (as flashattn.flash_attn_varlen_func does);
    leftpad_k in the varlen calls raises UnsupportedError;
    zero_tensors and num_splits of the varlen calls are accepted and ignored.
"""

import types
from typing import Optional

import torch
from torch import Tensor

from . import interface, ops
from ._C import UnsupportedError
from .interface import (  # noqa: F401  (the public functions)
    apply_rotary_emb,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)


def _rng_state(dropout_p: float, gen) -> Tensor:
    if dropout_p <= 0.0:
        return torch.zeros(2, dtype=torch.int64)
    if gen is None:
        return interface._rng_state(dropout_p)
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, generator=gen,
                         device=gen.device).cpu()


def _detach(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def _scale(q: Tensor, softmax_scale) -> float:
    return interface._scale(q, softmax_scale)


def _into(dst: Optional[Tensor], src: Tensor) -> Tensor:
    """flash_attn's out-parameter: src copied into dst when given (and dst returned)."""
    if dst is None:
        return src
    dst.copy_(src)
    return dst


def _no_leftpad(fn: str, leftpad_k):
    if leftpad_k is not None:
        raise UnsupportedError(
            f"flashattn.{fn}: argument 'leftpad_k': expected None (left-padded varlen "
            f"attention is not supported; flash_attn_with_kvcache takes a cache_leftpad), "
            f"got a tensor")


def _row_dot(dout: Tensor, out: Tensor) -> Tensor:
    """rowsum(dout * out) over the head dim, fp32 (flash_attn's softmax_d)."""
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (dout.detach().to(acc) * out.detach().to(acc)).sum(-1).to(torch.float32)


# ---------------------------------------------------------------- flash_attn_gpu


def _gpu_fwd(q, k, v, out_, alibi_slopes_, p_dropout, softmax_scale, is_causal,
             window_size_left, window_size_right, softcap, return_softmax, gen_=None):
    """flash_attn_2_cuda.fwd -> [out, softmax_lse, S_dmask, rng_state]."""
    q, k, v, alibi = _detach(q), _detach(k), _detach(v), _detach(alibi_slopes_)
    rng_state = _rng_state(float(p_dropout), gen_)
    cuda = interface._cuda_path(q)
    want_probs = bool(return_softmax) and not cuda
    scale = _scale(q, softmax_scale)
    out, lse, probs = ops.fwd(q, k, v, alibi, rng_state if p_dropout > 0 else None, scale,
                              bool(is_causal), int(window_size_left), int(window_size_right),
                              float(softcap), float(p_dropout), False, want_probs)
    if cuda and return_softmax and p_dropout > 0:  # flash_attn's layout, from the CPU backend
        probs = interface._fa2_s_dmask(q, k, v, rng_state, scale, bool(is_causal),
                                       int(window_size_left), int(window_size_right),
                                       float(softcap), float(p_dropout), alibi, None)
    elif not want_probs:
        probs = torch.empty(0, dtype=q.dtype, device=q.device)
    return [_into(out_, out), lse, probs, rng_state]


def _gpu_varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k_,
                    block_table_, alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout,
                    softmax_scale, zero_tensors, is_causal, window_size_left,
                    window_size_right, softcap, return_softmax, gen_=None, num_splits=0):
    """flash_attn_2_cuda.varlen_fwd -> [out, softmax_lse, S_dmask, rng_state]."""
    _no_leftpad("flash_attn_gpu.varlen_fwd", leftpad_k_)
    q, k, v, alibi = _detach(q), _detach(k), _detach(v), _detach(alibi_slopes_)
    layout_max_k = int(max_seqlen_k)
    # Paged KV: the blocks gathered into a packed k, v.
    k, v, cu_seqlens_k, seqused_k, max_seqlen_k = interface._paged_as_varlen(
        "flashattn.flash_attn_gpu.varlen_fwd", q, k, v, cu_seqlens_k, seqused_k, block_table_,
        int(max_seqlen_k))
    rng_state = _rng_state(float(p_dropout), gen_)
    cuda = interface._cuda_path(q)
    want_probs = bool(return_softmax) and not cuda
    scale = _scale(q, softmax_scale)
    out, lse, probs = ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi,
                                     rng_state if p_dropout > 0 else None, int(max_seqlen_q),
                                     int(max_seqlen_k), scale, bool(is_causal),
                                     int(window_size_left), int(window_size_right),
                                     float(softcap), float(p_dropout), False, want_probs)
    if cuda and return_softmax and p_dropout > 0:  # flash_attn's layout, from the CPU backend
        probs = interface._fa2_s_dmask(
            q, k, v, rng_state, scale, bool(is_causal), int(window_size_left),
            int(window_size_right), float(softcap), float(p_dropout), alibi, None,
            varlen=(cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                    int(max_seqlen_k), None), layout_max_k=layout_max_k)
    elif want_probs:
        probs = probs[..., :layout_max_k]
    else:
        probs = torch.empty(0, dtype=q.dtype, device=q.device)
    return [_into(out_, out), lse, probs, rng_state]


def _gpu_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout,
             softmax_scale, is_causal, window_size_left, window_size_right, softcap,
             deterministic, gen_=None, rng_state=None):
    """flash_attn_2_cuda.bwd -> [dq, dk, dv, softmax_d]; writes dq_, dk_, dv_ when given."""
    q = _detach(q)
    dq, dk, dv, _ = ops.bwd(_detach(dout), q, _detach(k), _detach(v), _detach(out),
                         _detach(softmax_lse), _detach(alibi_slopes_),
                         rng_state if p_dropout > 0 else None, _scale(q, softmax_scale),
                         bool(is_causal), int(window_size_left), int(window_size_right),
                         float(softcap), float(p_dropout), bool(deterministic))
    softmax_d = _row_dot(dout, out).transpose(1, 2).contiguous()  # [b, h_q, s_q]
    return [_into(dq_, dq), _into(dk_, dk), _into(dv_, dv), softmax_d]


def _gpu_varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
                    alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                    zero_tensors, is_causal, window_size_left, window_size_right, softcap,
                    deterministic, gen_=None, rng_state=None):
    """flash_attn_2_cuda.varlen_bwd -> [dq, dk, dv, softmax_d]."""
    q = _detach(q)
    dq, dk, dv, _ = ops.varlen_bwd(_detach(dout), q, _detach(k), _detach(v), _detach(out),
                                _detach(softmax_lse), cu_seqlens_q, cu_seqlens_k, None,
                                _detach(alibi_slopes_), rng_state if p_dropout > 0 else None,
                                int(max_seqlen_q), int(max_seqlen_k), _scale(q, softmax_scale),
                                bool(is_causal), int(window_size_left), int(window_size_right),
                                float(softcap), float(p_dropout), bool(deterministic))
    softmax_d = _row_dot(dout, out).t().contiguous()  # [h_q, total_q]
    return [_into(dq_, dq), _into(dk_, dk), _into(dv_, dv), softmax_d]


def _gpu_fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_,
                     cache_batch_idx_, leftpad_k_, block_table_, alibi_slopes_, out_,
                     softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                     is_rotary_interleaved, num_splits):
    """flash_attn_2_cuda.fwd_kvcache -> [out, softmax_lse]; appends k_, v_ in place."""
    out, lse = flash_attn_with_kvcache(
        q, kcache, vcache, k_, v_, rotary_cos_, rotary_sin_, seqlens_k_, cache_batch_idx_,
        leftpad_k_, block_table_, softmax_scale, is_causal,
        (window_size_left, window_size_right), softcap, is_rotary_interleaved, alibi_slopes_,
        num_splits, return_softmax_lse=True)
    return [_into(out_, out), lse]


flash_attn_gpu = types.ModuleType(
    "flashattn.flash_attn_gpu",
    "flash_attn's compiled module (flash_attn_2_cuda) as flashattn provides it: fwd, "
    "varlen_fwd, bwd, varlen_bwd, fwd_kvcache with flash_attn 2.8's positional arguments.")
flash_attn_gpu.fwd = _gpu_fwd
flash_attn_gpu.varlen_fwd = _gpu_varlen_fwd
flash_attn_gpu.bwd = _gpu_bwd
flash_attn_gpu.varlen_bwd = _gpu_varlen_bwd
flash_attn_gpu.fwd_kvcache = _gpu_fwd_kvcache


# ---------------------------------------------------------------- the private functions


def _flash_attn_forward(q, k, v, dropout_p: float, softmax_scale: float, causal: bool,
                        window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[Tensor], return_softmax: bool):
    """-> (out, softmax_lse, S_dmask, rng_state), as flash_attn 2.8's."""
    out, lse, s_dmask, rng_state = flash_attn_gpu.fwd(
        q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, return_softmax, None)
    return out, lse, s_dmask, rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                               max_seqlen_k: int, dropout_p: float, softmax_scale: float,
                               causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[Tensor] = None,
                               return_softmax: bool = False,
                               block_table: Optional[Tensor] = None,
                               leftpad_k: Optional[Tensor] = None,
                               seqused_k: Optional[Tensor] = None, zero_tensors: bool = False,
                               num_splits: int = 0):
    """-> (out, softmax_lse, S_dmask, rng_state), as flash_attn 2.8's."""
    out, lse, s_dmask, rng_state = flash_attn_gpu.varlen_fwd(
        q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
        alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors,
        causal, window_size_left, window_size_right, softcap, return_softmax, None, num_splits)
    return out, lse, s_dmask, rng_state


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq: Optional[Tensor],
                         dk: Optional[Tensor], dv: Optional[Tensor], dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int,
                         window_size_right: int, softcap: float,
                         alibi_slopes: Optional[Tensor], deterministic: bool,
                         rng_state: Optional[Tensor] = None) -> Tensor:
    """Writes the gradients into dq, dk, dv; returns softmax_d (flash_attn 2.8's)."""
    *_, softmax_d = flash_attn_gpu.bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p, softmax_scale,
        causal, window_size_left, window_size_right, softcap, deterministic, None, rng_state)
    return softmax_d


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq: Optional[Tensor],
                                dk: Optional[Tensor], dv: Optional[Tensor], cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                dropout_p: float, softmax_scale: float, causal: bool,
                                window_size_left: int, window_size_right: int, softcap: float,
                                alibi_slopes: Optional[Tensor], deterministic: bool,
                                rng_state: Optional[Tensor] = None,
                                zero_tensors: bool = False) -> Tensor:
    """Writes the gradients into dq, dk, dv; returns softmax_d (flash_attn 2.8's)."""
    *_, softmax_d = flash_attn_gpu.varlen_bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
        window_size_left, window_size_right, softcap, deterministic, None, rng_state)
    return softmax_d
