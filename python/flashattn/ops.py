"""torch.library custom ops over flashattn._C.

    flashattn::fwd, flashattn::bwd                 dense batches
    flashattn::varlen_fwd, flashattn::varlen_bwd   packed variable-length sequences
    flashattn::kvcache_fwd                         KV cache (mutates k_cache, v_cache)

Each op has a fake (shape) implementation for torch.compile and the forward ops have
autograd formulas, so the ops compose with torch.compile(fullgraph=True), torch.func and
CUDA graphs. Tensors reach the C++ library through DLPack (detached views: no copies
unless a layout needs one, see _prepare), as capsules made by torch's C exporter (see _dl);
the CUDA stream is torch's current stream.

call(op, *args) is what the torch layer (flashattn.interface, the autograd formulas)
uses: the op's implementation called directly where torch's dispatcher would add nothing
(no autograd to record, no torch.compile / tracing, no mode, transform, tensor subclass
or profiler), else the op; the same outputs and errors, some 15-20 us less per call.

Head dims: v (and out, dout, dv) may have another head dim d_v than q and k (d), as in
FlashAttention-3 (DeepSeek-V3's (192, 128)); the outputs' shapes follow v. fwd, varlen_fwd
and kvcache_fwd take an optional qv (q's shape with d_v; MLA, FlashAttention-3's qv: each
score is scale * (q . k + qv . v)) as their last argument; it has no backward: the autograd
formulas of fwd and varlen_fwd raise UnsupportedError naming qv (kvcache_fwd has none).

Learnable sinks (FlashAttention-4's learnable_sink): the forward ops take an optional
fp32 [h_q] learnable_sink as their last argument; the backward ops take it too and return
its gradient d sink (fp32 [h_q], or an empty [0] tensor without a sink) after dq, dk, dv.

Block-sparse masks (FlashAttention-4's BlockSparseTensors): the dense ops fwd and bwd take,
after learnable_sink (and fwd after qv), mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx (int32,
optional), block_size_q, block_size_k (ints, default 128), q_doc_ids, k_doc_ids and
prefix_keys (int32, optional): flashattn::BlockSparseTensors (CPU; the forward on CUDA); the
varlen ops take the same after seqused_q (varlen_fwd after qv; doc ids packed [total_q], [total_k]). They carry
no gradient.

Dropout: rng_state is an int64 CPU tensor [2] = (seed, offset) for the library's Philox
generator (drawn by the caller from torch's default CPU generator); the forward's
autograd formula hands the same tensor to the backward, which recomputes the same mask.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._C import UnsupportedError
from ._checks import check_device, check_devices, check_head_dim, check_rank, invalid

_U64 = (1 << 64) - 1


# The raw cudaStream_t of torch's current stream on a device (what
# torch.cuda.current_stream(device).cuda_stream is, without building a Stream object).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(t: Tensor) -> int:
    if t.is_cuda:
        if _raw_stream is not None:
            return _raw_stream(t.get_device())
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


_to_dlpack = torch.utils.dlpack.to_dlpack


def _dl(t):
    """t for the binding: a DLPack capsule from torch's C exporter. Given the tensor,
    nanobind calls Tensor.__dlpack__, a Python method (about 2 us per tensor on the CPU,
    more on CUDA, where it also queries the current device). A tensor the exporter
    refuses goes as it is, so that the binding reports it as before; None stays None."""
    if t is None:
        return None
    try:
        return _to_dlpack(t)
    except Exception:
        return t


def _prepare(t: Optional[Tensor]) -> Optional[Tensor]:
    """A detached view the library accepts: contiguous last dimension and, on CUDA,
    16-byte aligned data and rows (strides multiple of 8 elements). Copies otherwise."""
    if t is None:
        return None
    if t.requires_grad:  # (a tensor that needs none is already the view: no new object)
        t = t.detach()
    if t.dim() == 0:
        return t
    ok = t.stride(-1) == 1
    if ok and t.is_cuda:
        # 16-byte rows: outer strides a multiple of 8 elements (16 for the 1-byte fp8). A
        # contiguous tensor whose last dimension is such a multiple has every outer stride
        # one: only the address is left to check.
        m = 16 if t.element_size() == 1 else 8
        ok = t.data_ptr() % 16 == 0 and (
            (t.shape[-1] % m == 0 and t.is_contiguous())
            or all(st % m == 0 for st, sz in zip(t.stride()[:-1], t.shape[:-1]) if sz > 1)
        )
    if ok:
        return t
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    fresh.copy_(t)
    return fresh


def _detached(t: Tensor) -> Tensor:
    """t, detached when it requires grad (no copy)."""
    return t.detach() if t.requires_grad else t


def _arg(t: Optional[Tensor]):
    """An optional tensor argument for the binding: None, or _dl(_prepare(t))."""
    return None if t is None else _dl(_prepare(t))


def _options(
    q: Tensor,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    learnable_sink: Optional[Tensor] = None,
    learnable_sink_grad: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    block_sparse: tuple = (),
) -> dict:
    seed = offset = 0
    if dropout_p > 0.0:
        if rng_state is None:
            raise ValueError("flashattn: dropout_p > 0 needs rng_state (int64 [seed, offset])")
        seed, offset = (int(x) & _U64 for x in rng_state.tolist())
    return dict(
        softmax_scale=softmax_scale,
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        alibi_slopes=_dl(_prepare(alibi_slopes)),
        dropout_p=dropout_p,
        seed=seed,
        offset=offset,
        deterministic=deterministic,
        stream=_stream(q),
        learnable_sink=_dl(_prepare(learnable_sink)),
        learnable_sink_grad=_dl(learnable_sink_grad),
        qv=_dl(_prepare(qv)),
        **_block_sparse_kwargs(block_sparse),
    )


_BS_TENSORS = ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx")
_BS_EXTRA = ("q_doc_ids", "k_doc_ids", "prefix_keys")


def _block_sparse_kwargs(bs: tuple) -> dict:
    """The binding's keywords of the block-sparse op arguments (mask_block_cnt, mask_block_idx,
    full_block_cnt, full_block_idx, block_size_q, block_size_k, q_doc_ids, k_doc_ids,
    prefix_keys), as the ops take them; () = none."""
    if not bs or all(t is None for t in bs[:4]) and all(t is None for t in bs[6:]):
        return {}
    cnt, idx, fcnt, fidx, bq, bk, dq, dk, pre = bs
    return dict(mask_block_cnt=_dl(_prepare(cnt)), mask_block_idx=_dl(_prepare(idx)),
                full_block_cnt=_dl(_prepare(fcnt)), full_block_idx=_dl(_prepare(fidx)),
                block_size_q=int(bq), block_size_k=int(bk), q_doc_ids=_dl(_prepare(dq)),
                k_doc_ids=_dl(_prepare(dk)), prefix_keys=_dl(_prepare(pre)))


# Checks shared by each op and its fake implementation: the ranks the outputs' shapes are
# read from, a nonzero head dim, and one device for every tensor (rng_state excepted: a
# CPU tensor by design). The library checks everything else.
_DENSE = "[b, s, h, d]"
_PACKED = "[total, h, d]"


def _bs_devices(bs: tuple) -> dict:
    if not bs:
        return {}
    names = _BS_TENSORS + ("block_size_q", "block_size_k") + _BS_EXTRA
    return {n: t for n, t in zip(names, bs) if n.startswith(("mask", "full")) or n in _BS_EXTRA}


def _check_fwd(q, k, v, alibi_slopes, learnable_sink=None, qv=None, bs=()):
    fn = "flashattn::fwd"
    for name, t in (("q", q), ("k", k), ("v", v), ("qv", qv)):
        check_rank(fn, name, t, 4, _DENSE)
    check_head_dim(fn, "q", q)
    check_head_dim(fn, "v", v)
    check_device(fn, q, k=k, v=v, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                 qv=qv, **_bs_devices(bs))


def _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink=None, bs=()):
    fn = "flashattn::bwd"
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        check_rank(fn, name, t, 4, _DENSE)
    check_rank(fn, "lse", lse, 3, "[b, h_q, s_q]")
    check_head_dim(fn, "q", q)
    check_head_dim(fn, "v", v)
    check_device(fn, q, dout=dout, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes,
                 learnable_sink=learnable_sink, **_bs_devices(bs))


def _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, **more):
    for name, t in (("q", q), ("k", k), ("v", v), ("qv", more.get("qv"))):
        check_rank(fn, name, t, 3, _PACKED)
    check_head_dim(fn, "q", q)
    check_head_dim(fn, "v", v)
    check_device(fn, q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, alibi_slopes=alibi_slopes, **more)


def _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink=None,
                   qv=None, cache_leftpad=None, q_descale=None, k_descale=None,
                   v_descale=None):
    fn = "flashattn::kvcache_fwd"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new), ("qv", qv)):
        check_rank(fn, name, t, 4, _DENSE)
    check_head_dim(fn, "q", q)
    check_head_dim(fn, "v_cache", v_cache)
    check_devices(fn, q, (("k_cache", k_cache), ("v_cache", v_cache),
                          ("cache_seqlens", cache_seqlens), ("block_table", block_table),
                          ("cache_batch_idx", cache_batch_idx), ("k_new", k_new),
                          ("v_new", v_new), ("alibi_slopes", alibi_slopes), ("k_scale", k_scale),
                          ("v_scale", v_scale), ("tree_mask", tree_mask),
                          ("learnable_sink", learnable_sink), ("qv", qv),
                          ("cache_leftpad", cache_leftpad), ("q_descale", q_descale),
                          ("k_descale", k_descale), ("v_descale", v_descale)))


def _sink_grad_output(q: Tensor, h_q: int, learnable_sink: Optional[Tensor]) -> Tensor:
    """The backward's d sink output: fp32 [h_q] with a sink, else an empty [0] tensor."""
    return _empty((h_q,) if learnable_sink is not None else (0,), q, torch.float32)


