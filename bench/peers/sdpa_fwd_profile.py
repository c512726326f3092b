"""One SDPA FLASH_ATTENTION forward between cudaProfilerStart / Stop, for Nsight Compute
(scripts/fwd_profile.sh): bf16, 16k tokens, model dim 2048, non-causal.
    python3 bench/peers/sdpa_fwd_profile.py HDIM [SEQLEN]
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def main():
    d = int(sys.argv[1])
    s = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
    b, h = max(1, 16384 // s), 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        for _ in range(3):
            sdpa(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        sdpa(q, k, v)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
