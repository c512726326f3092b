"""Block-sparse attention masks: the mask type and builders for common patterns.

A block-sparse mask (FlashAttention-4's BlockSparseTensors, FlexAttention's BlockMask)
tiles the (query, key) plane of each (batch, head) into blocks of block_size =
(block_q, block_k) elements and lists, for each query block m, the key blocks to visit:

    mask_block_cnt [B, H, M] int32, mask_block_idx [B, H, M, N] int32   partial blocks
    full_block_cnt, full_block_idx (optional, same layout)              full blocks

with M = ceil(s_q / block_q), N = ceil(s_k / block_k), B in {1, b}, H in {1, h_q}; only the
first cnt entries of each index row are read. Query i sees key j only when j's block is
listed in i's block row, and then

    full block:     always (no element rule: not even causal / window);
    partial block:  (the call's causal / window rule, or j < prefix_keys[b]) and, with
                    doc ids, q_doc_ids[b, i] == k_doc_ids[b, j].

Keys of unlisted blocks are never read; rows that see nothing have out 0 and lse -inf.
The library has no arbitrary mask_mod: the element rule of partial blocks is the call's
built-in masks plus the optional prefix and document ids, which make the patterns below
exact. Each builder returns a BlockSparseTensorsTorch and says which causal / window_size
the call must use with it. CPU backend, and the forward on CUDA (dense and varlen calls; varlen: the
grid of max_seqlen_q x max_seqlen_k per sequence, doc ids packed [total_q], [total_k]).

Builders take ints, numpy arrays or torch tensors. They return torch int32 tensors (on
``device``, or the device of a tensor argument) when torch is given, else numpy arrays
(for the numpy binding flashattn._C).

    document_mask(doc_ids, block_size, causal=True)          packed documents
    prefix_lm_mask(prefix_len, seqlen_q, seqlen_k, ...)      prefix-LM (call with causal=True)
    sliding_window_mask(seqlen_q, seqlen_k, window_left,
                        window_right=0, num_sink_tokens=0)   sliding window + sink tokens
    to_dense(mask, seqlen_q, seqlen_k, ...)                  the element mask it means
"""

from typing import NamedTuple, Optional, Tuple, Union

import numpy as np

try:  # torch is optional for this module
    import torch
except ImportError:  # pragma: no cover
    torch = None


class BlockSparseTensorsTorch(NamedTuple):
    """FlashAttention-4's BlockSparseTensorsTorch fields, plus the element-rule inputs of
    partial blocks (flashattn::BlockSparseTensors in C++). block_size: (block_q, block_k),
    an int for both, or None for (128, 128)."""

    mask_block_cnt: object
    mask_block_idx: object
    full_block_cnt: object = None
    full_block_idx: object = None
    block_size: Optional[Union[int, Tuple[int, int]]] = None
    q_doc_ids: object = None
    k_doc_ids: object = None
    prefix_keys: object = None


def block_sizes(block_size) -> Tuple[int, int]:
    """(block_q, block_k) of a block_size field: None -> (128, 128), n -> (n, n)."""
    if block_size is None:
        return 128, 128
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"flashattn: block_size: expected (block_q, block_k), got {block_size!r}")
        return int(block_size[0]), int(block_size[1])
    return int(block_size), int(block_size)


# ---------------------------------------------------------------- array helpers


def _is_torch(x) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def _np(x) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _output_device(device, *args):
    """The torch device to return tensors on, or None for numpy."""
    if device is not None:
        if torch is None:
            raise ValueError("flashattn: device= needs torch")
        return torch.device(device)
    for a in args:
        if _is_torch(a):
            return a.device
    return None


def _out(arr: np.ndarray, device):
    arr = np.ascontiguousarray(arr, dtype=np.int32)
    if device is None:
        return arr
    return torch.from_numpy(arr).to(device)


def _lists(kinds: np.ndarray, kind: int):
    """cnt [B, H, M] and idx [B, H, M, N] (listed blocks first, ascending; 0 after) of the
    blocks of `kind` in kinds [B, H, M, N]."""
    sel = kinds == kind
    cnt = sel.sum(axis=-1).astype(np.int32)
    idx = np.argsort(~sel, axis=-1, kind="stable").astype(np.int32)
    n = kinds.shape[-1]
    idx = np.where(np.arange(n) < cnt[..., None], idx, 0).astype(np.int32)
    return cnt, idx


