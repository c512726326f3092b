#!/usr/bin/env python3
"""Ring attention emulated on one device: W virtual ranks in one process.

Runs flashattn.ring's own forward and backward schedules (ring_forward_schedule /
ring_backward_schedule) for W virtual ranks over flashattn.ring.EmulatedRing, where a
transfer is a local copy into the next rank's mailbox and the ranks advance in lock-step
(run_emulated). Two parts:

  check  correctness on the device: out, lse, dq, dk, dv of the emulated ring (unsharded)
         against fp64 attention on the full sequence, under the FlashAttention rule of
         docs/semantics.md (error <= 2 * error of the naive unfused bf16 computation +
         2^-8 * max|ref|); single-process flashattn in bf16 is printed alongside.
  weak   the compute side of weak scaling: N tokens per virtual GPU, W GPUs, S = W * N,
         causal, zigzag. Every rank's share of the schedule is timed with CUDA events around
         its own segments (per-rank time); it is compared with single-GPU flashattn on the
         full sequence S (ideal per-rank time = t_full / W) and with single-GPU flashattn's
         throughput at N tokens (what a GPU reaches alone on its local length).
         Communication is not measured (there is one GPU): a real ring adds what the
         overlap fails to hide.

Writes JSON lines to --out (and a table to stdout). --device cpu runs a tiny version of
both parts on the CPU backend (a smoke test of this script).
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from flashattn import ops, ring

T0 = time.monotonic()


def log(rec, out):
    print(json.dumps(rec), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")


# ---------------------------------------------------------------- references


def math_attention(q, k, v, do, causal, scale, cu=None):
    """Unfused attention in q's dtype with autograd (S and P in that dtype): the fp64
    reference when q is fp64, the naive computation of the FlashAttention rule when bf16."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if cu is None:
        pieces = [(q, k, v, do)]
    else:
        b = cu.tolist()
        pieces = [(q[x:y][None], k[x:y][None], v[x:y][None], do[x:y][None])
                  for x, y in zip(b[:-1], b[1:]) if y > x]
    outs, lses = [], []
    for qq, kk, vv, dd in pieces:
        rep = qq.shape[2] // kk.shape[2]
        kk, vv = kk.repeat_interleave(rep, dim=2), vv.repeat_interleave(rep, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scale
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                              float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, vv)
        (o.double() * dd.double()).sum().backward()
        outs.append(o.detach())
        lses.append(torch.logsumexp(s.detach().double(), dim=-1))
    if cu is None:
        out, lse = outs[0], lses[0]
    else:
        out = torch.cat([o[0] for o in outs])
        lse = torch.cat([l[0] for l in lses], dim=1)
    return dict(out=out, lse=lse, dq=q.grad, dk=k.grad, dv=v.grad)


def flash_full(q, k, v, do, causal, scale, cu=None):
    if cu is None:
        out, lse, _ = ops.fwd(q, k, v, None, None, scale, causal, -1, -1, 0.0, 0.0, False, False)
        dq, dk, dv = ops.bwd(do, q, k, v, out, lse, None, None, scale, causal, -1, -1, 0.0, 0.0,
                             False)
    else:
        mx = int((cu[1:] - cu[:-1]).max())
        out, lse, _ = ops.varlen_fwd(q, k, v, cu, cu, None, None, None, mx, mx, scale, causal,
                                     -1, -1, 0.0, 0.0, False, False)
        dq, dk, dv = ops.varlen_bwd(do, q, k, v, out, lse, cu, cu, None, None, None, mx, mx,
                                    scale, causal, -1, -1, 0.0, 0.0, False)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


# ---------------------------------------------------------------- the emulated ring


class Timer:
    """CUDA events around each virtual rank's segments (wall clock on the CPU)."""

    def __init__(self, w, cuda):
        self.cuda, self.marks = cuda, [[] for _ in range(w)]

    def __call__(self, r, phase):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[r].append(ev)
        else:
            self.marks[r].append(time.perf_counter())

    def per_rank_ms(self):
        if self.cuda:
            torch.cuda.synchronize()
        res = []
        for m in self.marks:
            pairs = zip(m[0::2], m[1::2])
            if self.cuda:
                res.append(sum(a.elapsed_time(b) for a, b in pairs))
            else:
                res.append(sum(1e3 * (b - a) for a, b in pairs))
        return res


