"""Forward throughput of PyTorch SDPA's FLASH_ATTENTION backend (FlashAttention-2) on the
standard grid (bf16, 16k tokens, model dim 2048, hdim 64/128/256, causal and not, seqlen
512..16k), median of triton.testing.do_bench, written as CSV like flashattn_cuda_fwd_bench.

    python3 bench/peers/sdpa_fwd.py peer.csv
"""
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS, MODEL_DIM = 16384, 2048


def main(path):
    rows = ["hdim,causal,seqlen,batch,heads,ms,tflops"]
    for d in (64, 128, 256):
        for causal in (0, 1):
            for s in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = TOKENS // s, MODEL_DIM // d
                # [b, s, h, d] storage viewed as [b, h, s, d], the layout our bench uses
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                           for _ in range(3))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                flops = 4.0 * b * h * s * s * d / (2.0 if causal else 1.0)
                rows.append(f"{d},{causal},{s},{b},{h},{ms:.5f},{flops / (ms * 1e-3) / 1e12:.2f}")
                del q, k, v
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "peer.csv")
