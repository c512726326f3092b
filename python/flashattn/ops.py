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

Learnable sinks (FlashAttention-4's learnable_sink): the forward ops take an optional
fp32 [h_q] learnable_sink as their last argument; the backward ops take it too and return
its gradient d sink (fp32 [h_q], or an empty [0] tensor without a sink) after dq, dk, dv.

Dropout: rng_state is an int64 CPU tensor [2] = (seed, offset) for the library's Philox
generator (drawn by the caller from torch's default CPU generator); the forward's
autograd formula hands the same tensor to the backward, which recomputes the same mask.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _C
from ._checks import check_device, check_head_dim, check_rank

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
    t = t.detach()
    if t.dim() == 0:
        return t
    ok = t.stride(-1) == 1
    if ok and t.is_cuda:
        # A contiguous tensor whose last dimension is a multiple of 8 has every outer
        # stride a multiple of 8: only the address is left to check.
        ok = t.data_ptr() % 16 == 0 and (
            (t.shape[-1] % 8 == 0 and t.is_contiguous())
            or all(st % 8 == 0 for st, sz in zip(t.stride()[:-1], t.shape[:-1]) if sz > 1)
        )
    if ok:
        return t
    fresh = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    fresh.copy_(t)
    return fresh


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
    )


# Checks shared by each op and its fake implementation: the ranks the outputs' shapes are
# read from, a nonzero head dim, and one device for every tensor (rng_state excepted: a
# CPU tensor by design). The library checks everything else.
_DENSE = "[b, s, h, d]"
_PACKED = "[total, h, d]"


def _check_fwd(q, k, v, alibi_slopes, learnable_sink=None):
    fn = "flashattn::fwd"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(fn, name, t, 4, _DENSE)
    check_head_dim(fn, "q", q)
    check_device(fn, q, k=k, v=v, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink)


def _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink=None):
    fn = "flashattn::bwd"
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        check_rank(fn, name, t, 4, _DENSE)
    check_rank(fn, "lse", lse, 3, "[b, h_q, s_q]")
    check_head_dim(fn, "q", q)
    check_device(fn, q, dout=dout, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes,
                 learnable_sink=learnable_sink)


def _check_varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, **more):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(fn, name, t, 3, _PACKED)
    check_head_dim(fn, "q", q)
    check_device(fn, q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, alibi_slopes=alibi_slopes, **more)


def _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink=None,
                   cache_leftpad=None):
    fn = "flashattn::kvcache_fwd"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                    ("v_new", v_new)):
        check_rank(fn, name, t, 4, _DENSE)
    check_head_dim(fn, "q", q)
    check_device(fn, q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                 block_table=block_table, cache_batch_idx=cache_batch_idx, k_new=k_new,
                 v_new=v_new, alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
                 tree_mask=tree_mask, learnable_sink=learnable_sink,
                 cache_leftpad=cache_leftpad)


def _sink_grad_output(q: Tensor, h_q: int, learnable_sink: Optional[Tensor]) -> Tensor:
    """The backward's d sink output: fp32 [h_q] with a sink, else an empty [0] tensor."""
    return _empty((h_q,) if learnable_sink is not None else (0,), q, torch.float32)


def _empty(shape, like: Tensor, dtype=None) -> Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


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


def _fwd_outputs(q: Tensor, k: Tensor, return_probs: bool):
    b, s_q, h_q, _ = q.shape
    out = _like(q)
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
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [b, s_q, h_q, d], lse [b, h_q, s_q] fp32, probs [b, h_q, s_q, s_k] fp32 or [0]).
    learnable_sink: fp32 [h_q] logits in every row's softmax denominator (lse includes them)."""
    _check_fwd(q, k, v, alibi_slopes, learnable_sink)
    out, lse, probs = _fwd_outputs(q, k, return_probs)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink)
    _C.forward(_dl(_prepare(q)), _dl(_prepare(k)), _dl(_prepare(v)), _dl(out), _dl(lse),
               return_probs=_dl(probs) if return_probs else None, **opts)
    return out, lse, probs


fwd = _register(torch.library.custom_op("flashattn::fwd", mutates_args=())(_fwd), _fwd)


