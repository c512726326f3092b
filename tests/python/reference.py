"""An fp64 numpy oracle of the function flashattn computes (docs/semantics.md), written
independently of the library: visibility, score order (scale, softcap, ALiBi, mask,
softmax), empty rows, Philox dropout, GQA, learnable sinks (one more logit per head in
every row's denominator, with no value), and the analytic backward."""

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on arrays of uint64 holding 32-bit words; returns the four words."""
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) & _MASK32 for x in (c0, c1, c2, c3))
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = _M0 * c0  # < 2^64: both factors are 32-bit
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        n0 = hi1 ^ c1 ^ np.uint64(k0)
        n2 = hi0 ^ c3 ^ np.uint64(k1)
        c0, c1, c2, c3 = n0, lo1, n2, lo0
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return c0, c1, c2, c3


def dropout_threshold(p):
    if not p > 0:
        return 0
    t = float(np.float32(p)) * 4294967296.0
    return 4294967295 if t >= 4294967295.0 else int(t)


def dropout_keep(p, seed, offset, bh, s_q, s_k):
    """Boolean [s_q, s_k]: which elements of (batch * h_q + head) = bh dropout keeps."""
    threshold = dropout_threshold(p)
    if threshold == 0:
        return np.ones((s_q, s_k), dtype=bool)
    i = np.arange(s_q, dtype=np.int64)[:, None] * np.ones((1, s_k), dtype=np.int64)
    j = np.arange(s_k, dtype=np.int64)[None, :] * np.ones((s_q, 1), dtype=np.int64)
    c0 = j >> 1
    c1 = ((i >> 4) << 3) | (i & 7)
    k0 = seed & 0xFFFFFFFF
    k1 = ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF
    words = philox4x32_10(c0, c1, np.full_like(c0, bh), np.full_like(c0, offset & 0xFFFFFFFF),
                          k0, k1)
    w = ((i >> 3) & 1) * 2 + (j & 1)
    bits = np.choose(w, words)
    return bits >= np.uint64(threshold)


def visible(s_q, s_k, causal=False, window=(-1, -1)):
    left, right = window
    if causal:
        right = 0
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    diag = i + s_k - s_q
    ok = np.ones((s_q, s_k), dtype=bool)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


class Head:
    """One (sequence, query head): q [s_q, d], k, v [s_k, d] in fp64, and its forward."""

    def __init__(self, q, k, v, scale, causal, window, softcap, slope, keep, p, sink=None,
                 mask=None, qv=None):
        self.q, self.k, self.v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        s_q, s_k = self.q.shape[0], self.k.shape[0]
        self.scale, self.softcap, self.p, self.keep = scale, softcap, p, keep
        dots = self.q @ self.k.T
        if qv is not None:  # MLA (FlashAttention-3's qv): q . k + qv . v
            dots = dots + np.asarray(qv, dtype=np.float64) @ self.v.T
        x = scale * dots
        if softcap > 0:
            self.capped = softcap * np.tanh(x / softcap)
            x = self.capped
        if slope != 0:
            i = np.arange(s_q)[:, None]
            j = np.arange(s_k)[None, :]
            x = x - slope * np.abs(i + s_k - s_q - j)
        self.mask = visible(s_q, s_k, causal, window) if mask is None else np.asarray(mask, bool)
        x = np.where(self.mask, x, -np.inf)
        self.sink = None if sink is None or sink == -np.inf else float(sink)
        if self.sink is not None:
            # The sink: one more term of every row's max and denominator, no value.
            m = np.maximum(x.max(axis=1, initial=-np.inf, keepdims=True), self.sink)
            e = np.where(self.mask, np.exp(x - m), 0.0)
            denom = e.sum(axis=1, keepdims=True) + np.exp(self.sink - m)
            self.P = e / denom
            self.lse = (m + np.log(denom))[:, 0]
        else:
            m = x.max(axis=1, initial=-np.inf, keepdims=True)
            empty = ~self.mask.any(axis=1, keepdims=True)
            m = np.where(empty, 0.0, m)
            e = np.where(self.mask, np.exp(x - m), 0.0)
            denom = e.sum(axis=1, keepdims=True)
            self.P = np.where(empty, 0.0, e / np.where(empty, 1.0, denom))
            self.lse = np.where(empty[:, 0], -np.inf,
                                (m + np.log(np.where(empty, 1.0, denom)))[:, 0])
        # Kept probabilities are scaled by 1 / (1 - p) computed in double from the fp32 p
        # (semantics::dropout_keep_scale): exact in an fp64 computation, rounded once to fp32
        # in an fp32 one (whose tolerances cover the difference).
        self.rp = 1.0 / (1.0 - float(np.float32(p)))
        self.Pd = self.P * keep * self.rp
        self.out = self.Pd @ self.v
        self.probs = self.P * keep

    def backward(self, dout):
        dout = np.asarray(dout, dtype=np.float64)
        dv = self.Pd.T @ dout
        dP = (dout @ self.v.T) * self.keep * self.rp
        D = (dout * self.out).sum(axis=1, keepdims=True)
        dS = self.P * (dP - D)
        if self.softcap > 0:
            dS = dS * (1.0 - (self.capped / self.softcap) ** 2)
        dx = self.scale * dS
        # The sink's score: dS_sink = P_sink * (0 - D) (it carries no value).
        dsink = 0.0 if self.sink is None else float(-(np.exp(self.sink - self.lse) * D[:, 0]).sum())
        return dx @ self.k, dx.T @ self.q, dv, dsink


def attention(q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, seed=0, offset=0, dout=None,
              cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, learnable_sink=None,
              element_mask=None, qv=None):
    """Dense q [b, s_q, h_q, d], k [b, s_k, h_k, d], v [b, s_k, h_k, d_v], or varlen
    (cu_seqlens given) q [total_q, h_q, d], k [total_k, h_k, d], v [total_k, h_k, d_v];
    qv (like q with d_v, forward only) adds qv . v to the scores and makes the default
    scale 1/sqrt(d + d_v). Returns a dict with out (d_v), lse, probs
    (dense [b, h_q, s_q, s_k]; varlen [h_q, total_q, max_seqlen_k]) and, with dout, dq,
    dk, dv (dk, dv summed over GQA groups) and, with learnable_sink [h_q], dsink [h_q].
    element_mask (dense only): bool [b, h_q, s_q, s_k] visibility replacing causal / window
    (a block-sparse mask's element mask)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    varlen = cu_seqlens_q is not None
    if varlen:
        seqs_q = [(int(a), int(b)) for a, b in zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])]
        seqs_k = [(int(a), int(b)) for a, b in zip(cu_seqlens_k[:-1], cu_seqlens_k[1:])]
        if seqused_k is not None:
            seqs_k = [(a, a + int(u)) for (a, _), u in zip(seqs_k, seqused_k)]
        h_q, d = q.shape[1], q.shape[2]
        h_k = k.shape[1]
        max_k = max([b - a for a, b in zip(cu_seqlens_k[:-1], cu_seqlens_k[1:])] + [0])
        out = np.zeros(q.shape[:-1] + v.shape[-1:])
        lse = np.zeros((h_q, q.shape[0]))
        probs = np.zeros((h_q, q.shape[0], max_k))
    else:
        b, s_q, h_q, d = q.shape
        s_k, h_k = k.shape[1], k.shape[2]
        seqs_q = [(i, i) for i in range(b)]
        out = np.zeros(q.shape[:-1] + v.shape[-1:])
        lse = np.zeros((b, h_q, s_q))
        probs = np.zeros((b, h_q, s_q, s_k))
    # Options carries softmax_scale and softcap as fp32: the oracle uses the same values.
    if qv is not None:
        qv = np.asarray(qv, dtype=np.float64)
    d_scale = d + (v.shape[-1] if qv is not None else 0)
    scale = float(np.float32(1.0) / np.sqrt(np.float32(d_scale)) if softmax_scale is None
                  else np.float32(softmax_scale))
    softcap = float(np.float32(softcap))
    grads = dout is not None
    if grads:
        dout = np.asarray(dout, dtype=np.float64)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    group = h_q // h_k
    sinks = None if learnable_sink is None else np.asarray(learnable_sink, dtype=np.float64)
    dsink = np.zeros(h_q)
    for bi in range(len(seqs_q)):
        for h in range(h_q):
            hk = h // group
            slope = 0.0
            if alibi_slopes is not None:
                a = np.asarray(alibi_slopes, dtype=np.float64)
                slope = a[h] if a.ndim == 1 else a[bi, h]
            if varlen:
                (q0, q1), (k0, k1) = seqs_q[bi], seqs_k[bi]
                qs, ks, vs = q[q0:q1, h], k[k0:k1, hk], v[k0:k1, hk]
                qvs = None if qv is None else qv[q0:q1, h]
            else:
                qs, ks, vs = q[bi, :, h], k[bi, :, hk], v[bi, :, hk]
                qvs = None if qv is None else qv[bi, :, h]
            keep = dropout_keep(dropout_p, seed, offset, bi * h_q + h, qs.shape[0], ks.shape[0])
            head = Head(qs, ks, vs, scale, causal, window, softcap, slope, keep, dropout_p,
                        None if sinks is None else sinks[h],
                        mask=None if element_mask is None else element_mask[bi, h], qv=qvs)
            if varlen:
                out[q0:q1, h] = head.out
                lse[h, q0:q1] = head.lse
                probs[h, q0:q1, : k1 - k0] = head.probs
            else:
                out[bi, :, h] = head.out
                lse[bi, h] = head.lse
                probs[bi, h] = head.probs
            if grads:
                if varlen:
                    g = head.backward(dout[q0:q1, h])
                    dq[q0:q1, h] += g[0]
                    dk[k0:k1, hk] += g[1]
                    dv[k0:k1, hk] += g[2]
                else:
                    g = head.backward(dout[bi, :, h])
                    dq[bi, :, h] += g[0]
                    dk[bi, :, hk] += g[1]
                    dv[bi, :, hk] += g[2]
                dsink[h] += g[3]
    result = dict(out=out, lse=lse, probs=probs)
    if grads:
        result.update(dq=dq, dk=dk, dv=dv)
        if sinks is not None:
            result.update(dsink=dsink)
    return result


