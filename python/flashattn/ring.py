"""Context parallelism: ring attention over a torch.distributed process group.

The sequence is sharded over the W ranks of a group; every rank keeps its queries and
passes its keys/values around the ring (rank r sends to r+1 and receives from r-1, with
``dist.batch_isend_irecv``), so after W steps each query block has met every key block.
The next K/V block is in flight while the current one is computed (overlap). The local
work is flashattn's own ``torch.ops.flashattn.{fwd,bwd,varlen_fwd,varlen_bwd}`` (the CPU
backend on CPU tensors, the CUDA kernels on CUDA tensors), and the partial results merge
exactly by their log-sum-exp (docs/semantics.md, split-KV):
``lse = log(exp(lse_a) + exp(lse_b))``, ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``,
a partial with ``lse = -inf`` (no visible key) having weight 0.

Sharding is zigzag (causal load balancing): the sequence is cut into 2W chunks of equal
length c and rank r holds chunks r and 2W-1-r, concatenated (local length 2c). With this
layout every ring step of a causal attention costs every rank the same 2c*c scores:

    step 0 (own K/V)        the local 2c x 2c block, causal (diagonal blocks + one full)
    source s < r            all 2c queries x the first K/V chunk (s), no mask
    source s > r            the second query chunk (2W-1-r) x both K/V chunks, no mask

(other chunk pairs are entirely in the future and skipped). The same layout is used
without ``causal`` (then every step is the full 2c x 2c block).

The backward recomputes each block with the saved *global* out and lse (so each block's
probabilities are the final ones), accumulates dQ locally and sends dK/dV accumulators
around the ring behind the K/V blocks: the accumulator of block s travels with it and
returns, after W steps, to rank s. The accumulators (and the forward's running output)
are fp32 (fp64 for fp64 inputs).

Not supported here: dropout, ALiBi, sliding windows (they depend on absolute positions or
on a per-call random stream); softcap is supported (it is elementwise on scores).

Public names: ring_attention, ring_attention_varlen, zigzag_shard, zigzag_unshard,
zigzag_shard_varlen, zigzag_unshard_varlen; and, for single-process emulation and tests,
ring_forward_schedule / ring_backward_schedule with EmulatedRing, run_emulated and
emulated_layout (bench/ring_emulate.py). docs/ring.md has the details and measurements.
"""

from collections import deque
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import ops

_TAG_KV = 0
_TAG_DKV = 1

__all__ = [
    "ring_attention",
    "ring_attention_varlen",
    "zigzag_shard",
    "zigzag_unshard",
    "zigzag_shard_varlen",
    "zigzag_unshard_varlen",
    "EmulatedRing",
    "ring_forward_schedule",
    "ring_backward_schedule",
    "run_emulated",
    "emulated_layout",
]


# ---------------------------------------------------------------- sharding helpers


def _chunk_bounds(n: int, world_size: int, what: str) -> int:
    if world_size < 1:
        raise ValueError(f"{what}: world_size must be >= 1, got {world_size}")
    if n % (2 * world_size) != 0:
        raise ValueError(
            f"{what}: the sequence length must be divisible by 2 * world_size = "
            f"{2 * world_size} (zigzag sharding: 2 equal chunks per rank), got {n}")
    return n // (2 * world_size)


def zigzag_shard(x: Tensor, rank: int, world_size: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s zigzag shard of the full sequence ``x`` along ``dim``: chunks
    ``rank`` and ``2*world_size-1-rank`` of 2*world_size equal chunks, concatenated.
    q/k/v/out [b, s, h, d]: dim=1; lse [b, h, s]: dim=2. Raises ValueError unless
    ``x.shape[dim]`` is divisible by 2*world_size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard: rank must be in [0, {world_size}), got {rank}")
    c = _chunk_bounds(x.shape[dim], world_size, "zigzag_shard")
    a = x.narrow(dim, rank * c, c)
    b = x.narrow(dim, (2 * world_size - 1 - rank) * c, c)
    return torch.cat([a, b], dim=dim)


def zigzag_unshard(shards: Sequence[Tensor], dim: int = 1) -> Tensor:
    """The full sequence from the W zigzag shards (rank order), inverse of zigzag_shard."""
    w = len(shards)
    if w == 0:
        raise ValueError("zigzag_unshard: no shards")
    n = shards[0].shape[dim]
    if n % 2 != 0 or any(s.shape[dim] != n for s in shards):
        raise ValueError(f"zigzag_unshard: every shard needs the same even length along dim "
                         f"{dim}, got {[s.shape[dim] for s in shards]}")
    c = n // 2
    chunks: List[Optional[Tensor]] = [None] * (2 * w)
    for r, s in enumerate(shards):
        chunks[r] = s.narrow(dim, 0, c)
        chunks[2 * w - 1 - r] = s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)