@fwd.register_fake
def _(q, k, v, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right,
      softcap, dropout_p, deterministic, return_probs, learnable_sink=None):
    _check_fwd(q, k, v, alibi_slopes, learnable_sink)
    return _fwd_outputs(q, k, return_probs)


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink); dk and dv are summed over each GQA group (shapes of k and v);
    dsink is fp32 [h_q] with a learnable_sink, else empty [0]."""
    _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink)
    dq, dk, dv = _like(q), _like(k), _like(v)
    dsink = _sink_grad_output(q, q.shape[2], learnable_sink)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink,
                    dsink if learnable_sink is not None else None)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    workspace = None
    if q.is_cuda:
        # Scratch from torch's allocator: stream-ordered, and graph-private under capture.
        nbytes = _C.backward_workspace_size(
            _dl(q), _dl(k), _dl(v),
            **dict(opts, alibi_slopes=_dl(_prepare(alibi_slopes)),
                   learnable_sink=_dl(_prepare(learnable_sink)),
                   learnable_sink_grad=_dl(dsink) if learnable_sink is not None else None))
        if nbytes > 0:
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    _C.backward(_dl(_prepare(dout)), _dl(q), _dl(k), _dl(v), _dl(_prepare(out)),
                _dl(_prepare(lse)), _dl(dq), _dl(dk), _dl(dv), _dl(workspace), **opts)
    return dq, dk, dv, dsink


bwd = _register(torch.library.custom_op("flashattn::bwd", mutates_args=())(_bwd), _bwd)


@bwd.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, softmax_scale, causal, window_left,
      window_right, softcap, dropout_p, deterministic, learnable_sink=None):
    _check_bwd(dout, q, k, v, out, lse, alibi_slopes, learnable_sink)
    return _like(q), _like(k), _like(v), _sink_grad_output(q, q.shape[2], learnable_sink)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, rng_state, softmax_scale, causal, window_left, window_right,
     softcap, dropout_p, deterministic, _) = inputs[:13]
    learnable_sink = inputs[13] if len(inputs) > 13 else None
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, learnable_sink)
    ctx.scalars = (softmax_scale, causal, window_left, window_right, softcap, dropout_p,
                   deterministic)


def _sink_grad(ctx, learnable_sink, dsink, index=-1):
    """The sink's gradient for autograd (the op's input `index`): None when it needs none
    (or there is no sink)."""
    if learnable_sink is None or not ctx.needs_input_grad[index]:
        return None
    return dsink.to(learnable_sink.dtype)


def _fwd_backward(ctx, dout, dlse, dprobs):
    # lse and probs are outputs without gradients (as in flash_attn): dlse, dprobs ignored.
    q, k, v, out, lse, alibi_slopes, rng_state, learnable_sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = call(bwd, dout, q, k, v, out, lse, alibi_slopes, rng_state,
                             *ctx.scalars, learnable_sink)
    return (dq, dk, dv) + (None,) * 10 + (_sink_grad(ctx, learnable_sink, dsink),)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------- varlen


def _varlen_fwd_outputs(q: Tensor, max_seqlen_k: int, return_probs: bool):
    total_q, h_q, _ = q.shape
    out = _like(q)
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
) -> tuple[Tensor, Tensor, Tensor]:
    """(out [total_q, h_q, d], lse [h_q, total_q] fp32, probs [h_q, total_q, max_seqlen_k] or [0]).
    seqused_q int32 [b]: only the first seqused_q[b] queries of sequence b are computed (the
    rest: out 0, lse -inf)."""
    _check_varlen("flashattn::varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, seqused_q=seqused_q)
    out, lse, probs = _varlen_fwd_outputs(q, max_seqlen_k, return_probs)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink)
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
      deterministic, return_probs, learnable_sink=None, seqused_q=None):
    _check_varlen("flashattn::varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, learnable_sink=learnable_sink, seqused_q=seqused_q)
    return _varlen_fwd_outputs(q, max_seqlen_k, return_probs)


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsink); dsink fp32 [h_q] with a learnable_sink, else empty [0]."""
    _check_varlen("flashattn::varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, dout=dout, out=out, lse=lse, learnable_sink=learnable_sink,
                  seqused_q=seqused_q)
    dq, dk, dv = _like(q), _like(k), _like(v)
    dsink = _sink_grad_output(q, q.shape[1], learnable_sink)
    opts = _options(q, alibi_slopes, rng_state, softmax_scale, causal, window_left,
                    window_right, softcap, dropout_p, deterministic, learnable_sink,
                    dsink if learnable_sink is not None else None)
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
      dropout_p, deterministic, learnable_sink=None, seqused_q=None):
    _check_varlen("flashattn::varlen_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                  alibi_slopes, dout=dout, out=out, lse=lse, learnable_sink=learnable_sink,
                  seqused_q=seqused_q)
    return _like(q), _like(k), _like(v), _sink_grad_output(q, q.shape[1], learnable_sink)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, rng_state, max_seqlen_q,
     max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p,
     deterministic, _) = inputs[:18]
    learnable_sink = inputs[18] if len(inputs) > 18 else None
    seqused_q = inputs[19] if len(inputs) > 19 else None
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                          alibi_slopes, rng_state, learnable_sink, seqused_q)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                   softcap, dropout_p, deterministic)


