"""CPU backend, block-sparse masks: forward (and backward) time against the density of
visited 128 x 128 blocks (random blocks, half of them partial, half full, no causal), at
s = 4096 by default. The time should scale with the visited blocks.

    python bench/block_sparse_cpu.py [--seqlen 4096] [--heads 4] [--dim 64] [--threads 0]
                                     [--dtype bfloat16] [--backward] [--reps 3]
"""

import argparse
import time

import numpy as np
import torch

from flashattn import block_sparse as bsm
from flashattn import flash_attn_func


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads is not used; "
                    "OMP_NUM_THREADS sets the CPU backend's team")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    s, h, d = args.seqlen, args.heads, args.dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=g).to(dtype) for _ in range(3))
    if args.backward:
        for t in (q, k, v):
            t.requires_grad_()
    rng = np.random.default_rng(0)
    blocks = -(-s // 128)
    rows = []
    for density in (0.1, 0.5, 1.0):
        listed = rng.random((1, h, blocks, blocks)) < density
        kinds = np.where(listed, rng.integers(1, 3, size=listed.shape), 0)
        mask = bsm.from_block_kinds(torch.from_numpy(kinds), (128, 128))
        best = float("inf")
        for _ in range(args.reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            out = flash_attn_func(q, k, v, block_sparse_tensors=mask)
            if args.backward:
                out.sum().backward()
            best = min(best, time.perf_counter() - t0)
        rows.append((density, listed.mean(), best))
    base = rows[-1][2]
    what = "forward + backward" if args.backward else "forward"
    print(f"{what}, s = {s}, h = {h}, d = {d}, {args.dtype}, 128 x 128 blocks")
    print("density  visited  time (ms)  relative to 100%")
    for density, visited, t in rows:
        print(f"{density:7.0%}  {visited:7.1%}  {t * 1e3:9.1f}  {t / base:16.2f}")


if __name__ == "__main__":
    main()