def _lengths(cu_seqlens: Tensor, what: str) -> List[int]:
    cu = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    if cu_seqlens.dim() != 1 or len(cu) < 1 or cu[0] != 0:
        raise ValueError(f"{what}: cu_seqlens must be a 1-D int tensor starting at 0, got {cu}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"{what}: cu_seqlens must be non-decreasing, got {cu}")
    return lens


def _cu(lens: Sequence[int], like: Tensor) -> Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=like.device)


def zigzag_shard_varlen(x: Tensor, cu_seqlens: Tensor, rank: int, world_size: int,
                        dim: int = 0) -> Tuple[Tensor, Tensor]:
    """Zigzag shard of packed sequences: every sequence (rows cu_seqlens[i]..cu_seqlens[i+1]
    of ``x`` along ``dim``) is cut into 2*world_size chunks and the rank keeps chunks rank
    and 2W-1-rank of each. Returns (local x, local cu_seqlens int32). q/k/v [t, h, d]: dim=0;
    lse [h, t]: dim=1. Raises ValueError unless every length is divisible by 2*world_size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard_varlen: rank must be in [0, {world_size}), got {rank}")
    lens = _lengths(cu_seqlens, "zigzag_shard_varlen")
    parts, start = [], 0
    for i, n in enumerate(lens):
        try:
            c = _chunk_bounds(n, world_size, "zigzag_shard_varlen")
        except ValueError as e:
            raise ValueError(f"{e} (sequence {i})") from None
        parts.append(x.narrow(dim, start + rank * c, c))
        parts.append(x.narrow(dim, start + (2 * world_size - 1 - rank) * c, c))
        start += n
    local = torch.cat(parts, dim=dim) if parts else x.narrow(dim, 0, 0)
    return local, _cu([n // world_size for n in lens], cu_seqlens)


def zigzag_unshard_varlen(shards: Sequence[Tensor], cu_seqlens: Tensor, dim: int = 0) -> Tensor:
    """The packed full sequences (global ``cu_seqlens``) from the W varlen zigzag shards."""
    w = len(shards)
    lens = _lengths(cu_seqlens, "zigzag_unshard_varlen")
    for n in lens:
        _chunk_bounds(n, w, "zigzag_unshard_varlen")
    out, offs = [], [0] * w
    for n in lens:
        c = n // (2 * w)
        chunks: List[Optional[Tensor]] = [None] * (2 * w)
        for r, s in enumerate(shards):
            chunks[r] = s.narrow(dim, offs[r], c)
            chunks[2 * w - 1 - r] = s.narrow(dim, offs[r] + c, c)
            offs[r] += 2 * c
        out.extend(chunks)
    return torch.cat(out, dim=dim) if out else shards[0].narrow(dim, 0, 0)


# ---------------------------------------------------------------- communication


class _Handle:
    __slots__ = ("reqs", "recv", "send")

    def __init__(self, reqs, recv, send):
        self.reqs, self.recv, self.send = reqs, recv, send

    def wait(self) -> Tensor:
        for req in self.reqs:
            req.wait()
        self.send = None  # the send buffer may be freed now
        return self.recv


class DistRing:
    """The ring of a torch.distributed process group: exchange(t) posts an isend of t to
    the next rank and an irecv of a tensor like t from the previous one (one
    batch_isend_irecv) and returns a handle whose wait() gives the received tensor."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ring_attention: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.dist = dist
        self.group = dist.group.WORLD if group is None else group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("ring_attention: this process is not a member of the group")
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def exchange(self, t: Tensor, tag: int) -> _Handle:
        d = self.dist
        t = t.contiguous()
        recv = torch.empty_like(t)
        ops_ = [d.P2POp(d.isend, t, self.next, self.group, tag),
                d.P2POp(d.irecv, recv, self.prev, self.group, tag)]
        return _Handle(d.batch_isend_irecv(ops_), recv, t)