def _varlen_backward(ctx, dout, dlse, dprobs):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
     rng_state, learnable_sink, seqused_q) = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = call(varlen_bwd, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                             seqused_k, alibi_slopes, rng_state, *ctx.scalars, learnable_sink,
                             seqused_q)
    return ((dq, dk, dv) + (None,) * 15 + (_sink_grad(ctx, learnable_sink, dsink, 18),)
            + (None,))


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
    cache_leftpad: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out [b, s_q, h_q, d], lse [b, h_q, s_q] fp32). k_new/v_new are written into the
    caches in place at cache_seqlens (not advanced) before attending. A float8_e4m3fn
    cache takes fp32 k_scale/v_scale ([h_k] or [k_cache.shape[0], h_k]); tree_mask int32
    [b, s_q, ceil(s_q / 32)] is the draft-tree bitmask over the last s_q keys;
    learnable_sink fp32 [h_q] (lse includes it); cache_leftpad int32 [b] (dense caches):
    sequence i's keys are cache rows cache_leftpad[i] .. cache_seqlens[i] + s_new - 1."""
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink,
                   cache_leftpad)
    b, s_q, h_q, _ = q.shape
    out = _like(q)
    lse = _empty((b, h_q, s_q), q, torch.float32)
    opts = _options(q, alibi_slopes, None, softmax_scale, causal, window_left, window_right,
                    softcap, 0.0, False, learnable_sink)
    # The caches are written in place: they go as they are (no copy).
    _C.kvcache_forward(_dl(_prepare(q)), _dl(k_cache.detach()), _dl(v_cache.detach()),
                       _dl(_prepare(cache_seqlens)), _dl(_prepare(block_table)),
                       _dl(_prepare(cache_batch_idx)), _dl(_prepare(k_new)),
                       _dl(_prepare(v_new)), num_splits, _dl(out), _dl(lse), None, **opts,
                       k_scale=_dl(_prepare(k_scale)), v_scale=_dl(_prepare(v_scale)),
                       tree_mask=_dl(_prepare(tree_mask)),
                       cache_leftpad=_dl(_prepare(cache_leftpad)))
    return out, lse


kvcache_fwd = _register(
    torch.library.custom_op("flashattn::kvcache_fwd", mutates_args=("k_cache", "v_cache"))(
        _kvcache_fwd),
    _kvcache_fwd, mutated=(1, 2))


@kvcache_fwd.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new, v_new,
      alibi_slopes, softmax_scale, causal, window_left, window_right, softcap, num_splits,
      k_scale=None, v_scale=None, tree_mask=None, learnable_sink=None, cache_leftpad=None):
    _check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, k_new,
                   v_new, alibi_slopes, k_scale, v_scale, tree_mask, learnable_sink,
                   cache_leftpad)
    b, s_q, h_q, _ = q.shape
    return _like(q), _empty((b, h_q, s_q), q, torch.float32)
