"""One SDPA FLASH_ATTENTION forward or backward between cudaProfilerStart / Stop, for Nsight
Compute (scripts/profile.sh): bf16, 16k tokens, model dim 2048, non-causal. The backward
pass runs one forward first (outside the profiled range) and profiles torch.autograd.grad.
    python3 bench/peers/sdpa_profile.py fwd|bwd HDIM [SEQLEN]
"""
import argparse


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pass_", metavar="fwd|bwd", choices=("fwd", "bwd"), help="the pass to profile")
    p.add_argument("hdim", type=int)
    p.add_argument("seqlen", type=int, nargs="?", default=16384)
    return p.parse_args()


def profile_once(call):
    """call() once between cudaProfilerStart / Stop (for ncu --profile-from-start off), the
    GPU idle before and after; sdpa_decode_profile.py profiles its calls with it too."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main():
    args = parse_args()  # before importing torch, so a usage error needs no GPU or torch
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    bwd = args.pass_ == "bwd"
    d, s = args.hdim, args.seqlen
    b, h = max(1, 16384 // s), 2048 // d
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
               for _ in range(3))
    if bwd:
        dout = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    # the forward runs without autograd; the backward's forward must record the graph
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.set_grad_enabled(bwd):
        if bwd:
            out = sdpa(q, k, v)
            step = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        else:
            step = lambda: sdpa(q, k, v)
        for _ in range(3):
            step()
        profile_once(step)


if __name__ == "__main__":
    main()