class _Mail:
    __slots__ = ("queue",)

    def __init__(self, queue):
        self.queue = queue

    def wait(self) -> Tensor:
        return self.queue.popleft()


class EmulatedRing:
    """Virtual rank ``rank`` of a ring of ``size`` ranks living in one process: exchange()
    copies the tensor into the next rank's mailbox (the transfer is a local copy) and the
    handle's wait() takes the oldest message of this rank's mailbox. Drive the W schedules
    in lock-step with run_emulated()."""

    def __init__(self, rank: int, size: int, mailbox: dict):
        self.rank, self.size, self.box = rank, size, mailbox

    def exchange(self, t: Tensor, tag: int) -> _Mail:
        nxt = (self.rank + 1) % self.size
        self.box.setdefault((nxt, tag), deque()).append(t.clone())
        return _Mail(self.box.setdefault((self.rank, tag), deque()))


def _drive(gen):
    """Run a schedule generator on a DistRing: each yielded handle is waited on and the
    received tensor sent back in; returns the generator's return value."""
    try:
        handle = next(gen)
        while True:
            handle = gen.send(handle.wait())
    except StopIteration as stop:
        return stop.value


def run_emulated(gens, between=None):
    """Run W schedule generators (virtual ranks 0..W-1 over EmulatedRing) in lock-step:
    every round resumes each rank once, up to its next wait, so every message a rank waits
    for has been posted. ``between(rank, phase)`` is called before and after each
    resumption of a rank (phase 'start'/'stop'), e.g. to record CUDA events. Returns the
    ranks' return values."""
    w = len(gens)
    pending: List = [None] * w
    result: List = [None] * w
    alive = [True] * w
    first = True
    while any(alive):
        for r in range(w):
            if not alive[r]:
                continue
            if between is not None:
                between(r, "start")
            try:
                pending[r] = next(gens[r]) if first else gens[r].send(pending[r].wait())
            except StopIteration as stop:
                alive[r] = False
                result[r] = stop.value
            if between is not None:
                between(r, "stop")
        first = False
    return result


# ---------------------------------------------------------------- local work


def _acc_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _weights(acc_l: Tensor, l: Tensor):
    """merged lse and the two merge weights (0 for a partial with lse = -inf)."""
    l = l.to(acc_l.dtype)
    new = torch.logaddexp(acc_l, l)
    ninf = float("-inf")
    w_old = torch.where(acc_l == ninf, torch.zeros_like(acc_l), torch.exp(acc_l - new))
    w_new = torch.where(l == ninf, torch.zeros_like(l), torch.exp(l - new))
    return new, w_old, w_new