def _empty(shape, like: Tensor, dtype=None) -> Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _with_head_dim(q: Tensor, v: Tensor) -> Tensor:
    """The output for q's rows and heads with v's head dim d_v (q's shape when d_v == d)."""
    if v.shape[-1] == q.shape[-1]:
        return _like(q)
    return _empty(tuple(q.shape[:-1]) + (v.shape[-1],), q)


def _like(t: Tensor) -> Tensor:
    """torch.empty(t.shape, dtype=t.dtype, device=t.device), in half the time."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- direct calls

_IMPLS = {}  # op -> (its implementation, positions of tensor arguments, of optional ones)
_MUTATED = {}  # op -> positions of the arguments it writes in place
# The dispatcher state _direct reads is private to torch: a torch without one of these
# functions makes every call() go through the op (correct, only slower).
try:
    _STATE = (torch._C._is_torch_function_mode_enabled, torch._C._len_torch_dispatch_stack,
              torch._C._are_functorch_transforms_active, torch._C._autograd._profiler_enabled,
              torch._C._get_tracing_state)
except AttributeError:
    _STATE = None


def _direct(op, args) -> bool:
    """Whether calling op's implementation with these arguments does what calling the op
    does: every argument the schema types as a tensor is a plain torch.Tensor (no subclass,
    FakeTensor, ...; None where optional), nothing for autograd to record (grad mode off, or
    no tensor requiring grad), no torch.compile / export / jit tracing, no torch function or
    dispatch mode, no functorch transform (vmap, grad, ...) and no profiler (which names
    the op). The other arguments come normalised by the caller (bool(), int(), float())."""
    if _STATE is None or torch.compiler.is_compiling():
        return False
    fn_mode, dispatch_stack, functorch, profiler, tracing = _STATE
    if (fn_mode() or dispatch_stack() > 0 or functorch() or profiler()
            or tracing() is not None):
        return False
    impl, tensors, optional = _IMPLS[op]
    n = impl.__code__.co_argcount
    # Trailing parameters with defaults (learnable_sink, ...) may be left out.
    if not n - len(impl.__defaults__ or ()) <= len(args) <= n:
        return False
    grad = torch.is_grad_enabled()
    for i in tensors:
        a = args[i]
        if type(a) is not Tensor or (grad and a.requires_grad):
            return False
    for i in optional:
        if i >= len(args):
            continue
        a = args[i]
        if a is not None and (type(a) is not Tensor or (grad and a.requires_grad)):
            return False
    return True


def call(op, *args):
    """op(*args) with every argument positional, by a direct call of its implementation
    where that is the same (see _direct): torch's dispatcher costs some 15-20 us per call,
    as much as a short kernel. An op that writes arguments in place bumps their version
    counters either way."""
    if not _direct(op, args):
        return op(*args)
    result = _IMPLS[op][0](*args)
    for i in _MUTATED.get(op, ()):
        if not args[i].is_inference():  # (an inference tensor has no version counter)
            torch.autograd.graph.increment_version(args[i])
    return result


def _register(op, impl, mutated=()):
    """Records op's implementation, the positions of its Tensor and Optional[Tensor]
    parameters and those it mutates, for call()."""
    names = impl.__code__.co_varnames[: impl.__code__.co_argcount]
    hints = impl.__annotations__
    _IMPLS[op] = (impl, tuple(i for i, n in enumerate(names) if hints[n] is Tensor),
                  tuple(i for i, n in enumerate(names) if hints[n] == Optional[Tensor]))
    if mutated:
        _MUTATED[op] = mutated
    return op


# ---------------------------------------------------------------- dense


def _fwd_outputs(q: Tensor, k: Tensor, v: Tensor, return_probs: bool):
    b, s_q, h_q, _ = q.shape
    out = _with_head_dim(q, v)
    lse = _empty((b, h_q, s_q), q, torch.float32)
    probs = _empty((b, h_q, s_q, k.shape[1]) if return_probs else (0,), q, torch.float32)
    return out, lse, probs


def _fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    return_probs: bool,
    learnable_sink: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [b, s_q, h_q, d_v], lse [b, h_q, s_q] fp32, probs [b, h_q, s_q, s_k] fp32 or [0]).
    learnable_sink: fp32 [h_q] logits in every row's softmax denominator (lse includes them);
    qv [b, s_q, h_q, d_v]: MLA's qv (forward only);
    mask_block_cnt ... prefix_keys: a block-sparse mask (flashattn::BlockSparseTensors)."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_fwd(q, k, v, alibi_slopes, learnable_sink, qv, bs)
    out, lse, probs = _fwd_outputs(q, k, v, return_probs)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink, qv=qv,
                    block_sparse=bs)
    _C.forward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)), _dl(out), _dl(lse),
               return_probs=_dl(probs) if return_probs else None, **opts)
    return out, lse, probs


fwd = _register(torch.library.custom_op("flashattn::fwd", mutates_args=())(_fwd), _fwd)


@fwd.register_fake
def _(q, k, v, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right,
      softcap, dropout_p, deterministic, return_probs, learnable_sink=None, qv=None, *bs):
    _check_fwd(q, k, v, alibi_slopes, learnable_sink, qv, bs)
    return _fwd_outputs(q, k, v, return_probs)


# ---------------------------------------------------------------- fp8 (e4m3) forward
#
# fp8 q, k, v (torch.float8_e4m3fn) with FlashAttention-3's fp32 [b, h_k] descales
# (None = 1); out in out_dtype (bfloat16 / float16), lse fp32, probs fp32 (or [0]) as
# fwd / varlen_fwd's. Forward only: there is no fp8 backward (as in FlashAttention-3), so
# these ops have no autograd formula. CPU tensors run on the CPU backend, CUDA tensors on
# the sm90 (Hopper) fp8 kernel, which takes no dropout, return_probs or block-sparse mask
# (UnsupportedError naming the option; other GPUs: UnsupportedError). The descales go to
# the library contiguous (the CUDA kernel reads them as [b, h_k] rows: _descale). After
# out_dtype they take, as fwd / varlen_fwd do, rng_state, dropout_p and return_probs
# (dropout and the debug probabilities, computed on the dequantized values), then
# (varlen_fwd_fp8) seqused_q, then the block-sparse mask arguments (mask_block_cnt ...
# prefix_keys), all optional.


def _descale(t: Optional[Tensor]) -> Optional[Tensor]:
    """An fp8 descale as the library takes it: _prepare's view, contiguous (a padded,
    transposed or broadcast [b, h_k] is copied; the library checks dtype float32, the
    shape and the device, and names the descale)."""
    t = _prepare(t)
    if t is None or t.dim() == 0 or t.is_contiguous():
        return t
    return t.contiguous()


def _fwd_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    out_dtype: torch.dtype,
    rng_state: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_probs: bool = False,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [b, s_q, h_q, d_v] in out_dtype, lse [b, h_q, s_q] fp32, probs [b, h_q, s_q, s_k]
    fp32 or [0]) of fp8 q, k, v; dropout, probs and the block-sparse mask as fwd's."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_fp8_dense(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, learnable_sink, bs)
    out, lse, probs = _fwd_fp8_outputs(q, v, out_dtype, k.shape[1] if return_probs else None)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, False, learnable_sink, block_sparse=bs)
    _C.forward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)), _dl(out), _dl(lse),
               return_probs=_dl(probs) if return_probs else None,
               q_descale=_dl(_descale(q_descale)), k_descale=_dl(_descale(k_descale)),
               v_descale=_dl(_descale(v_descale)), **opts)
    return out, lse, probs


def _check_fp8_dense(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, learnable_sink,
                     bs=()):
    fn = "flashattn::fwd_fp8"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(fn, name, t, 4, _DENSE)
    check_head_dim(fn, "q", q)
    check_head_dim(fn, "v", v)
    check_device(fn, q, k=k, v=v, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                 **_bs_devices(bs))


def _fwd_fp8_outputs(q: Tensor, v: Tensor, out_dtype: torch.dtype, probs_s_k=None):
    """out in out_dtype, lse fp32, probs fp32 [b, h_q, s_q, probs_s_k] (dense) /
    [h_q, total_q, probs_s_k] (varlen), or [0] when probs_s_k is None."""
    out = torch.empty(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=out_dtype, device=q.device)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else (q.shape[1], q.shape[0])
    probs_shape = (0,) if probs_s_k is None else lse_shape + (probs_s_k,)
    return out, _empty(lse_shape, q, torch.float32), _empty(probs_shape, q, torch.float32)


fwd_fp8 = _register(torch.library.custom_op("flashattn::fwd_fp8", mutates_args=())(_fwd_fp8),
                    _fwd_fp8)


@fwd_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, learnable_sink, softmax_scale,
      causal, window_left, window_right, softcap, out_dtype, rng_state=None, dropout_p=0.0,
      return_probs=False, *bs):
    _check_fp8_dense(q, k, v, q_descale, k_descale, v_descale, alibi_slopes, learnable_sink, bs)
    return _fwd_fp8_outputs(q, v, out_dtype, k.shape[1] if return_probs else None)


def _varlen_fwd_fp8(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    q_descale: Optional[Tensor],
    k_descale: Optional[Tensor],
    v_descale: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    learnable_sink: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    out_dtype: torch.dtype,
    rng_state: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    return_probs: bool = False,
    seqused_q: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [total_q, h_q, d_v] in out_dtype, lse [h_q, total_q] fp32, probs [h_q, total_q,
    max_seqlen_k] fp32 or [0]) of fp8 q, k, v; descales [b, h_k] with b = len(cu_seqlens_q)
    - 1; dropout, probs, seqused_q and the block-sparse mask as varlen_fwd's."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_varlen("flashattn::varlen_fwd_fp8", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, seqused_q=seqused_q,
                  **_bs_devices(bs))
    out, lse, probs = _fwd_fp8_outputs(q, v, out_dtype, max_seqlen_k if return_probs else None)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, False, learnable_sink, block_sparse=bs)
    _C.varlen_forward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)),
                      _dl(_prepare(cu_seqlens_q)), _dl(_prepare(cu_seqlens_k)),
                      _dl(_prepare(seqused_k)), max_seqlen_q, max_seqlen_k, _dl(out), _dl(lse),
                      return_probs=_dl(probs) if return_probs else None,
                      q_descale=_dl(_descale(q_descale)), k_descale=_dl(_descale(k_descale)),
                      v_descale=_dl(_descale(v_descale)), **opts,
                      seqused_q=_dl(_prepare(seqused_q)))
    return out, lse, probs


varlen_fwd_fp8 = _register(
    torch.library.custom_op("flashattn::varlen_fwd_fp8", mutates_args=())(_varlen_fwd_fp8),
    _varlen_fwd_fp8)


@varlen_fwd_fp8.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, q_descale,
      k_descale, v_descale, alibi_slopes, learnable_sink, softmax_scale, causal, window_left,
      window_right, softcap, out_dtype, rng_state=None, dropout_p=0.0, return_probs=False,
      seqused_q=None, *bs):
    _check_varlen("flashattn::varlen_fwd_fp8", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale, seqused_q=seqused_q,
                  **_bs_devices(bs))
    return _fwd_fp8_outputs(q, v, out_dtype, max_seqlen_k if return_probs else None)


def _bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    learnable_sink: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink); dk and dv are summed over each GQA group (shapes of k and v);
    dsink is fp32 [h_q] with a learnable_sink, else empty [0]."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, bs)
    dq, dk, dv = _like(q), _like(k), _like(v)
    dsink = _sink_grad_output(q, q.shape[2], learnable_sink)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink,
                    dsink if learnable_sink is not None else None, block_sparse=bs)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    workspace = None
    if q.is_cuda:
        # Scratch from torch's allocator: stream-ordered, and graph-private under capture.
        nbytes = _C.backward_workspace_size(
            _dl(q), _dl(k), _dl(v),
            **dict(opts, alibi_slopes=_dl(_prepare(alibi_slopes)),
                   learnable_sink=_dl(_prepare(learnable_sink)),
                   learnable_sink_grad=_dl(dsink) if learnable_sink is not None else None,
                   **_block_sparse_kwargs(bs)))
        if nbytes > 0:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    _C.backward(_dl(_prepare(dout)), _dl(q), _dl(k), _dl(v), _dl(_prepare(out)),
                _dl(_prepare(lse)), _dl(dq), _dl(dk), _dl(dv), _dl(workspace), **opts)
    return dq, dk, dv, dsink


bwd = _register(torch.library.custom_op("flashattn::bwd", mutates_args=())(_bwd), _bwd)


@bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, softmax_scale, causal, window_left,
      window_right, softcap, dropout_p, deterministic, learnable_sink=None, *bs):
    _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink, bs)
    return _like(q), _like(k), _like(v), _sink_grad_output(q, q.shape[2], learnable_sink)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right,
     softcap, dropout_p, deterministic, _) = inputs[:13]
    learnable_sink = inputs[13] if len(inputs) > 13 else None
    ctx.has_qv = len(inputs) > 14 and inputs[14] is not None
    bs = tuple(inputs[15:24])
    out, lse, _ = output
    # The block-sparse tensors (if any) are saved; block sizes ride with the scalars.
    bs_tensors = (bs[0:4] + bs[6:9]) if bs else (None,) * 7
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, learnable_sink, *bs_tensors)
    ctx.scalars = (softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                   deterministic)
    ctx.block_sizes = (bs[4], bs[5]) if bs else (128, 128)


def _sink_grad(ctx, learnable_sink, dsink, index=-1):
    """The sink's gradient for autograd (the op's input `index`): None when it needs none
    (or there is no sink)."""
    if learnable_sink is None or not ctx.needs_input_grad[index]:
        return None
    return dsink.to(learnable_sink.dtype)


def _no_qv_backward(ctx, fn):
    """qv has no backward (as in FlashAttention-3): a clear error naming it."""
    if ctx.has_qv:
        raise invalid(fn, "qv", "None for a call that is differentiated (qv has no backward, "
                      "as in FlashAttention-3; run the forward with qv under torch.no_grad())",
                      "a tensor", cls=UnsupportedError)


def _fwd_backward(ctx, dout, dlse, dprobs):
    # lse and probs are outputs without gradients (as in flash_attn): dlse, dprobs ignored.
    _no_qv_backward(ctx, "flashattn::bwd")
    saved = ctx.saved_tensors
    q, k, v, out, lse, alibi_slopes, rng_state, learnable_sink = saved[:8]
    bs_t = saved[8:15]
    if dout is None:
        dout = torch.zeros_like(out)
    if all(t is None for t in bs_t):
        dq, dk, dv, dsink = call(bwd, dout, q, k, v, out, lse, alibi_slopes, rng_state,
                                 *ctx.scalars, learnable_sink)
    else:
        dq, dk, dv, dsink = call(bwd, dout, q, k, v, out, lse, alibi_slopes, rng_state,
                                 *ctx.scalars, learnable_sink, *bs_t[:4], *ctx.block_sizes,
                                 *bs_t[4:])
    n = len(ctx.needs_input_grad)  # the op's inputs: 13, 14 (a sink), 15 (qv) or 24 (block sparse)
    grads = (dq, dk, dv) + (None,) * 10
    if n > 13:
        grads += (_sink_grad(ctx, learnable_sink, dsink, 13),) + (None,) * (n - 14)
    return grads


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------- varlen


def _varlen_fwd_outputs(q: Tensor, v: Tensor, max_seqlen_k: int, return_probs: bool):
    total_q, h_q, _ = q.shape
    out = _with_head_dim(q, v)
    lse = _empty((h_q, total_q), q, torch.float32)
    probs = _empty((h_q, total_q, max_seqlen_k) if return_probs else (0,), q, torch.float32)
    return out, lse, probs


def _varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    return_probs: bool,
    learnable_sink: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [total_q, h_q, d_v], lse [h_q, total_q] fp32, probs [h_q, total_q, max_seqlen_k] or [0]).
    seqused_q int32 [b]: only the first seqused_q[b] queries of sequence b are computed (the
    rest: out 0, lse -inf). qv [total_q, h_q, d_v]: MLA's qv (forward only).
    mask_block_cnt ... prefix_keys: a block-sparse mask over the max_seqlen_q x max_seqlen_k
    grid of each sequence (doc ids packed: [total_q], [total_k])."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_varlen("flashattn::varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, seqused_q=seqused_q, qv=qv,
                  **_bs_devices(bs))
    out, lse, probs = _varlen_fwd_outputs(q, v, max_seqlen_k, return_probs)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink, qv=qv,
                    block_sparse=bs)
    _C.varlen_forward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)),
                      _dl(_prepare(cu_seqlens_q)), _dl(_prepare(cu_seqlens_k)),
                      _dl(_prepare(seqused_k)), max_seqlen_q, max_seqlen_k, _dl(out), _dl(lse),
                      return_probs=_dl(probs) if return_probs else None, **opts,
                      seqused_q=_dl(_prepare(seqused_q)))
    return out, lse, probs


varlen_fwd = _register(
    torch.library.custom_op("flashattn::varlen_fwd", mutates_args=())(_varlen_fwd), _varlen_fwd)


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
      deterministic, return_probs, learnable_sink=None, seqused_q=None, qv=None, *bs):
    _check_varlen("flashattn::varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, seqused_q=seqused_q, qv=qv,
                  **_bs_devices(bs))
    return _varlen_fwd_outputs(q, v, max_seqlen_k, return_probs)


def _varlen_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_k: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    rng_state: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    dropout_p: float,
    deterministic: bool,
    learnable_sink: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    mask_block_cnt: Optional[Tensor] = None,
    mask_block_idx: Optional[Tensor] = None,
    full_block_cnt: Optional[Tensor] = None,
    full_block_idx: Optional[Tensor] = None,
    block_size_q: int = 128,
    block_size_k: int = 128,
    q_doc_ids: Optional[Tensor] = None,
    k_doc_ids: Optional[Tensor] = None,
    prefix_keys: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink); dsink fp32 [h_q] with a learnable_sink, else empty [0]."""
    bs = (mask_block_cnt, mask_block_idx, full_block_cnt, full_block_idx, block_size_q,
          block_size_k, q_doc_ids, k_doc_ids, prefix_keys)
    _check_varlen("flashattn::varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, dout=dout, out=out, lse=lse, learnable_sink=learnable_sink,
                  seqused_q=seqused_q, **_bs_devices(bs))
    dq, dk, dv = _like(q), _like(k), _like(v)
    dsink = _sink_grad_output(q, q.shape[1], learnable_sink)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink,
                    dsink if learnable_sink is not None else None, block_sparse=bs)
    # Scratch, when needed, is allocated by the library (stream-ordered): sizing it here
    # would read cu_seqlens from the device a second time.
    _C.varlen_backward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)),
                       _dl(_prepare(cu_seqlens_q)), _dl(_prepare(cu_seqlens_k)),
                       _dl(_prepare(seqused_k)), max_seqlen_q, max_seqlen_k,
                       _dl(_prepare(dout)), _dl(_prepare(out)), _dl(_prepare(lse)), _dl(dq),
                       _dl(dk), _dl(dv), None, **opts, seqused_q=_dl(_prepare(seqused_q)))
    return dq, dk, dv, dsink


