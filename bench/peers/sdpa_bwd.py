"""Peer for bench/cuda_bwd_bench.cpp: PyTorch SDPA's FLASH_ATTENTION backend backward on
the same grid (bf16, 16k tokens, model dim 2048, hdim 64/128/256, causal and not, seqlen
512..16k; FLOPs = 2.5 * 4 * b * h * s^2 * d, halved when causal), median of
triton.testing.do_bench. With --ours FILE (the C++ benchmark's output) it prints both and
the ratio ours / peer per cell.
"""
import argparse

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def peer_ms(b, s, h, d, causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = sdpa(q, k, v, is_causal=causal)
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="output of flashattn_cuda_bwd_bench")
    args = ap.parse_args()
    ours = {}
    if args.ours:
        for line in open(args.ours):
            f = line.split()
            if len(f) >= 6 and f[0] == "bwd":  # then "relerr X ok|FAIL"
                ours[(int(f[1]), int(f[2]), int(f[3]))] = float(f[5])
    print(f"# backward TFLOP/s, bf16, 16k tokens, model dim 2048 ({torch.cuda.get_device_name()},"
          f" torch {torch.__version__})")
    print("| hdim | causal | seqlen | ours | sdpa flash | ratio |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128, 256):
        for causal in (0, 1):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = 16384 // s, 2048 // d
                ms = peer_ms(b, s, h, d, bool(causal))
                flops = 2.5 * 4.0 * b * h * s * s * d / (2.0 if causal else 1.0)
                peer = flops / (ms * 1e-3) / 1e12
                mine = ours.get((d, causal, s))
                ratio = f"{mine / peer:.2f}" if mine else "-"
                mine_s = f"{mine:.1f}" if mine else "-"
                print(f"| {d} | {causal} | {s} | {mine_s} | {peer:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