class _Dense:
    """q/k/v [b, s_local, h, d] (s_local = 2c), lse [b, h, s_local]."""

    def __init__(self, q: Tensor, scale: float, softcap: float, deterministic: bool):
        self.c = q.shape[1] // 2
        self.scale, self.softcap, self.det = scale, softcap, deterministic

    # rows: None (all) or a slice of the sequence
    @staticmethod
    def rows_o(x, rows):
        return x if rows is None else x[:, rows]

    @staticmethod
    def rows_l(x, rows):
        return x if rows is None else x[:, :, rows]

    @staticmethod
    def w_o(w):  # [b, h, s] -> [b, s, h, 1]
        return w.transpose(1, 2).unsqueeze(-1)

    @staticmethod
    def put_o(acc, rows, val):
        _Dense.rows_o(acc, rows).copy_(val)

    @staticmethod
    def put_l(acc, rows, val):
        _Dense.rows_l(acc, rows).copy_(val)

    @staticmethod
    def add_o(acc, rows, val):
        _Dense.rows_o(acc, rows).add_(val)

    def kv_rows(self, kv, rows):
        return kv if rows is None else kv[:, :, rows]

    def add_kv(self, acc, rows, dk, dv):
        a = self.kv_rows(acc, rows)
        a[0].add_(dk)
        a[1].add_(dv)

    def _fwd(self, q, k, v, causal):
        out, lse, _ = ops.fwd(q, k, v, None, None, self.scale, causal, -1, -1, self.softcap,
                              0.0, self.det, False)
        return out, lse

    def _bwd(self, dout, q, k, v, out, lse, causal):
        return ops.bwd(dout, q, k, v, out, lse, None, None, self.scale, causal, -1, -1,
                       self.softcap, 0.0, self.det)[:3]

    def plan(self, step, rank, w, causal):
        """(q rows, kv rows, causal) of one step; rows None = all, 'first'/'second' halves."""
        if not causal:
            return None, None, False
        if step == 0:
            return None, None, True
        src = (rank - step) % w
        if src < rank:
            return None, "first", False
        return "second", None, False

    def sel(self, rows):
        c = self.c
        return {None: None, "first": slice(0, c), "second": slice(c, 2 * c)}[rows]

    def fwd_step(self, q, kv, step, rank, w, causal):
        qr, kr, cz = self.plan(step, rank, w, causal)
        qs, ks = self.sel(qr), self.sel(kr)
        kvb = self.kv_rows(kv, ks)
        o, l = self._fwd(self.rows_o(q, qs), kvb[0], kvb[1], cz)
        return qs, o, l

    def bwd_step(self, dout, q, kv, out, lse, step, rank, w, causal):
        qr, kr, cz = self.plan(step, rank, w, causal)
        qs, ks = self.sel(qr), self.sel(kr)
        kvb = self.kv_rows(kv, ks)
        dq, dk, dv = self._bwd(self.rows_o(dout, qs), self.rows_o(q, qs), kvb[0], kvb[1],
                               self.rows_o(out, qs), self.rows_l(lse, qs), cz)
        return qs, dq, ks, dk, dv


