"""One decode call of each SDPA peer (FLASH_ATTENTION, CUDNN_ATTENTION) on the decode
grid's dense cache (bf16, batch 8, 32 query heads over 8 KV heads, hdim 128, one query
token), inside cudaProfilerStart/Stop, for `ncu --profile-from-start off`
(scripts/decode_probe.sh): what the peers' kernels read and how busy they keep DRAM and L2.

    python3 bench/peers/sdpa_decode_profile.py [context]
"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdpa_profile import profile_once  # bench/peers/, the script's own folder

B, HQ, HK, D = 8, 32, 8, 128


def main(ctx):
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            try:
                call = lambda: sdpa(q, k, v, enable_gqa=True)
                call()
            except RuntimeError:
                ke, ve = (x.repeat_interleave(HQ // HK, dim=1) for x in (k, v))
                call = lambda: sdpa(q, ke, ve)
                call()
            profile_once(call)
            print(f"{name}: profiled one call at context {ctx}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32768)