def kvcache_attention(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None,
                      block_table=None, cache_batch_idx=None, cache_leftpad=None, **kw):
    """The KV-cache call on copies: returns (result dict, k_cache', v_cache') where the
    caches have k_new/v_new appended at cache_seqlens. With cache_leftpad, sequence i's
    keys start at cache position cache_leftpad[i] (flash_attn's left-padded cache)."""
    q = np.asarray(q, dtype=np.float64)
    kc = np.array(k_cache, dtype=np.float64)
    vc = np.array(v_cache, dtype=np.float64)
    b, s_q, h_q, d = q.shape
    s_new = 0 if k_new is None else k_new.shape[1]

    def location(i, t):  # (cache row or block, row within it) of key t of sequence i
        if block_table is not None:
            bs = kc.shape[1]
            return int(block_table[i][t // bs]), t % bs
        return (int(cache_batch_idx[i]) if cache_batch_idx is not None else i), t

    for i in range(b):
        for t in range(s_new):
            r, c = location(i, int(cache_seqlens[i]) + t)
            kc[r, c] = k_new[i, t]
            vc[r, c] = v_new[i, t]
    outs, lses = [], []
    for i in range(b):
        first = 0 if cache_leftpad is None else int(cache_leftpad[i])
        n = int(cache_seqlens[i]) + s_new - first
        rows = [location(i, first + t) for t in range(n)]
        ks = np.stack([kc[r, c] for r, c in rows])[None] if n else np.zeros((1, 0) + kc.shape[2:])
        vs = np.stack([vc[r, c] for r, c in rows])[None] if n else np.zeros((1, 0) + vc.shape[2:])
        alibi = kw.get("alibi_slopes")
        kwi = dict(kw)
        if kw.get("qv") is not None:
            kwi["qv"] = np.asarray(kw["qv"])[i : i + 1]
        if alibi is not None and np.asarray(alibi).ndim == 2:
            kwi["alibi_slopes"] = np.asarray(alibi)[i]
        res = attention(q[i : i + 1], ks, vs, **kwi)
        outs.append(res["out"][0])
        lses.append(res["lse"][0])
    return dict(out=np.stack(outs), lse=np.stack(lses)), kc, vc
