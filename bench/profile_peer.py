"""One PyTorch SDPA call between cudaProfilerStart / Stop, for Nsight Compute's
`--profile-from-start off` (scripts/profile.sh): the peer's kernel of a pass.

    python3 bench/profile_peer.py fwd|bwd HDIM [SEQLEN]   FLASH_ATTENTION (FlashAttention-2):
        bf16, 16k tokens, model dim 2048, non-causal; bwd runs one forward first (outside the
        profiled range) and profiles torch.autograd.grad
    python3 bench/profile_peer.py --peer fa4 fwd|bwd HDIM [SEQLEN]   the same call through
        FlashAttention-4 (flash_attn.cute, ../shared/peers/README.md), q / k / v as [b, s, h, d]
    python3 bench/profile_peer.py decode [CONTEXT]        FLASH_ATTENTION, then CUDNN_ATTENTION,
        one call each on the decode grid's dense cache (bf16, batch 8, 32 query heads over 8 KV
        heads, hdim 128, one query token; default context 32768)
"""
import argparse


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=("fa2", "fa4"), default="fa2",
                   help="fwd/bwd: SDPA FLASH_ATTENTION (fa2, default) or FlashAttention-4 (fa4)")
    p.add_argument("--causal", action="store_true", help="fwd/bwd: a causal call")
    p.add_argument("pass_", metavar="fwd|bwd|decode", choices=("fwd", "bwd", "decode"))
    p.add_argument("sizes", type=int, nargs="*",
                   help="fwd/bwd: HDIM [SEQLEN] (default seqlen 16384); decode: [CONTEXT]")
    args = p.parse_args()
    if args.pass_ == "decode":
        if len(args.sizes) > 1:
            p.error("decode takes at most one size, the context")
    elif not 1 <= len(args.sizes) <= 2:
        p.error(f"{args.pass_} takes HDIM [SEQLEN]")
    if args.pass_ == "decode" and (args.peer != "fa2" or args.causal):
        p.error("decode profiles the SDPA peers only (no --peer, no --causal)")
    return args


def profile_once(call):
    """call() once between cudaProfilerStart / Stop, the GPU idle before and after."""
    import torch
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def prefill(torch, sdpa, pass_, d, s, seq_dim=2):
    """sdpa(q, k, v) on [b, h, s, d] tensors (seq_dim 2) or [b, s, h, d] ones (seq_dim 1)."""
    bwd = pass_ == "bwd"
    b, h = max(1, 16384 // s), 2048 // d
    shape = (b, h, s, d) if seq_dim == 2 else (b, s, h, d)
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
               for _ in range(3))
    # the forward runs without autograd; the backward's forward must record the graph
    with torch.set_grad_enabled(bwd):
        if bwd:
            dout = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            out = sdpa(q, k, v)
            step = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        else:
            step = lambda: sdpa(q, k, v)
        for _ in range(3):
            step()
        profile_once(step)


def decode(torch, sdpa, ctx, backends):
    B, HQ, HK, D = 8, 32, 8, 128
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, ctx, HK, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    for name, (backend, kernel) in backends.items():
        with kernel(backend):
            try:
                call = lambda: sdpa(q, k, v, enable_gqa=True)
                call()
            except RuntimeError:  # the query heads of a KV head as rows of that head
                qp = q.reshape(B, HK, HQ // HK, D)
                call = lambda: sdpa(qp, k, v)
                call()
            profile_once(call)
        print(f"{name}: profiled one call at context {ctx}", flush=True)


def main():
    args = parse_args()  # before importing torch, so a usage error needs no GPU or torch
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if args.pass_ == "decode":
        decode(torch, sdpa, args.sizes[0] if args.sizes else 32768,
               {"flash": (SDPBackend.FLASH_ATTENTION, sdpa_kernel),
                "cudnn": (SDPBackend.CUDNN_ATTENTION, sdpa_kernel)})
    elif args.peer == "fa4":
        from flash_attn.cute import interface as fa4

        def fa4_call(q, k, v):
            out = fa4.flash_attn_func(q, k, v, causal=args.causal)
            return out[0] if isinstance(out, tuple) else out

        prefill(torch, fa4_call, args.pass_, args.sizes[0],
                args.sizes[1] if len(args.sizes) > 1 else 16384, seq_dim=1)
    else:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            prefill(torch, lambda q, k, v: sdpa(q, k, v, is_causal=args.causal), args.pass_,
                    args.sizes[0], args.sizes[1] if len(args.sizes) > 1 else 16384)


if __name__ == "__main__":
    main()