def emulate(q, k, v, do, w, causal, scale, cu=None, timed=False):
    """Shard, run the W forward and backward schedules, unshard. Returns (results dict,
    per-rank forward ms, per-rank backward ms) (times None unless timed)."""
    cuda = q.device.type == "cuda"
    if cu is None:
        sh = [[ring.zigzag_shard(t, r, w) for t in (q, k, v, do)] for r in range(w)]
        cus = [None] * w
    else:
        sh, cus = [], []
        for r in range(w):
            parts = [ring.zigzag_shard_varlen(t, cu, r, w) for t in (q, k, v, do)]
            sh.append([p[0] for p in parts])
            cus.append(parts[0][1])
    lays = [ring.emulated_layout(sh[r][0], cus[r], softmax_scale=scale) for r in range(w)]
    box = {}
    tf = Timer(w, cuda) if timed else None
    res = ring.run_emulated([ring.ring_forward_schedule(ring.EmulatedRing(r, w, box), lays[r],
                                                        *sh[r][:3], causal) for r in range(w)],
                            between=tf)
    tb = Timer(w, cuda) if timed else None
    grads = ring.run_emulated([ring.ring_backward_schedule(
        ring.EmulatedRing(r, w, box), lays[r], sh[r][3], *sh[r][:3], res[r][0], res[r][1],
        causal) for r in range(w)], between=tb)
    assert all(not m for m in box.values()), "unconsumed messages"
    if cu is None:
        un = ring.zigzag_unshard
        got = dict(out=un([x[0] for x in res]), lse=un([x[1] for x in res], dim=2),
                   dq=un([g[0] for g in grads]), dk=un([g[1] for g in grads]),
                   dv=un([g[2] for g in grads]))
    else:
        def un(xs, dim=0):
            return ring.zigzag_unshard_varlen(xs, cu, dim)
        got = dict(out=un([x[0] for x in res]), lse=un([x[1] for x in res], dim=1),
                   dq=un([g[0] for g in grads]), dk=un([g[1] for g in grads]),
                   dv=un([g[2] for g in grads]))
    if timed:
        return got, tf.per_rank_ms(), tb.per_rank_ms()
    return got, None, None