varlen_bwd = _register(
    torch.library.custom_op("flashattn::varlen_bwd", mutates_args=())(_varlen_bwd), _varlen_bwd)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, rng_state,
      max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
      dropout_p, deterministic, learnable_sink=None, seqused_q=None, *bs):
    _check_varlen("flashattn::varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, dout=dout, out=out, lse=lse, learnable_sink=learnable_sink,
                  seqused_q=seqused_q, **_bs_devices(bs))
    return _like(q), _like(k), _like(v), _sink_grad_output(q, q.shape[1], learnable_sink)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
     max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
     deterministic, _) = inputs[:18]
    learnable_sink = inputs[18] if len(inputs) > 18 else None
    seqused_q = inputs[19] if len(inputs) > 19 else None
    ctx.has_qv = len(inputs) > 20 and inputs[20] is not None
    bs = tuple(inputs[21:30])
    out, lse, _ = output
    bs_tensors = (bs[0:4] + bs[6:9]) if bs else (None,) * 7
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          alibi_slopes, rng_state, learnable_sink, seqused_q, *bs_tensors)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                   softcap, dropout_p, deterministic)
    ctx.block_sizes = (bs[4], bs[5]) if bs else (128, 128)


def _varlen_backward(ctx, dout, dlse, dprobs):
    _no_qv_backward(ctx, "flashattn::varlen_bwd")
    saved = ctx.saved_tensors
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
     rng_state, learnable_sink, seqused_q) = saved[:12]
    bs_t = saved[12:19]
    if dout is None:
        dout = torch.zeros_like(out)
    bs = ((*bs_t[:4], *ctx.block_sizes, *bs_t[4:]) if any(t is not None for t in bs_t)
          else ())
    dq, dk, dv, dsink = call(varlen_bwd, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                             seqused_k, alibi_slopes, rng_state, *ctx.scalars, learnable_sink,
                             seqused_q, *bs)
    n = len(ctx.needs_input_grad)  # 18, 19, 20, 21 or 30 inputs
    grads = (dq, dk, dv) + (None,) * 15
    if n > 18:
        grads += (_sink_grad(ctx, learnable_sink, dsink, 18),) + (None,) * (n - 19)
    return grads


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------- KV cache