def from_block_kinds(kinds, block_size=(128, 128), *, device=None, q_doc_ids=None,
                     k_doc_ids=None, prefix_keys=None) -> BlockSparseTensorsTorch:
    """A mask from kinds [B, H, M, N] (0 skip, 1 partial, 2 full; numpy or torch)."""
    dev = _output_device(device, kinds, q_doc_ids, k_doc_ids, prefix_keys)
    k = _np(kinds)
    if k.ndim != 4:
        raise ValueError(f"flashattn: kinds: expected [B, H, M, N], got shape {k.shape}")
    mcnt, midx = _lists(k, 1)
    fcnt, fidx = _lists(k, 2)
    conv = (lambda t: None if t is None else _out(_np(t), dev))
    return BlockSparseTensorsTorch(_out(mcnt, dev), _out(midx, dev), _out(fcnt, dev),
                                   _out(fidx, dev), block_sizes(block_size), conv(q_doc_ids),
                                   conv(k_doc_ids), conv(prefix_keys))


def _block_bounds(s: int, block: int):
    """First and last index of each block of a length-s axis: (lo [n], hi [n])."""
    n = -(-s // block)
    lo = np.arange(n, dtype=np.int64) * block
    hi = np.minimum(lo + block, s) - 1
    return lo, hi


def _window_kinds(s_q, s_k, bq, bk, left, right, prefix):
    """Kinds [M, N] of the rule visible(i, j) = j < prefix or window(left, right)(i, j),
    bottom-right aligned (left / right = -1: unbounded); partial blocks apply exactly this
    rule (call with window (left, right) and prefix_keys = prefix)."""
    qlo, qhi = _block_bounds(s_q, bq)
    klo, khi = _block_bounds(s_k, bk)
    off = s_k - s_q
    # Window bounds of the block's first / last rows: row i sees [i + off - left, i + off + right].
    lo_first = qlo[:, None] + off - (left if left >= 0 else 1 << 40)
    lo_last = qhi[:, None] + off - (left if left >= 0 else 1 << 40)
    hi_first = qlo[:, None] + off + (right if right >= 0 else 1 << 40)
    hi_last = qhi[:, None] + off + (right if right >= 0 else 1 << 40)
    kl, kh = klo[None, :], khi[None, :]
    # Every element in the window: each row's interval holds the block's keys.
    win_full = (lo_last <= kl) & (kh <= hi_first)
    # Some element in the window: the union of intervals (monotone in i) meets the block.
    win_any = (lo_first <= kh) & (kl <= hi_last) & (np.maximum(lo_first, kl) <= np.minimum(hi_last, kh))
    pre_full = kh < prefix
    pre_any = kl < prefix
    full = win_full | pre_full
    anyv = win_any | pre_any
    return np.where(full, 2, np.where(anyv, 1, 0)).astype(np.int8)


# ---------------------------------------------------------------- builders


def document_mask(doc_ids, block_size=(128, 128), causal: bool = True, *, device=None):
    """Document masking within a packed batch: doc_ids [b, s] or [s] (ints, one document id
    per token of a packed row; any order). Query i sees key j when both are in the same
    document (and, with causal, j <= i). Call with this causal (window_size (-1, -1)) and
    s_q = s_k = s. Blocks holding one document on both sides (and entirely below the
    diagonal when causal) are full; blocks whose documents do not meet are skipped."""
    dev = _output_device(device, doc_ids)
    docs = _np(doc_ids).astype(np.int64)
    if docs.ndim == 1:
        docs = docs[None]
    if docs.ndim != 2:
        raise ValueError(f"flashattn: doc_ids: expected [b, s] or [s], got shape {docs.shape}")
    b, s = docs.shape
    bq, bk = block_sizes(block_size)
    M, N = -(-s // bq), -(-s // bk)
    kinds = np.zeros((b, 1, M, N), dtype=np.int8)
    built_in = _window_kinds(s, s, bq, bk, -1, 0 if causal else -1, 0)
    for r in range(b):
        _, inv = np.unique(docs[r], return_inverse=True)
        D = int(inv.max()) + 1 if s else 0
        onehot = np.zeros((s, D), dtype=np.int64)
        onehot[np.arange(s), inv] = 1

        def per_block(block, nblocks):
            pad = nblocks * block - s
            oh = np.concatenate([onehot, np.zeros((pad, D), np.int64)]) if pad else onehot
            return oh.reshape(nblocks, block, D).sum(axis=1)  # token counts per (block, doc)

        cq, ck = per_block(bq, M), per_block(bk, N)
        meet = (cq > 0).astype(np.int64) @ (ck > 0).astype(np.int64).T > 0
        single_q = (cq > 0).sum(axis=1) == 1
        single_k = (ck > 0).sum(axis=1) == 1
        same = single_q[:, None] & single_k[None, :] & meet
        k = np.where(meet, np.minimum(built_in, 1), 0)
        k = np.where(same & (built_in == 2), 2, k)
        kinds[r, 0] = k
    docs32 = docs.astype(np.int32)
    return from_block_kinds(kinds, (bq, bk), device=dev, q_doc_ids=docs32, k_doc_ids=docs32)


def prefix_lm_mask(prefix_len, seqlen_q: int, seqlen_k: Optional[int] = None,
                   block_size=(128, 128), *, batch: Optional[int] = None, device=None):
    """Prefix-LM: query i sees key j when j < prefix_len[b] (the prefix, bidirectional) or
    j <= i + s_k - s_q (causal, bottom-right aligned). prefix_len: an int (every sequence;
    the lists broadcast over the batch, or are repeated `batch` times) or [b] ints (one
    list per sequence). Call with causal=True."""
    dev = _output_device(device, prefix_len)
    pre = np.atleast_1d(_np(prefix_len)).astype(np.int64)
    if batch is not None and pre.size == 1:
        pre = np.repeat(pre, batch)
    if pre.ndim != 1 or (pre < 0).any():
        raise ValueError(f"flashattn: prefix_len: expected ints >= 0 (an int or [b]), got {prefix_len!r}")
    s_k = seqlen_q if seqlen_k is None else seqlen_k
    bq, bk = block_sizes(block_size)
    kinds = np.stack([_window_kinds(seqlen_q, s_k, bq, bk, -1, 0, int(p))[None] for p in pre])
    return from_block_kinds(kinds, (bq, bk), device=dev, prefix_keys=pre.astype(np.int32))


def sliding_window_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int = 0,
                        num_sink_tokens: int = 0, block_size=(128, 128), *,
                        batch: Optional[int] = None, device=None):
    """Sliding window plus sink tokens (StreamingLLM): query i sees key j when
    j < num_sink_tokens or i + s_k - s_q - window_left <= j <= i + s_k - s_q + window_right
    (-1 = unbounded). Call with window_size=(window_left, window_right) (causal=False; a
    window_right of 0 is causal). The lists broadcast over batch and heads; batch=None gives
    prefix_keys [1] (every sequence), batch=b gives [b]."""
    dev = _output_device(device)
    if num_sink_tokens < 0:
        raise ValueError(f"flashattn: num_sink_tokens: expected >= 0, got {num_sink_tokens}")
    bq, bk = block_sizes(block_size)
    kinds = _window_kinds(seqlen_q, seqlen_k, bq, bk, window_left, window_right,
                          num_sink_tokens)[None, None]
    prefix = (np.full((batch or 1,), num_sink_tokens, dtype=np.int32) if num_sink_tokens
              else None)
    return from_block_kinds(kinds, (bq, bk), device=dev, prefix_keys=prefix)


# ---------------------------------------------------------------- the element mask


def to_dense(mask: BlockSparseTensorsTorch, seqlen_q: int, seqlen_k: int, *, batch: int,
             heads: int, causal: bool = False, window_size=(-1, -1)) -> np.ndarray:
    """The element mask [batch, heads, s_q, s_k] (bool, numpy) a call with this mask and these
    causal / window_size sees (the rule in this module's docstring); for checks and debugging
    (O(s_q * s_k) memory)."""
    bq, bk = block_sizes(mask.block_size)
    M, N = -(-seqlen_q // bq), -(-seqlen_k // bk)
    kinds = np.zeros((batch, heads, M, N), dtype=np.int8)
    for cnt_t, idx_t, kind in ((mask.mask_block_cnt, mask.mask_block_idx, 1),
                               (mask.full_block_cnt, mask.full_block_idx, 2)):
        if cnt_t is None:
            continue
        cnt = np.broadcast_to(_np(cnt_t), (batch, heads, M))
        idx = np.broadcast_to(_np(idx_t), (batch, heads, M, N))
        for b in range(batch):
            for h in range(heads):
                for m in range(M):
                    kinds[b, h, m, idx[b, h, m, : cnt[b, h, m]]] = kind
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diag = i + seqlen_k - seqlen_q
    rule = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        rule &= j >= diag - left
    if right >= 0:
        rule &= j <= diag + right
    block_kind = kinds[:, :, (i // bq)[:, 0]][:, :, :, (j // bk)[0]]  # [b, h, s_q, s_k]
    out = np.zeros((batch, heads, seqlen_q, seqlen_k), dtype=bool)
    for b in range(batch):
        r = rule.copy()
        if mask.prefix_keys is not None:
            pk = _np(mask.prefix_keys).reshape(-1)
            r |= j < int(pk[b if pk.size > 1 else 0])
        if mask.q_doc_ids is not None:
            r &= _np(mask.q_doc_ids)[b][:, None] == _np(mask.k_doc_ids)[b][None, :]
        out[b] = (block_kind[b] == 2) | ((block_kind[b] == 1) & r[None])
    return out