def maxerr(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---------------------------------------------------------------- parts


def check(args, dev, dt):
    cases = []
    s = args.check_seqlen
    for w in args.check_worlds:
        cases.append(dict(w=w, causal=True, hq=8, hk=2, s=s))
    cases.append(dict(w=4, causal=False, hq=8, hk=8, s=s))
    cases.append(dict(w=4, causal=True, hq=8, hk=2, lens=[s // 4, 8, s // 2, 3 * 8 * 5]))
    cases.append(dict(w=2, causal=False, hq=4, hk=1, lens=[s // 8, s // 4 + 4 * 3]))
    ok_all = True
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    for c in cases:
        w, d = c["w"], args.head_dim
        cu = None
        if "lens" in c:
            lens = c["lens"]
            total = sum(lens)
            cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))],
                              dtype=torch.int32, device=dev)
            shq, shk = (total, c["hq"], d), (total, c["hk"], d)
        else:
            shq, shk = (1, c["s"], c["hq"], d), (1, c["s"], c["hk"], d)
        q, k, v, do = (torch.randn(sh, generator=g).to(dev, dt) for sh in (shq, shk, shk, shq))
        scale = d ** -0.5
        got, _, _ = emulate(q, k, v, do, w, c["causal"], scale, cu)
        ref = math_attention(*(t.double() for t in (q, k, v, do)), c["causal"], scale, cu)
        naive = math_attention(q, k, v, do, c["causal"], scale, cu) if dt != torch.float64 else None
        flash = flash_full(q, k, v, do, c["causal"], scale, cu)
        rec = dict(part="check", **{kk: vv for kk, vv in c.items()}, dtype=str(dt), ok=True)
        for key in ("out", "lse", "dq", "dk", "dv"):
            err = maxerr(got[key], ref[key])
            top = ref[key].abs().max().item()
            if naive is not None:
                tol = 2 * maxerr(naive[key], ref[key]) + 2.0 ** -8 * top
            else:
                tol = 8 * 2.0 ** -23 * (1 + ref["lse"].abs().max().item()) * top
            rec[key] = dict(ring=err, flash=maxerr(flash[key], ref[key]), tol=tol)
            if not (err <= tol and math.isfinite(err)):
                rec["ok"] = False
        ok_all &= rec["ok"]
        log(rec, args.out)
    return ok_all


def fwd_flops(s, h, d, causal, b=1):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def time_full(q, k, v, do, causal, scale, reps, cuda):
    """median ms of single-GPU flashattn forward and backward on these tensors."""
    def once():
        if cuda:
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record()
            out, lse, _ = ops.fwd(q, k, v, None, None, scale, causal, -1, -1, 0.0, 0.0, False,
                                  False)
            e[1].record()
            ops.bwd(do, q, k, v, out, lse, None, None, scale, causal, -1, -1, 0.0, 0.0, False)
            e[2].record()
            torch.cuda.synchronize()
            return e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])
        t0 = time.perf_counter()
        out, lse, _ = ops.fwd(q, k, v, None, None, scale, causal, -1, -1, 0.0, 0.0, False, False)
        t1 = time.perf_counter()
        ops.bwd(do, q, k, v, out, lse, None, None, scale, causal, -1, -1, 0.0, 0.0, False)
        return 1e3 * (t1 - t0), 1e3 * (time.perf_counter() - t1)
    once()
    runs = [once() for _ in range(reps)]
    return (sorted(r[0] for r in runs)[len(runs) // 2], sorted(r[1] for r in runs)[len(runs) // 2])


def weak(args, dev, dt):
    cuda = dev.type == "cuda"
    hq, hk, d = args.heads, args.kv_heads, args.head_dim
    scale = d ** -0.5
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    base_at_n = {}
    for spec in args.weak:
        n, w = (int(x) for x in spec.split("x"))
        if time.monotonic() - T0 > args.budget:
            log(dict(part="weak", n=n, w=w, skipped="time budget"), args.out)
            continue
        s = n * w
        q, k, v, do = (torch.randn(sh).to(dev, dt) for sh in
                       ((1, s, hq, d), (1, s, hk, d), (1, s, hk, d), (1, s, hq, d)))
        full_f, full_b = time_full(q, k, v, do, True, scale, args.reps, cuda)
        if n not in base_at_n:
            qs, ks, vs, dos = (t[:, :n].contiguous() for t in (q, k, v, do))
            base_at_n[n] = time_full(qs, ks, vs, dos, True, scale, args.reps, cuda)
            del qs, ks, vs, dos
        n_f, n_b = base_at_n[n]
        emulate(q, k, v, do, w, True, scale, timed=False)  # warm-up
        fr, br = [], []
        for _ in range(args.reps):
            _, tf, tb = emulate(q, k, v, do, w, True, scale, timed=True)
            fr.append(tf)
            br.append(tb)
        # per rank: median over repetitions; then max and mean over ranks
        med = (lambda xs: sorted(xs)[len(xs) // 2])
        rank_f = [med([rep[r] for rep in fr]) for r in range(w)]
        rank_b = [med([rep[r] for rep in br]) for r in range(w)]
        ff = fwd_flops(s, hq, d, True)
        per_rank_f, per_rank_b = ff / w, 2.5 * ff / w
        rec = dict(
            part="weak", n=n, w=w, s=s, heads=hq, kv_heads=hk, head_dim=d,
            rank_fwd_ms_max=max(rank_f), rank_fwd_ms_min=min(rank_f),
            rank_bwd_ms_max=max(rank_b), rank_bwd_ms_min=min(rank_b),
            full_fwd_ms=full_f, full_bwd_ms=full_b, at_n_fwd_ms=n_f, at_n_bwd_ms=n_b,
            ring_fwd_tflops=per_rank_f / max(rank_f) / 1e9,
            ring_bwd_tflops=per_rank_b / max(rank_b) / 1e9,
            full_fwd_tflops=ff / full_f / 1e9, full_bwd_tflops=2.5 * ff / full_b / 1e9,
            at_n_fwd_tflops=fwd_flops(n, hq, d, True) / n_f / 1e9,
            at_n_bwd_tflops=2.5 * fwd_flops(n, hq, d, True) / n_b / 1e9,
        )
        rec["eff_fwd_vs_full"] = (full_f / w) / max(rank_f)
        rec["eff_bwd_vs_full"] = (full_b / w) / max(rank_b)
        rec["eff_fwd_vs_at_n"] = rec["ring_fwd_tflops"] / rec["at_n_fwd_tflops"]
        rec["eff_bwd_vs_at_n"] = rec["ring_bwd_tflops"] / rec["at_n_bwd_tflops"]
        log(rec, args.out)
        del q, k, v, do
        if cuda:
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", default="check,weak")
    ap.add_argument("--check-seqlen", type=int, default=2048)
    ap.add_argument("--check-worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--weak", nargs="+",
                    default=["32768x2", "32768x4", "32768x8", "65536x2", "65536x4", "131072x2"],
                    help="NxW: N tokens per virtual GPU, W virtual GPUs")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds after which the remaining weak-scaling configs are skipped")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dt = torch.bfloat16
    if dev.type == "cuda":
        log(dict(part="env", gpu=torch.cuda.get_device_name(), torch=torch.__version__), args.out)
    ok = True
    if "check" in args.parts:
        ok = check(args, dev, dt)
    if "weak" in args.parts:
        weak(args, dev, dt)
    print(f"check {'passed' if ok else 'FAILED'}; {time.monotonic() - T0:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