class _Varlen(_Dense):
    """q/k/v [t_local, h, d] packed, lse [h, t_local]; every local sequence has even length
    2c_i (its chunks i and 2W-1-i of the zigzag sharding)."""

    def __init__(self, q: Tensor, cu_seqlens: Tensor, scale: float, softcap: float,
                 deterministic: bool):
        self.scale, self.softcap, self.det = scale, softcap, deterministic
        lens = _lengths(cu_seqlens, "ring_attention_varlen")
        if sum(lens) != q.shape[0]:
            raise ValueError(f"ring_attention_varlen: cu_seqlens[-1] = {sum(lens)} must equal "
                             f"q.shape[0] = {q.shape[0]}")
        odd = [i for i, n in enumerate(lens) if n % 2]
        if odd:
            raise ValueError(f"ring_attention_varlen: every local sequence length must be even "
                             f"(zigzag: two chunks per rank), sequences {odd} have lengths "
                             f"{[lens[i] for i in odd]}")
        dev = q.device
        self.cu = cu_seqlens.to(device=dev, dtype=torch.int32)
        self.cu_half = _cu([n // 2 for n in lens], q)
        self.max = max(lens) if lens else 0
        self.max_half = self.max // 2
        first, second, start = [], [], 0
        for n in lens:
            first.append(torch.arange(start, start + n // 2))
            second.append(torch.arange(start + n // 2, start + n))
            start += n
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))
        self.idx = {"first": cat(first).to(dev), "second": cat(second).to(dev)}

    @staticmethod
    def rows_o(x, rows):
        return x if rows is None else x.index_select(0, rows)

    @staticmethod
    def rows_l(x, rows):
        return x if rows is None else x.index_select(1, rows)

    @staticmethod
    def w_o(w):  # [h, t] -> [t, h, 1]
        return w.t().unsqueeze(-1)

    @staticmethod
    def put_o(acc, rows, val):
        if rows is None:
            acc.copy_(val)
        else:
            acc.index_copy_(0, rows, val)

    @staticmethod
    def put_l(acc, rows, val):
        if rows is None:
            acc.copy_(val)
        else:
            acc.index_copy_(1, rows, val)

    @staticmethod
    def add_o(acc, rows, val):
        if rows is None:
            acc.add_(val)
        else:
            acc.index_add_(0, rows, val.to(acc.dtype))

    def kv_rows(self, kv, rows):
        return kv if rows is None else kv.index_select(1, rows)

    def add_kv(self, acc, rows, dk, dv):
        if rows is None:
            acc[0].add_(dk)
            acc[1].add_(dv)
        else:
            acc[0].index_add_(0, rows, dk.to(acc.dtype))
            acc[1].index_add_(0, rows, dv.to(acc.dtype))

    def sel(self, rows):
        return None if rows is None else self.idx[rows]

    def _meta(self, qr, kr):
        cq, mq = (self.cu, self.max) if qr is None else (self.cu_half, self.max_half)
        ck, mk = (self.cu, self.max) if kr is None else (self.cu_half, self.max_half)
        return cq, ck, mq, mk

    def fwd_step(self, q, kv, step, rank, w, causal):
        qr, kr, cz = self.plan(step, rank, w, causal)
        qs, ks = self.sel(qr), self.sel(kr)
        kvb = self.kv_rows(kv, ks)
        cq, ck, mq, mk = self._meta(qr, kr)
        o, l, _ = ops.varlen_fwd(self.rows_o(q, qs), kvb[0], kvb[1], cq, ck, None, None, None,
                                 mq, mk, self.scale, cz, -1, -1, self.softcap, 0.0, self.det,
                                 False)
        return qs, o, l

    def bwd_step(self, dout, q, kv, out, lse, step, rank, w, causal):
        qr, kr, cz = self.plan(step, rank, w, causal)
        qs, ks = self.sel(qr), self.sel(kr)
        kvb = self.kv_rows(kv, ks)
        cq, ck, mq, mk = self._meta(qr, kr)
        dq, dk, dv, _ = ops.varlen_bwd(self.rows_o(dout, qs), self.rows_o(q, qs), kvb[0], kvb[1],
                                    self.rows_o(out, qs), self.rows_l(lse, qs), cq, ck, None,
                                    None, None, mq, mk, self.scale, cz, -1, -1, self.softcap,
                                    0.0, self.det)
        return qs, dq, ks, dk, dv


# ---------------------------------------------------------------- the schedules


def ring_forward_schedule(ring, lay, q: Tensor, k: Tensor, v: Tensor, causal: bool):
    """Generator: the forward ring schedule of one rank. Yields a handle whenever it needs
    the tensor a previous exchange() receives (the driver sends it back in); returns
    (out in q's dtype, lse fp32). The next K/V exchange is posted before the current
    block is computed."""
    w, rank = ring.size, ring.rank
    kv = torch.stack([k, v])
    acc_o = acc_l = None
    for step in range(w):
        handle = ring.exchange(kv, _TAG_KV) if step + 1 < w else None
        rows, o, l = lay.fwd_step(q, kv, step, rank, w, causal)
        if step == 0:  # step 0 covers every row (own block; causal diagonal included)
            acc_o = o.to(_acc_dtype(q))
            acc_l = l.to(_acc_dtype(q))
        else:
            al = lay.rows_l(acc_l, rows)
            new, w_old, w_new = _weights(al, l)
            ao = lay.rows_o(acc_o, rows)
            merged = ao * lay.w_o(w_old).to(ao.dtype) + o.to(ao.dtype) * lay.w_o(w_new).to(ao.dtype)
            lay.put_o(acc_o, rows, merged)
            lay.put_l(acc_l, rows, new)
        if handle is not None:
            kv = yield handle
    return acc_o.to(q.dtype), acc_l.to(torch.float32)


def ring_backward_schedule(ring, lay, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                           out: Tensor, lse: Tensor, causal: bool):
    """Generator: the backward ring schedule of one rank; returns (dq, dk, dv). K/V travel
    as in the forward; the dK/dV accumulator of each block travels one step behind it and
    arrives home after the last step."""
    w, rank = ring.size, ring.rank
    kv = torch.stack([k, v])
    acc_dt = _acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc_dt, device=q.device)
    dkv_handle = None
    acc = None
    for step in range(w):
        handle = ring.exchange(kv, _TAG_KV) if step + 1 < w else None
        qs, dq_i, ks, dk_i, dv_i = lay.bwd_step(dout, q, kv, out, lse, step, rank, w, causal)
        lay.add_o(dq, qs, dq_i)
        if step == 0:
            acc = torch.zeros(kv.shape, dtype=acc_dt, device=kv.device)
        else:
            acc = yield dkv_handle
        lay.add_kv(acc, ks, dk_i, dv_i)
        if w > 1:
            dkv_handle = ring.exchange(acc, _TAG_DKV)
        if handle is not None:
            kv = yield handle
    if dkv_handle is not None:
        acc = yield dkv_handle
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


# ---------------------------------------------------------------- autograd + API


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, lay, causal):
        out, lse = _drive(ring_forward_schedule(ring, lay, q, k, v, causal))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.lay, ctx.causal = ring, lay, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _drive(ring_backward_schedule(ctx.ring, ctx.lay, dout.contiguous(), q, k,
                                                   v, out, lse, ctx.causal))
        return dq, dk, dv, None, None, None


def _check_qkv(q, k, v, nd, what):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != nd:
            raise ValueError(f"{what}: {name} must be a {nd}-D tensor, got "
                             f"{getattr(t, 'shape', type(t))}")
    if k.shape != v.shape:
        raise ValueError(f"{what}: k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in all "
                         f"but the head dimension (the ring shards q and k/v alike)")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"{what}: h_q = {q.shape[-2]} must be a multiple of h_k = "
                         f"{k.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"{what}: q, k, v must share dtype and device, got "
                         f"{(q.dtype, k.dtype, v.dtype)} on {(q.device, k.device, v.device)}")


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, softcap: float = 0.0,
                   deterministic: bool = False, return_lse: bool = False):
    """Exact attention over a sequence zigzag-sharded across the ranks of ``group``.

    q [b, s_local, h_q, d], k, v [b, s_local, h_k, d] (h_q % h_k == 0): this rank's zigzag
    shard (zigzag_shard(x, rank, W), so s_local = 2 * S / (2W) for a global length S that
    must be divisible by 2W). Returns out [b, s_local, h_q, d] (and lse [b, h_q, s_local]
    fp32, the zigzag shard of the global lse, when return_lse). Differentiable in q, k, v.
    group: a torch.distributed process group (None = the default group); every rank of
    the group must call with the same shapes and options.
    """
    _check_qkv(q, k, v, 4, "ring_attention")
    if q.shape[1] % 2 != 0:
        raise ValueError(f"ring_attention: the local sequence length q.shape[1] must be even "
                         f"(zigzag: two chunks per rank; global length divisible by "
                         f"2 * world_size), got {q.shape[1]}")
    lay = _Dense(q, _scale(q, softmax_scale), float(softcap), bool(deterministic))
    ring = DistRing(group)
    out, lse = _RingAttention.apply(q, k, v, ring, lay, bool(causal))
    return (out, lse) if return_lse else out