def _kvcache_fwd(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    block_table: Optional[Tensor],
    cache_batch_idx: Optional[Tensor],
    k_new: Optional[Tensor],
    v_new: Optional[Tensor],
    alibi_slopes: Optional[Tensor],
    softmax_scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    tree_mask: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
    qv: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor]:
    """(out [b, s_q, h_q, d_v], lse [b, h_q, s_q] fp32). k_new/v_new are written into the
    caches in place at cache_seqlens (not advanced) before attending. A float8_e4m3fn
    cache takes fp32 k_scale/v_scale ([h_k] or [k_cache.shape[0], h_k]); tree_mask int32
    [b, s_q, ceil(s_q / 32)] is the draft-tree bitmask over the last s_q keys;
    learnable_sink fp32 [h_q] (lse includes it); qv [b, s_q, h_q, d_v] (MLA; on CUDA
    16-bit caches, d <= 64, d_v <= 512, no tree_mask) adds qv . v to every score
    (softmax_scale is given: the interface's default with qv is 1/sqrt(d + d_v));
    cache_leftpad int32 [b] (dense caches): sequence i's keys are
    cache rows cache_leftpad[i] .. cache_seqlens[i] + s_new - 1. fp8 q (FlashAttention-3's
    call): q, k_cache, v_cache, k_new, v_new float8_e4m3fn with q_descale / k_descale /
    v_descale fp32 [b, h_k] (None = 1; no k_scale / v_scale; given to the library
    contiguous, as the CUDA decode kernel reads them: _descale), out in out_dtype (bfloat16
    when None, or float16)."""
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink, qv,
                   cache_leftpad, q_descale, k_descale, v_descale)
    b, s_q, h_q, _ = q.shape
    out = _kvcache_out(q, v_cache, out_dtype)
    lse = _empty((b, h_q, s_q), q, torch.float32)
    opts = _options(q, alibi_slopes, None, softmax_scale, causal, window_left, window_right,
                    softcap, 0.0, False, learnable_sink, qv=qv)
    # The caches are written in place: they go as they are (no copy).
    _C.kvcache_forward(_dl(_prepare(q)), _dl(_detached(k_cache)), _dl(_detached(v_cache)),
                       _dl(_prepare(cache_seqlens)), _arg(block_table), _arg(cache_batch_idx),
                       _arg(k_new), _arg(v_new), num_splits, _dl(out), _dl(lse), None, **opts,
                       k_scale=_arg(k_scale), v_scale=_arg(v_scale), tree_mask=_arg(tree_mask),
                       cache_leftpad=_arg(cache_leftpad), q_descale=_dl(_descale(q_descale)),
                       k_descale=_dl(_descale(k_descale)), v_descale=_dl(_descale(v_descale)))
    return out, lse


def _kvcache_out(q: Tensor, v_cache: Tensor, out_dtype: Optional[torch.dtype]) -> Tensor:
    """out [b, s_q, h_q, d_v]: q's dtype, or for fp8 q out_dtype (None: bfloat16, as in
    FlashAttention-3); the library checks the dtype."""
    if q.dtype != torch.float8_e4m3fn:
        return _with_head_dim(q, v_cache)
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    return torch.empty(tuple(q.shape[:-1]) + (v_cache.shape[-1],), dtype=dtype, device=q.device)


kvcache_fwd = _register(
    torch.library.custom_op("flashattn::kvcache_fwd", mutates_args=("k_cache", "v_cache"))(
        _kvcache_fwd),
    _kvcache_fwd, mutated=(1, 2))


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new, v_new,
      alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, num_splits,
      k_scale=None, v_scale=None, tree_mask=None, learnable_sink=None, qv=None,
      cache_leftpad=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink, qv,
                   cache_leftpad, q_descale, k_descale, v_descale)
    b, s_q, h_q, _ = q.shape
    return _kvcache_out(q, v_cache, out_dtype), _empty((b, h_q, s_q), q, torch.float32)
