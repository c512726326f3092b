"""The flash_attn 2.x interface over flashattn's custom ops (a drop-in replacement).

Same names, signatures and return conventions as flash_attn.flash_attn_interface:
a function returns ``out``, or ``(out, softmax_lse, S_dmask)`` when return_attn_probs
(flash_attn_with_kvcache: ``(out, softmax_lse)`` when return_softmax_lse). The
differences are listed in python/README.md; in short: S_dmask is the probabilities
after dropout (fp32, 0 where dropped or masked, not scaled by 1/(1-p)) on CPU tensors and
flash_attn's padded layout (exp(s - rowmax) where kept, negated where dropped, only with
dropout) on CUDA tensors; head dims that are not a multiple of 8 are zero-padded on CUDA tensors, as
flash_attn does; dropout seeds come from torch's default CPU generator;
errors are flashattn.InvalidArgumentError (a ValueError and, as flash_attn's, a
RuntimeError) / UnsupportedError.

learnable_sink (FlashAttention-4's keyword, gpt-oss's attention sinks): a [h_q] tensor,
one logit per query head that joins every row's softmax denominator and contributes no
value (lse includes it). Other float dtypes than fp32 (a bf16 model parameter) are
converted to fp32 for the call; its gradient flows back through autograd.

block_sparse_tensors (FlashAttention-4's keyword, flash_attn_func, flash_attn_qkvpacked_func,
flash_attn_kvpacked_func and flash_attn_varlen_func): a block-sparse mask, flashattn.block_sparse.BlockSparseTensorsTorch
or any object with FA4's fields mask_block_cnt, mask_block_idx, full_block_cnt,
full_block_idx, block_size (and optionally q_doc_ids, k_doc_ids, prefix_keys); the rule is in
flashattn/block_sparse.py. CPU backend and CUDA, forward and backward (CUDA: blocks holding whole tiles: 128 x 128, the default, serves every head dim; other sizes raise UnsupportedError).
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import ops
from ._C import InvalidArgumentError, UnsupportedError
from ._checks import INT32_MAX, check_int, check_rank, invalid, shape_text
from ._checks import window as _checked_window
from .rotary import rotate


# The library names an option by its C++ name (flashattn::Options, "opts.softmax_scale");
# a caller of these functions passed it as a keyword. An error about one names the keyword,
# as flash_attn's own checks do, and keeps the C++ name at the end of the message.
_KEYWORD_OF_OPTION = {
    "opts.softmax_scale": "softmax_scale",
    "opts.softcap": "softcap",
    "opts.dropout_p": "dropout_p",
    "opts.alibi_slopes": "alibi_slopes",
    "opts.window_left": "window_size[0]",
    "opts.window_right": "window_size[1]",
    "opts.qv": "qv",
    "opts.q_descale": "q_descale",
    "opts.k_descale": "k_descale",
    "opts.v_descale": "v_descale",
}


# Private switch for tests: the emulations that CUDA tensors take in this module (a
# left-padded cache as a paged one, head dims padded to a multiple of 8, S_dmask from the
# CPU backend) run on CPU tensors too, so that a machine without a GPU tests them.
_EMULATE_CUDA = False


def _cuda_path(t) -> bool:
    """Whether t (q) takes the CUDA-tensor emulations: a CUDA tensor, or _EMULATE_CUDA."""
    return isinstance(t, Tensor) and (t.device.type == "cuda" or _EMULATE_CUDA)


def _call(op, *args):
    """ops.call(op, *args), with an argument error about an option renamed to the keyword
    of the flash_attn-compatible functions (same class, function, expected and actual)."""
    try:
        return ops.call(op, *args)
    except InvalidArgumentError as e:
        argument = getattr(e, "argument", None) or ""
        keyword = _KEYWORD_OF_OPTION.get(argument)
        if argument.startswith("opts.block_sparse"):  # opts.block_sparse.mask_block_cnt, ...
            keyword = "block_sparse_tensors" + argument[len("opts.block_sparse"):]
        if keyword is None:
            raise
        renamed = type(e)(f"flashattn::{e.function}: argument '{keyword}': expected {e.expected}, got "
                          f"{e.actual} (flashattn::Options::{e.argument[len('opts.'):]} in C++)")
        renamed.function, renamed.argument = e.function, keyword
        renamed.expected, renamed.actual = e.expected, e.actual
        raise renamed.with_traceback(e.__traceback__) from None


def _scale(q: Tensor, softmax_scale: Optional[float], qv: Optional[Tensor] = None) -> float:
    """softmax_scale, or 1/sqrt(d) of q's head dim (1/sqrt(d + d_v) with qv, as
    FlashAttention-3: the score is one dot product over [q | qv] . [k | v])."""
    if softmax_scale is not None:
        return float(softmax_scale)
    d = q.shape[-1] if q.dim() > 0 else 0
    if qv is not None and isinstance(qv, Tensor) and qv.dim() > 0 and d > 0:
        d += qv.shape[-1]
    # d == 0: any value; the op refuses the head dim, naming q.
    return d ** -0.5 if d > 0 else 1.0


def _rng_state(dropout_p: float) -> Optional[Tensor]:
    """(seed, offset) for the library's Philox dropout, drawn from torch's default CPU
    generator (so torch.manual_seed reproduces it); None without dropout."""
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, 1 << 62, (2,), dtype=torch.int64)


def _sink(fn: str, learnable_sink) -> Optional[Tensor]:
    """learnable_sink for the ops: None, or the tensor in fp32 (converted, differentiably,
    from another floating dtype; the library checks shape and device)."""
    if learnable_sink is None:
        return None
    if not isinstance(learnable_sink, Tensor):
        raise invalid(fn, "learnable_sink", "a torch.Tensor [h_q] or None",
                      type(learnable_sink).__name__)
    if learnable_sink.dtype != torch.float32 and learnable_sink.is_floating_point():
        return learnable_sink.float()
    return learnable_sink


def _block_sparse(fn: str, bst) -> tuple:
    """The block-sparse op arguments of block_sparse_tensors (FA4's BlockSparseTensorsTorch
    fields, plus our q_doc_ids, k_doc_ids, prefix_keys): () for None."""
    if bst is None:
        return ()
    if not hasattr(bst, "mask_block_cnt") or not hasattr(bst, "mask_block_idx"):
        raise invalid(fn, "block_sparse_tensors",
                      "None or a BlockSparseTensorsTorch (mask_block_cnt, mask_block_idx, ...)",
                      type(bst).__name__)
    from .block_sparse import block_sizes
    try:
        bq, bk = block_sizes(getattr(bst, "block_size", None))
    except (TypeError, ValueError):
        raise invalid(fn, "block_sparse_tensors.block_size", "None, an int or (block_q, block_k)",
                      repr(getattr(bst, "block_size", None))) from None
    tensors = [getattr(bst, n, None) for n in ("mask_block_cnt", "mask_block_idx",
                                                "full_block_cnt", "full_block_idx")]
    extra = [getattr(bst, n, None) for n in ("q_doc_ids", "k_doc_ids", "prefix_keys")]
    for name, t in zip(("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx",
                        "q_doc_ids", "k_doc_ids", "prefix_keys"), tensors + extra):
        if t is not None and not isinstance(t, Tensor):
            raise invalid(fn, f"block_sparse_tensors.{name}", "a torch.Tensor (int32) or None",
                          type(t).__name__)
        if t is not None and t.dtype != torch.int32:
            raise invalid(fn, f"block_sparse_tensors.{name}", "dtype int32",
                          str(t.dtype).replace("torch.", ""))
    return (*tensors, bq, bk, *extra)


def _padded_head_dim(q, k, v, max_d: int = 512) -> int:
    """The head dim a CUDA call pads q, k, v to (as flash_attn does: the next multiple of
    8), or 0 when it does not pad: CPU tensors (any d), d already a multiple of 8, head
    dims that differ or exceed max_d (the library's error names them as they are). max_d:
    512, the CUDA kernels' largest bucket (the dense and varlen forward and backward, and
    KV-cache calls)."""
    if not _cuda_path(q) or not all(isinstance(t, Tensor) and t.dim() >= 1 for t in (q, k, v)):
        return 0
    d = q.shape[-1]
    if d % 8 == 0 or d > max_d or k.shape[-1] != d or v.shape[-1] != d:
        return 0
    return (d + 7) // 8 * 8


def _pad_last(t: Optional[Tensor], d8: int) -> Optional[Tensor]:
    """t zero-padded on its last dim to d8 (differentiable: the gradient is sliced back)."""
    if t is None:
        return None
    return torch.nn.functional.pad(t, [0, d8 - t.shape[-1]])


def _padded_inputs(q, k, v, qv=None):
    """(d8, q, k, v) of a forward: q, k, v zero-padded to d8 where _padded_head_dim pads
    (d8 = 0: as they are). A call with qv is not padded: on CUDA the MLA kernel takes d and
    d_v multiples of 8 as they are (the library's error names others)."""
    d8 = 0 if qv is not None else _padded_head_dim(q, k, v)
    if not d8:
        return 0, q, k, v
    return d8, _pad_last(q, d8), _pad_last(k, d8), _pad_last(v, d8)


def _round128(n: int) -> int:
    return (n + 127) // 128 * 128


def _fa2_s_dmask(q, k, v, rng_state, scale, causal, left, right, softcap, dropout_p, alibi,
                 sink, varlen=None, layout_max_k=None):
    """flash_attn's S_dmask for a CUDA call with dropout, from the CPU backend's debug
    probabilities of the same call (same (seed, offset), so the same Philox keep bits the
    CUDA kernels applied): fp32 [b, h_q, round128(s_q), round128(s_k)] on q's device,
    exp(s_ij - m_i) (m_i the row's largest score: P_ij / max_j P_ij) where kept, its
    negative where dropped, 0 where masked and in the padding. varlen =
    (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, seqused_q): row i
    of sequence b is its query i (FA2's varlen layout). A debug feature for small
    problems, as in flash_attn: two CPU passes over copies of q, k, v."""
    cpu = [None if t is None else t.detach().cpu() for t in (q, k, v, alibi, sink)]
    qc, kc, vc, ac, sc = cpu
    rng = rng_state.cpu()
    probs = []
    for p, r in ((float(dropout_p), rng), (0.0, None)):  # after dropout, then P itself
        if varlen is None:
            _, _, pr = ops.fwd(qc, kc, vc, ac, r, scale, causal, left, right, softcap, p,
                               False, True, sc)
        else:
            cu_q, cu_k, used_k, max_q, max_k, used_q = varlen
            _, _, pr = ops.varlen_fwd(qc, kc, vc, cu_q.cpu(), cu_k.cpu(),
                                      None if used_k is None else used_k.cpu(), ac, r, max_q,
                                      max_k, scale, causal, left, right, softcap, p, False,
                                      True, sc, None if used_q is None else used_q.cpu())
        probs.append(pr)
    kept, full = probs
    # flash_attn's encoding: exp(s_ij - m_i), m_i the running max of the key block (here
    # one block spanning the row: m_i = max_j s_ij, so exp(s_ij - m_i) = P_ij / max_j P_ij);
    # kept as is, dropped negated (-0 where P == 0); rows that see no key are 0.
    row_max = full.amax(dim=-1, keepdim=True)
    scale_rows = torch.where(row_max > 0, 1.0 / row_max, torch.zeros_like(row_max))
    s = torch.where(kept != 0, kept, -full) * scale_rows
    if varlen is None:
        b, h, s_q, s_k = s.shape
        dmask = s.new_zeros(b, h, _round128(s_q), _round128(s_k))
        dmask[:, :, :s_q, :s_k] = s
    else:
        cu_q = varlen[0].cpu().tolist()
        b, h, max_q = len(cu_q) - 1, s.shape[0], varlen[3]
        max_k = varlen[4] if layout_max_k is None else layout_max_k  # keys past it: none
        s = s[..., :max_k]
        dmask = s.new_zeros(b, h, _round128(max_q), _round128(max_k))
        for i in range(b):
            n = min(cu_q[i + 1] - cu_q[i], max_q)
            dmask[i, :, :n, :max_k] = s[:, cu_q[i]:cu_q[i] + n]
    return dmask.to(q.device)


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, fn="flashattn.flash_attn_func",
               learnable_sink=None, block_sparse_tensors=None, qv=None):
    left, right = _checked_window(fn, window_size)
    scale = _scale(q, softmax_scale, qv)  # of the true head dim, also when padded
    d8, qp, kp, vp = _padded_inputs(q, k, v, qv)
    want_probs = bool(return_attn_probs) and q.device.type == "cpu" and not _cuda_path(q)
    rng = _rng_state(dropout_p)
    bs = _block_sparse(fn, block_sparse_tensors)
    sink = _sink(fn, learnable_sink)
    out, lse, probs = _call(ops.fwd, qp, kp, vp, alibi_slopes, rng, scale, bool(causal), left,
                            right, float(softcap), float(dropout_p), bool(deterministic),
                            want_probs, sink, qv, *bs)
    if d8:
        out = out[..., :q.shape[-1]]
    if not return_attn_probs:
        return out
    if want_probs:
        return out, lse, probs
    if _cuda_path(q) and dropout_p > 0:
        return out, lse, _fa2_s_dmask(q, k, v, rng, scale, bool(causal), left, right,
                                      float(softcap), float(dropout_p), alibi_slopes, sink)
    return out, lse, None


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      deterministic, return_attn_probs, seqused_k=None,
                      fn="flashattn.flash_attn_varlen_func", learnable_sink=None,
                      seqused_q=None, block_sparse_tensors=None, qv=None, block_table=None):
    left, right = _checked_window(fn, window_size)
    max_seqlen_q = check_int(fn, "max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    max_seqlen_k = check_int(fn, "max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    layout_max_k = max_seqlen_k  # of probs / S_dmask
    k, v, cu_seqlens_k, seqused_k, max_seqlen_k = _paged_as_varlen(
        fn, q, k, v, cu_seqlens_k, seqused_k, block_table, max_seqlen_k, block_sparse_tensors)
    scale = _scale(q, softmax_scale, qv)  # of the true head dim, also when padded
    d8, qp, kp, vp = _padded_inputs(q, k, v, qv)
    want_probs = bool(return_attn_probs) and q.device.type == "cpu" and not _cuda_path(q)
    rng = _rng_state(dropout_p)
    sink = _sink(fn, learnable_sink)
    out, lse, probs = _call(ops.varlen_fwd, qp, kp, vp, cu_seqlens_q, cu_seqlens_k, seqused_k,
                            alibi_slopes, rng, int(max_seqlen_q), int(max_seqlen_k), scale,
                            bool(causal), left, right, float(softcap), float(dropout_p),
                            bool(deterministic), want_probs, sink, seqused_q, qv,
                            *_block_sparse(fn, block_sparse_tensors))
    if d8:
        out = out[..., :q.shape[-1]]
    if not return_attn_probs:
        return out
    if want_probs:
        return out, lse, probs[..., :layout_max_k]
    if _cuda_path(q) and dropout_p > 0:
        return out, lse, _fa2_s_dmask(
            q, k, v, rng, scale, bool(causal), left, right, float(softcap), float(dropout_p),
            alibi_slopes, sink, varlen=(cu_seqlens_q, cu_seqlens_k, seqused_k,
                                        int(max_seqlen_q), int(max_seqlen_k), seqused_q),
            layout_max_k=layout_max_k)
    return out, lse, None


def _paged_as_varlen(fn, q, k, v, cu_seqlens_k, seqused_k, block_table, max_seqlen_k,
                     block_sparse_tensors=None):
    """Paged varlen (flash_attn's block_table in flash_attn_varlen_func): k, v
    [num_blocks, block_size, h_k, d]; sequence i has cu_seqlens_k[i+1] - cu_seqlens_k[i]
    keys (the first seqused_k[i] when given), key j in block block_table[i][j // block_size],
    row j % block_size. Gathered (differentiably: dk, dv reach the blocks, summed where
    blocks are shared) into a packed varlen k, v with one slot of max_blocks * block_size
    rows per sequence and seqused_k = the key counts: the same keys in the same order, so
    the varlen call is exact. Returns (k, v, cu_seqlens_k, seqused_k, max_seqlen_k), the
    arguments as they are without a block_table. A block mask (block_sparse_tensors)
    addresses the keys of unpaged sequences: UnsupportedError with a block_table."""
    if block_table is None:
        return k, v, cu_seqlens_k, seqused_k, max_seqlen_k
    if block_sparse_tensors is not None:
        raise invalid(fn, "block_sparse_tensors", "None with a block_table (a block mask "
                      "addresses the keys of unpaged sequences)", "a block mask",
                      cls=UnsupportedError)
    layout = "[num_blocks, block_size, h_k, d] (paged, with block_table)"
    for name, t in (("k", k), ("v", v)):
        check_rank(fn, name, t, 4, layout)
    check_rank(fn, "block_table", block_table, 2, "[b, max_blocks_per_seq]")
    if not isinstance(cu_seqlens_k, Tensor) or cu_seqlens_k.dim() != 1 or cu_seqlens_k.numel() < 1:
        raise invalid(fn, "cu_seqlens_k", "an int32 tensor [b + 1]",
                      shape_text(cu_seqlens_k) if isinstance(cu_seqlens_k, Tensor)
                      else type(cu_seqlens_k).__name__)
    for name, t in (("k", k), ("v", v), ("block_table", block_table),
                    ("cu_seqlens_k", cu_seqlens_k)):
        if t.device != q.device:
            raise invalid(fn, name, f"a tensor on {q.device} (the device of q)",
                          f"a tensor on {t.device}")
    if block_table.dtype != torch.int32:
        raise invalid(fn, "block_table", "dtype int32", str(block_table.dtype)[6:])
    batch = cu_seqlens_k.numel() - 1
    if block_table.shape[0] != batch:
        raise invalid(fn, "block_table", f"shape[0] == {batch} (batch: cu_seqlens_k has "
                      f"b + 1 entries)", int(block_table.shape[0]))
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise invalid(fn, "v", f"shape[:3] == {tuple(k.shape[:3])} (that of k)",
                      shape_text(v))
    num_blocks, block_size = int(k.shape[0]), int(k.shape[1])
    capacity = int(block_table.shape[1]) * block_size
    lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64)
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:  # the library checks cu_seqlens_k's order and seqused_k itself
        table = block_table.cpu()
        for i, n in enumerate(lens.tolist()):
            if n < 0:
                raise invalid(fn, "cu_seqlens_k", "non-decreasing values (the key counts)",
                              f"cu_seqlens_k[{i + 1}] - cu_seqlens_k[{i}] = {n}")
            if n > min(capacity, max_seqlen_k):
                what, bound = ((f"max_blocks_per_seq * block_size = {block_table.shape[1]} * "
                                f"{block_size} of block_table and k", capacity)
                               if n > capacity else ("max_seqlen_k", max_seqlen_k))
                raise invalid(fn, "block_table" if n > capacity else "cu_seqlens_k",
                              f"cu_seqlens_k[i + 1] - cu_seqlens_k[i] <= {bound} ({what})",
                              f"cu_seqlens_k[{i + 1}] - cu_seqlens_k[{i}] = {n}")
            for blk in range((max(n, 0) + block_size - 1) // block_size):
                entry = int(table[i, blk])
                if not 0 <= entry < num_blocks:
                    raise invalid(fn, "block_table", f"used entries in [0, {num_blocks}) "
                                  f"(num_blocks = k.shape[0])",
                                  f"block_table[{i}][{blk}] = {entry}")
    ids = block_table.to(torch.int64).clamp(0, max(num_blocks - 1, 0))  # unused: never read
    rows = (ids[:, :, None] * block_size
            + torch.arange(block_size, device=q.device)[None, None, :]).reshape(-1)
    k = k.flatten(0, 1).index_select(0, rows)
    v = v.flatten(0, 1).index_select(0, rows)
    used = lens.clamp(0, capacity)
    if seqused_k is not None:
        used = torch.minimum(used, seqused_k.to(torch.int64))
    cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * capacity
    return k, v, cu, used.to(torch.int32), capacity


def _check_packed(fn, name, t, rank, dim, count, layout):
    check_rank(fn, name, t, rank, layout)
    if t.shape[dim] != count:
        raise invalid(fn, name, f"shape[{dim}] == {count} (layout {layout})",
                      f"{int(t.shape[dim])} (shape {shape_text(t)})")


def _fp8_requested(q, descales) -> bool:
    return getattr(q, "dtype", None) == torch.float8_e4m3fn or any(
        d is not None for d in descales)


def _fp8_unsupported(fn, q, **options):
    """fp8 calls take no qv (the library declines it too; FlashAttention-3 has no fp8 qv):
    an UnsupportedError naming the first such option given."""
    for name, (value, default) in options.items():
        if (value is not None) if default is None else (float(value) != default):
            raise invalid(fn, name, f"{default!r} with float8_e4m3fn q, k, v (the fp8 forward "
                          "has no such option, as in FlashAttention-3)", repr(value)
                          if not isinstance(value, Tensor) else f"a tensor of shape "
                          f"{shape_text(value)}", cls=UnsupportedError)


def _fp8_out_dtype(fn, q, out_dtype):
    if q.dtype != torch.float8_e4m3fn:
        return q.dtype  # the library names the descale given without fp8 inputs
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise invalid(fn, "out_dtype", "torch.bfloat16 or torch.float16", repr(out_dtype))
    return out_dtype


def _fp8_attention(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs, learnable_sink, block_sparse_tensors,
                   descales, out_dtype):
    """flash_attn_func with fp8 q, k, v: the library's fp8 forward on q's device: the CPU
    backend, with dropout (seed from torch's default CPU generator, as the 16-bit path), the
    debug probabilities and block masks computed on the dequantized values; or, for CUDA
    tensors, the sm90 fp8 kernel (no dropout or block mask: UnsupportedError naming the
    keyword; return_attn_probs gives S_dmask None there, as a 16-bit CUDA call without
    dropout). The descales reach the library contiguous (ops._descale)."""
    left, right = _checked_window(fn, window_size)
    out_dtype = _fp8_out_dtype(fn, q, out_dtype)
    want_probs = bool(return_attn_probs) and q.device.type == "cpu"
    out, lse, probs = _call(ops.fwd_fp8, q, k, v, *descales, alibi_slopes,
                            _sink(fn, learnable_sink), _scale(q, softmax_scale), bool(causal),
                            left, right, float(softcap), out_dtype, _rng_state(dropout_p),
                            float(dropout_p), want_probs,
                            *_block_sparse(fn, block_sparse_tensors))
    if not return_attn_probs:
        return out
    return out, lse, probs if want_probs else None


def _fp8_varlen_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          return_attn_probs, block_table, learnable_sink, seqused_q, seqused_k,
                          block_sparse_tensors, descales, out_dtype):
    """flash_attn_varlen_func with fp8 q, k, v: as _fp8_attention, with seqused_q / seqused_k
    and a block_table (the blocks gathered as bytes into a packed k, v: exact for fp8, the
    descales are per sequence whatever block holds a key)."""
    left, right = _checked_window(fn, window_size)
    max_seqlen_q = check_int(fn, "max_seqlen_q", max_seqlen_q, 0, INT32_MAX)
    max_seqlen_k = check_int(fn, "max_seqlen_k", max_seqlen_k, 0, INT32_MAX)
    layout_max_k = max_seqlen_k  # of probs
    k, v, cu_seqlens_k, seqused_k, max_seqlen_k = _paged_as_varlen(
        fn, q, k, v, cu_seqlens_k, seqused_k, block_table, max_seqlen_k, block_sparse_tensors)
    out_dtype = _fp8_out_dtype(fn, q, out_dtype)
    want_probs = bool(return_attn_probs) and q.device.type == "cpu"
    out, lse, probs = _call(ops.varlen_fwd_fp8, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                            max_seqlen_q, max_seqlen_k, *descales, alibi_slopes,
                            _sink(fn, learnable_sink), _scale(q, softmax_scale), bool(causal),
                            left, right, float(softcap), out_dtype, _rng_state(dropout_p),
                            float(dropout_p), want_probs, seqused_q,
                            *_block_sparse(fn, block_sparse_tensors))
    if not return_attn_probs:
        return out
    return out, lse, probs[..., :layout_max_k] if want_probs else None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, learnable_sink=None, block_sparse_tensors=None,
                    qv=None, q_descale=None, k_descale=None, v_descale=None,
                    out_dtype=torch.bfloat16):
    """q [b, s_q, h_q, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v] (h_q % h_k == 0; d_v may
    differ from d, as in FlashAttention-3) -> out [b, s_q, h_q, d_v].

    causal and window_size (left, right) are bottom-right aligned: query i sees key j when
    i + s_k - s_q - left <= j <= i + s_k - s_q + right (-1 = unbounded). alibi_slopes:
    fp32 [h_q] or [b, h_q]. softmax_lse: [b, h_q, s_q] fp32. learnable_sink: [h_q] sink
    logits (FlashAttention-4), differentiable. qv [b, s_q, h_q, d_v] (FlashAttention-3's,
    MLA): scores softmax_scale * (q . k + qv . v), default scale 1/sqrt(d + d_v); forward
    only (differentiating such a call raises UnsupportedError naming qv). CUDA tensors run
    the MLA kernel: float16 / bfloat16, d <= 64 and d_v <= 512, multiples of 8, no dropout
    (else UnsupportedError naming the argument).

    fp8 (FlashAttention-3's): q, k, v of dtype torch.float8_e4m3fn with q_descale,
    k_descale, v_descale fp32 [b, h_k] (None = 1; an element's value is float(e4m3) *
    descale[b, its KV head], q's by the KV head of its query head's group) -> out in
    out_dtype (torch.bfloat16, FlashAttention-3's, or torch.float16); softmax_lse fp32.
    Forward only (no autograd), no qv (UnsupportedError naming qv); dropout (seeded from
    torch's default CPU generator, as the 16-bit path), return_attn_probs (S_dmask as on
    CPU tensors: fp32 probabilities after dropout) and block_sparse_tensors apply to the
    dequantized values on CPU tensors. CUDA tensors run the sm90 (Hopper) fp8 kernel (other
    GPUs: UnsupportedError), without dropout or block_sparse_tensors (UnsupportedError naming
    them) and with S_dmask None under return_attn_probs.
    """
    fn = "flashattn.flash_attn_func"
    if _fp8_requested(q, (q_descale, k_descale, v_descale)):
        _fp8_unsupported(fn, q, qv=(qv, None))
        return _fp8_attention(fn, q, k, v, dropout_p, softmax_scale, causal, window_size,
                              softcap, alibi_slopes, return_attn_probs, learnable_sink,
                              block_sparse_tensors, (q_descale, k_descale, v_descale),
                              out_dtype)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs,
                      learnable_sink=learnable_sink, block_sparse_tensors=block_sparse_tensors,
                      qv=qv)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, block_sparse_tensors=None):
    """qkv [b, s, 3, h, d] -> out [b, s, h, d]. The gradient of qkv is assembled by
    autograd from dq, dk, dv (the library writes them to separate tensors)."""
    fn = "flashattn.flash_attn_qkvpacked_func"
    _check_packed(fn, "qkv", qkv, 5, 2, 3, "[b, s, 3, h, d]")
    q, k, v = qkv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, fn, learnable_sink,
                      block_sparse_tensors)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, block_sparse_tensors=None):
    """q [b, s_q, h_q, d], kv [b, s_k, 2, h_k, d] -> out [b, s_q, h_q, d]."""
    fn = "flashattn.flash_attn_kvpacked_func"
    _check_packed(fn, "kv", kv, 5, 2, 2, "[b, s_k, 2, h_k, d]")
    k, v = kv.unbind(dim=2)
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, deterministic, return_attn_probs, fn, learnable_sink,
                      block_sparse_tensors)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           learnable_sink=None, seqused_q=None, seqused_k=None,
                           block_sparse_tensors=None, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, out_dtype=torch.bfloat16):
    """q [total_q, h_q, d], k [total_k, h_k, d], v [total_k, h_k, d_v], cu_seqlens_q/_k int32
    [b + 1] -> out [total_q, h_q, d_v] (qv [total_q, h_q, d_v]: as flash_attn_func's);
    softmax_lse [h_q, total_q] fp32. block_table (paged KV, flash_attn's): k, v
    [num_blocks, block_size, h_k, d], int32 [b, max_blocks_per_seq]; key j of sequence i is
    row j % block_size of block block_table[i][j // block_size], and cu_seqlens_k still
    gives the key counts (the blocks are gathered into a packed k, v, so every feature, the
    backward included, works; dk, dv reach the blocks). seqused_q / seqused_k (int32 [b],
    FlashAttention-4's names): only the first seqused_q[b] queries / seqused_k[b] keys of
    sequence b are used; query rows past seqused_q[b] get out 0 (lse -inf), on every
    backend. block_sparse_tensors: a block-sparse mask over each sequence's
    max_seqlen_q x max_seqlen_k grid (positions within the sequence; doc ids packed
    [total_q], [total_k]); not with a block_table. fp8 (q, k, v torch.float8_e4m3fn with
    q_descale / k_descale / v_descale fp32 [b, h_k], out_dtype): as flash_attn_func's, with
    seqused_q / seqused_k, block_sparse_tensors, and a block_table (the fp8 blocks are
    gathered as bytes; descales stay per sequence whatever block holds a key); CUDA tensors
    as flash_attn_func's (the sm90 fp8 kernel; no dropout or block_sparse_tensors)."""
    fn = "flashattn.flash_attn_varlen_func"
    if _fp8_requested(q, (q_descale, k_descale, v_descale)):
        _fp8_unsupported(fn, q, qv=(qv, None))
        return _fp8_varlen_attention(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, dropout_p, softmax_scale, causal,
                                     window_size, softcap, alibi_slopes, return_attn_probs,
                                     block_table, learnable_sink, seqused_q, seqused_k,
                                     block_sparse_tensors, (q_descale, k_descale, v_descale),
                                     out_dtype)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, seqused_k=seqused_k,
                             learnable_sink=learnable_sink, seqused_q=seqused_q,
                             block_sparse_tensors=block_sparse_tensors, qv=qv,
                             block_table=block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None):
    """qkv [total, 3, h, d], cu_seqlens int32 [b + 1] -> out [total, h, d]."""
    fn = "flashattn.flash_attn_varlen_qkvpacked_func"
    _check_packed(fn, "qkv", qkv, 4, 1, 3, "[total, 3, h, d]")
    max_seqlen = check_int(fn, "max_seqlen", max_seqlen, 0, INT32_MAX)
    q, k, v = qkv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, fn=fn,
                             learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None):
    """q [total_q, h_q, d], kv [total_k, 2, h_k, d] -> out [total_q, h_q, d]."""
    fn = "flashattn.flash_attn_varlen_kvpacked_func"
    _check_packed(fn, "kv", kv, 4, 1, 2, "[total_k, 2, h_k, d]")
    k, v = kv.unbind(dim=1)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             dropout_p, softmax_scale, causal, window_size, softcap,
                             alibi_slopes, deterministic, return_attn_probs, fn=fn,
                             learnable_sink=learnable_sink)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens: Optional[Union[int, Tensor]] = None,
                            cache_batch_idx: Optional[Tensor] = None,
                            cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_scale=None, v_scale=None,
                            tree_mask=None, learnable_sink=None, qv=None, q_descale=None,
                            k_descale=None, v_descale=None, out_dtype=torch.bfloat16):
    """Attention of q [b, s_q, h_q, d] against a KV cache, flash_attn's decoding call.

    k_cache, v_cache: [b_cache, s_cache, h_k, d], or [num_blocks, block_size, h_k, d] with
    block_table int32 [b, max_blocks_per_seq] (paged); v_cache (and v, and out) may have
    another head dim d_v, as in FlashAttention-3. k, v [b, s_new, h_k, d] (optional)
    are written into the caches in place at cache_seqlens .. cache_seqlens + s_new - 1
    first; cache_seqlens (int or int32 [b]) is not advanced. Sequence i attends to
    cache_seqlens[i] + s_new keys.

    cache_leftpad (int32 [b], dense caches): sequence i's cached keys are rows
    cache_leftpad[i] .. cache_seqlens[i] - 1 of its cache row (the rows before are never
    read); it attends to cache_seqlens[i] + s_new - cache_leftpad[i] keys, with causal /
    window / ALiBi aligned to that count (flash_attn's semantics). CPU tensors run the
    library's cache_leftpad; CUDA tensors run the same keys as a paged cache of block size
    1 (exact; the cache's first two dimensions must be one strided dimension).

    rotary_cos/rotary_sin [seqlen_ro, rotary_dim / 2] (with k and v): the new keys are
    rotated at positions cache_seqlens + t, and q at cache_seqlens + t when causal or
    windowed, else at cache_seqlens for every query (flash_attn's rule); done in torch
    before the call, so the cache receives the rotated keys.

    fp8 cache (flashattn's extension): k_cache, v_cache of dtype torch.float8_e4m3fn with
    fp32 k_scale, v_scale of shape [h_k] (per KV head) or [k_cache.shape[0], h_k] (per
    block / cache row and KV head); a cached element means float(e4m3) * scale, and the
    appended k, v (q's dtype) are stored as e4m3(x / scale), round to nearest even,
    saturating at +-448.

    fp8 q (FlashAttention-3's call): q, k_cache, v_cache (and k, v) of dtype
    torch.float8_e4m3fn with q_descale, k_descale, v_descale fp32 [b, h_k] (None = 1), one
    per (sequence, KV head): q's element means float(e4m3) * q_descale[b, KV head of its
    query head], a cached key or value of sequence b float(e4m3) * k_descale[b, g] /
    v_descale[b, g] whatever block or cache row holds it; k, v are appended as bytes.
    out in out_dtype (torch.bfloat16, FlashAttention-3's, or torch.float16); lse fp32. Not
    with k_scale / v_scale (those are for an fp8 cache under 16-bit q), rotary_cos /
    rotary_sin (rotate before quantizing) or qv. CPU tensors run on the CPU backend, CUDA
    tensors in the decode kernel (every sm80+ GPU; head dims d % 8 == 0 up to 512, d_v == d:
    UnsupportedError naming the argument otherwise; cache_leftpad as for 16-bit q, the same
    keys as a paged cache of block size 1).

    tree_mask (speculative decoding): int32 [b, s_q, ceil(s_q / 32)]; the last s_q keys
    of each sequence are the draft tokens and query i sees draft t only when bit t % 32 of
    tree_mask[b, i, t // 32] is set (and-ed with causal / window_size).

    learnable_sink: [h_q] sink logits (gpt-oss), in every row's denominator.

    qv (keyword, FlashAttention-3's qv, multi-head latent attention decode): [b, s_q, h_q,
    d_v] in q's dtype; each score becomes softmax_scale * (q . k + qv . v), so that one
    latent cache (v_cache, d_v = 512 in DeepSeek) serves the score and the value while
    k_cache holds the rope part (d = 64); many query heads over h_k = 1. The default
    softmax_scale is then 1/sqrt(d + d_v). Inference only (no gradient). CUDA tensors run
    the MLA kernel (any GPU from sm80 with 160 KB of shared memory per block: A100, H100,
    H200): float16 / bfloat16 caches (not float8_e4m3fn), d <= 64 and d_v <= 512, multiples
    of 8, dense or paged, with appends, splits, causal / window, softcap, ALiBi and sinks;
    no tree_mask (else UnsupportedError naming the argument).

    Head dims that are not a multiple of 8 on CUDA tensors: q, k, v and zero-padded
    copies of the caches run at the next multiple of 8 (scale of the true d); the caches
    are copied back after an append (the whole cache, as flash_attn does).
    """
    fn = "flashattn.flash_attn_with_kvcache"
    if (k is None) != (v is None):
        raise invalid(fn, "v" if v is None else "k", "k and v given together (or neither)",
                      "only " + ("k" if v is None else "v"))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                    ("qv", qv)):
        check_rank(fn, name, t, 4, "[b, s, h, d]")
    check_rank(fn, "block_table", block_table, 2, "[b, max_blocks_per_seq]")
    fp8 = _fp8_requested(q, (q_descale, k_descale, v_descale))
    if fp8:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if t is not None:
                raise invalid(fn, name, "None with float8_e4m3fn q (rotate q and k before "
                              "quantizing them to fp8)", f"a tensor of shape {shape_text(t)}",
                              cls=UnsupportedError)
        out_dtype = _fp8_out_dtype(fn, q, out_dtype)
        if q.dtype != torch.float8_e4m3fn:
            out_dtype = None  # descales without fp8 q: the library names the descale
    else:
        out_dtype = None
    if (isinstance(qv, Tensor) and qv.requires_grad and torch.is_grad_enabled()):
        # kvcache_fwd has no backward; for qv say so before the call (FlashAttention-3's qv
        # has no backward either).
        raise invalid(fn, "qv", "a tensor that does not require grad (qv has no backward, as "
                      "in FlashAttention-3; call under torch.no_grad() or detach it)",
                      "a tensor with requires_grad=True", cls=UnsupportedError)
    batch = q.shape[0]
    if cache_seqlens is None:
        if k is not None:
            raise invalid(fn, "cache_seqlens", "a tensor or int when k and v are appended",
                          "None")
        capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                    else k_cache.shape[1])
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif not isinstance(cache_seqlens, Tensor):
        cache_seqlens = check_int(fn, "cache_seqlens", cache_seqlens, 0, INT32_MAX)
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = _checked_window(fn, window_size)

    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None or k is None:
            missing = [n for n, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                                      ("k", k)) if t is None]
            raise invalid(fn, missing[0], "rotary_cos, rotary_sin, k and v given together "
                          "(rotary embeddings rotate the new keys)", "None")
        _check_rotary(fn, q, k_cache, block_table, rotary_cos, rotary_sin)
        base = cache_seqlens.to(torch.long)[:, None]
        k_pos = base + torch.arange(k.shape[1], device=q.device)[None, :]
        if causal or (left, right) != (-1, -1):
            q_pos = base + torch.arange(q.shape[1], device=q.device)[None, :]
        else:
            q_pos = base.expand(batch, q.shape[1])
        q = rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        k = rotate(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)

    scale = _scale(q, softmax_scale, qv)  # of the true head dim, also when padded
    d = q.shape[-1]
    # fp8 q goes unpadded: on CUDA tensors the library declines a head dim that is not a
    # multiple of 8 naming q.
    d8 = 0 if qv is not None or fp8 else _padded_head_dim(q, k_cache, v_cache)
    if d8 and k is not None and (k.shape[-1] != d or v.shape[-1] != d):
        d8 = 0  # the library names the mismatch
    if d8:
        # As flash_attn: q, k, v and padded copies of the caches go to the kernels; the
        # caches are copied back after the append (the whole cache, as flash_attn does).
        cache_og = (k_cache, v_cache)
        q, k, v = _pad_last(q, d8), _pad_last(k, d8), _pad_last(v, d8)
        k_cache, v_cache = _padded_copy(k_cache, d8), _padded_copy(v_cache, d8)
        cache_padded = (k_cache, v_cache)
    if cache_leftpad is not None and block_table is None and _cuda_path(q):
        # The CUDA kernels have no left padding: the same keys as a paged cache of block
        # size 1 (one block per cache row slot, sequence i's table starting at its row's
        # slot cache_leftpad[i]), which they run exactly. Rotary positions above stay the
        # absolute cache rows, as flash_attn's.
        (k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_scale,
         v_scale) = _leftpad_as_paged(fn, q, k_cache, v_cache, cache_seqlens, cache_leftpad,
                                      cache_batch_idx, k, k_scale, v_scale)
        cache_leftpad = None
    out, lse = _call(ops.kvcache_fwd, q, k_cache, v_cache, cache_seqlens, block_table,
                        cache_batch_idx, k, v, alibi_slopes, scale,
                        bool(causal), left, right, float(softcap), int(num_splits), k_scale,
                        v_scale, tree_mask, _sink(fn, learnable_sink), qv, cache_leftpad,
                        q_descale, k_descale, v_descale, out_dtype)
    if d8:
        out = out[..., :d]
        if k is not None:
            for og, padded in zip(cache_og, cache_padded):
                og.copy_(padded[..., :d])
    return (out, lse) if return_softmax_lse else out