def ring_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, group=None,
                          causal: bool = False, softmax_scale: Optional[float] = None,
                          softcap: float = 0.0, deterministic: bool = False,
                          return_lse: bool = False):
    """Ring attention over packed variable-length sequences, each zigzag-sharded on its own.

    q [t_local, h_q, d], k, v [t_local, h_k, d], cu_seqlens: this rank's local cumulative
    lengths (int32 [n+1], as returned by zigzag_shard_varlen; every global length divisible
    by 2W, so every local length is even). Returns out [t_local, h_q, d] (and lse
    [h_q, t_local] fp32 when return_lse). Sequences attend only to themselves.
    """
    _check_qkv(q, k, v, 3, "ring_attention_varlen")
    lay = _Varlen(q, cu_seqlens, _scale(q, softmax_scale), float(softcap), bool(deterministic))
    ring = DistRing(group)
    out, lse = _RingAttention.apply(q, k, v, ring, lay, bool(causal))
    return (out, lse) if return_lse else out


def emulated_layout(q: Tensor, cu_seqlens: Optional[Tensor] = None,
                    softmax_scale: Optional[float] = None, softcap: float = 0.0,
                    deterministic: bool = False):
    """The per-rank layout object the schedules take (dense when cu_seqlens is None)."""
    if cu_seqlens is None:
        if q.shape[1] % 2 != 0:
            raise ValueError(f"emulated_layout: local sequence length must be even, got "
                             f"{q.shape[1]}")
        return _Dense(q, _scale(q, softmax_scale), float(softcap), bool(deterministic))
    return _Varlen(q, cu_seqlens, _scale(q, softmax_scale), float(softcap), bool(deterministic))
