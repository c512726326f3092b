"""Decode KV-read bandwidth of PyTorch SDPA's CUDNN_ATTENTION and FLASH_ATTENTION backends on
the grid of bench/cuda_decode_bench.cpp: bf16, batch 8, 32 query heads over 8 KV heads,
hdim 128, one query token, dense caches of 4k / 32k / 128k keys. The cache is stored
[b, s, h_k, d] (as flashattn's) and viewed [b, h_k, s, d]; GQA through enable_gqa=True,
falling back to expanding the KV heads (a view-free repeat would read more bytes: the
expanded tensor is what the kernel reads, but only the stored bytes b*s*h_k*d*2*2 are
counted). Timed like the flashattn bench: CUDA events around 8 back-to-back calls rotating
over caches totalling >= 512 MiB, per call, median of 15 repeats after warm-up.

    python3 bench/peers/sdpa_decode.py [peer.csv]
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HQ, HK, D = 8, 32, 8, 128


def time_calls(fns, calls=8, repeats=15):
    for i in range(3 * calls):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, nxt = [], 0
    for _ in range(repeats):
        t0.record()
        for _ in range(calls):
            fns[nxt % len(fns)]()
            nxt += 1
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def main(path):
    rows = ["backend,ctx,us,tbps,gqa"]
    for ctx in (4096, 32768, 131072):
        kv_bytes = B * ctx * HK * D * 2 * 2
        n = max(1, min(4, (512 << 20) // kv_bytes + 1))
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        caches = [(torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
                   torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2))
                  for _ in range(n)]
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            mode = "enable_gqa"
            with sdpa_kernel(backend):
                def make(k, v, gqa):
                    if gqa:
                        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    ke, ve = (x.repeat_interleave(HQ // HK, dim=1) for x in (k, v))
                    return lambda: torch.nn.functional.scaled_dot_product_attention(q, ke, ve)
                try:
                    fns = [make(k, v, True) for k, v in caches]
                    fns[0]()
                except RuntimeError:
                    mode = "expanded"
                    fns = [make(k, v, False) for k, v in caches[:1]]
                try:
                    us = time_calls(fns)
                except RuntimeError as e:
                    print(f"{name} {ctx}: {e}".splitlines()[0])
                    continue
            tbps = kv_bytes / (us * 1e-6) / 1e12
            rows.append(f"{name},{ctx},{us:.2f},{tbps:.3f},{mode}")
            print(f"| sdpa {name} | {ctx} | {us:.1f} us | {tbps:.2f} TB/s | {mode} |", flush=True)
        del caches, q
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "peer_decode.csv")