def _padded_copy(cache: Tensor, d8: int) -> Tensor:
    """A zero-padded contiguous copy of a KV cache with head dim d8 (any dtype, fp8 too)."""
    padded = torch.zeros(cache.shape[:-1] + (d8,), dtype=cache.dtype, device=cache.device)
    padded[..., : cache.shape[-1]].copy_(cache)
    return padded


def _leftpad_as_paged(fn, q, k_cache, v_cache, cache_seqlens, cache_leftpad, cache_batch_idx,
                      k_new, k_scale, v_scale):
    """A dense left-padded cache [b_cache, s_cache, h_k, d] as a paged cache of block size
    1 over the same memory: block r * s_cache + t is row t of cache row r; sequence i's
    table starts at cache_leftpad[i] of its row and holds cache_seqlens[i] - cache_leftpad[i]
    cached keys (so its key j is row cache_leftpad[i] + j, and the append still lands at row
    cache_seqlens[i]). Checks what the library would check of cache_leftpad (and of the
    lengths, which a block table no longer bounds) with the library's messages."""
    batch = q.shape[0]
    if not isinstance(cache_leftpad, Tensor):
        raise invalid(fn, "cache_leftpad", "a torch.Tensor int32 [b] or None",
                      type(cache_leftpad).__name__)
    if cache_leftpad.dtype != torch.int32:
        raise invalid(fn, "cache_leftpad", "dtype int32", str(cache_leftpad.dtype)[6:])
    if tuple(cache_leftpad.shape) != (batch,):
        raise invalid(fn, "cache_leftpad", f"shape [{batch}] ([b])", shape_text(cache_leftpad))
    if cache_leftpad.device != q.device:
        raise invalid(fn, "cache_leftpad", f"a tensor on {q.device} (the device of q)",
                      f"a tensor on {cache_leftpad.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
            raise UnsupportedError(
                f"{fn}: argument '{name}': expected stride[0] == shape[1] * stride[1] (a "
                f"left-padded cache on CUDA is read as a paged cache of block size 1), got "
                f"stride {tuple(t.stride())} for shape {shape_text(t)}")
    rows_total, s_cache = int(k_cache.shape[0]), int(k_cache.shape[1])
    s_new = 0 if k_new is None else int(k_new.shape[1])
    rows = (torch.arange(batch, device=q.device, dtype=torch.int64) if cache_batch_idx is None
            else cache_batch_idx.to(torch.int64))
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:  # under graph capture the library's device-side checks see the table
        lp, sl = cache_leftpad.tolist(), cache_seqlens.tolist()
        for i in range(batch):
            if not 0 <= lp[i] <= sl[i]:
                raise invalid("flashattn::kvcache_fwd", "cache_leftpad",
                              f"values in [0, cache_seqlens[i]] (cache_seqlens[{i}] = {sl[i]})",
                              f"cache_leftpad[{i}] = {lp[i]}")
            if sl[i] + s_new > s_cache:
                raise invalid("flashattn::kvcache_fwd", "cache_seqlens",
                              f"cache_seqlens[i] + s_new <= {s_cache} (s_cache = "
                              f"k_cache.shape[1])", f"cache_seqlens[{i}] + {s_new} = "
                              f"{sl[i] + s_new}")
        if cache_batch_idx is not None:
            for i, r in enumerate(cache_batch_idx.tolist()):
                if not 0 <= r < rows_total:
                    raise invalid("flashattn::kvcache_fwd", "cache_batch_idx",
                                  f"values in [0, {rows_total}) (b_cache = k_cache.shape[0])",
                                  f"cache_batch_idx[{i}] = {r}")
    t = torch.arange(s_cache, device=q.device, dtype=torch.int64)
    slot = cache_leftpad.to(torch.int64)[:, None] + t[None, :]
    # Slots past the row's end are never used (cache_seqlens + s_new <= s_cache): -1.
    table = torch.where(slot < s_cache, rows[:, None] * s_cache + slot, -1)

    def paged(c):
        st = c.stride()
        step = st[1] if s_cache > 1 else st[0]  # from one slot to the next
        return c.as_strided((rows_total * s_cache, 1, c.shape[2], c.shape[3]),
                            (step, step, st[2], st[3]), c.storage_offset())

    def per_slot(scale):  # per-(cache row, head) scales become per-(slot, head)
        if scale is None or scale.dim() != 2:
            return scale
        return scale.repeat_interleave(s_cache, dim=0)

    return (paged(k_cache), paged(v_cache), (cache_seqlens - cache_leftpad).to(torch.int32),
            table.to(torch.int32).contiguous(), None, per_slot(k_scale), per_slot(v_scale))


def _check_rotary(fn, q, k_cache, block_table, cos, sin):
    """flash_attn's rules: cos, sin [seqlen_ro, rotary_dim / 2] of one shape, rotary_dim
    <= head dim, and seqlen_ro at least the cache's sequence capacity (so every position a
    call can rotate at is a row)."""
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_rank(fn, name, t, 2, "[seqlen_ro, rotary_dim / 2]")
        if t.device != q.device:
            raise invalid(fn, name, f"a tensor on {q.device} (the device of q)",
                          f"a tensor on {t.device}")
    if sin.shape != cos.shape:
        raise invalid(fn, "rotary_sin", f"shape {shape_text(cos)} (the shape of rotary_cos)",
                      shape_text(sin))
    d = q.shape[-1]
    if 2 * cos.shape[1] > d:
        raise invalid(fn, "rotary_cos", f"shape[1] <= {d // 2} (rotary_dim / 2 <= head dim / 2)",
                      int(cos.shape[1]))
    capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                else k_cache.shape[1])
    what = ("max_blocks_per_seq * block_size" if block_table is not None
            else "k_cache.shape[1]")
    if cos.shape[0] < capacity:
        raise invalid(fn, "rotary_cos",
                      f"shape[0] >= {capacity} (a row per cache position, {what})",
                      int(cos.shape[0]))


def apply_rotary_emb(x, cos, sin, interleaved=False, seqlen_offsets=0):
    """See flashattn.rotary.apply_rotary_emb."""
    from .rotary import apply_rotary_emb as impl

    return impl(x, cos, sin, interleaved, seqlen_offsets)
