"""Host cost per call of the torch forward path, layer by layer (tiny inputs, so that the
work in the backend is negligible next to the host path; on the GPU it times the host
side only, the kernels run asynchronously).

    python3 bench/host_overhead.py [--device cpu|cuda] [--calls 10000] [--rounds 3] [--seqlen 4] [--hdim 64]

Each line is the mean wall time of one call of that layer (best of the rounds), from the outside in:

    flash_attn_func            the drop-in interface (what bench/suite.py calls)
    ops.fwd (torch.library)    the custom op through torch's dispatcher (autograd, Python impl)
    ops.call(ops.fwd, ...)     what the interface calls: the implementation directly when the
                               dispatcher would add nothing (no autograd, compile, modes)
    ops.fwd implementation     the op's Python body called directly (outputs, options, _C)
    _C.forward (tensors)       the nanobind call with preallocated outputs, tensors passed as
                               they are (nanobind calls Tensor.__dlpack__ on each)
    _C.forward (capsules)      the same with DLPack capsules made by torch.utils.dlpack.to_dlpack
    ...                        and the pieces: output allocation, options, stream query;
                               then the forward with inputs requiring grad and the backward.

On the CPU, _C.forward includes the CPU backend's work for the tiny call (its OpenMP team
and buffers); bench/cuda_fwd_bench.cpp and the C++ API need no Python at all.
"""

import argparse
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --calls; the best is shown")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=4)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--hdim", type=int, default=64)
    ap.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default bf16 on CUDA, fp32 on CPU)")
    args = ap.parse_args(argv)

    import torch

    import flashattn
    from flashattn import _C, ops
    from flashattn.interface import flash_attn_func

    device = args.device or ("cuda" if torch.cuda.is_available() and flashattn.cuda_available()
                             else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device == "cuda" else "fp32")]
    b, s, h, d = args.batch, args.seqlen, args.heads, args.hdim
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype, device=device) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32, device=device)
    scale = d ** -0.5
    stream = ops._stream(q)
    cap = torch.utils.dlpack.to_dlpack
    impls = getattr(ops, "_IMPLS", None)  # the op's Python body (ops.call's direct path)
    impl = impls[ops.fwd][0] if impls else ops.fwd._init_fn
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    op_args = (q, k, v, None, None, scale, True, -1, -1, 0.0, 0.0, False, False)

    def bench(name, f):
        for _ in range(min(200, args.calls)):
            f()
        best = float("inf")
        for _ in range(args.rounds):  # the best round: the least disturbed by other processes
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            best = min(best, (time.perf_counter() - t0) / args.calls * 1e6)
        sync()
        us = best
        print(f"{name:44s} {us:9.2f} us", flush=True)

    print(f"flashattn {flashattn.__version__}, torch {torch.__version__}, {device}, "
          f"{str(dtype).replace('torch.', '')} [{b}, {s}, {h}, {d}] causal, "
          f"mean per call over {args.calls} calls, best of {args.rounds} rounds", flush=True)
    with torch.no_grad():
        bench("flash_attn_func", lambda: flash_attn_func(q, k, v, causal=True))
        bench("ops.fwd (torch.library)", lambda: ops.fwd(*op_args))
        if hasattr(ops, "call"):
            bench("ops.call(ops.fwd, ...)", lambda: ops.call(ops.fwd, *op_args))
        bench("ops.fwd implementation", lambda: impl(*op_args))
        bench("_C.forward (tensors)", lambda: _C.forward(
            q, k, v, out, lse, softmax_scale=scale, causal=True, stream=stream))
        bench("_C.forward (capsules)", lambda: _C.forward(
            cap(q), cap(k), cap(v), cap(out), cap(lse), softmax_scale=scale, causal=True,
            stream=stream))
        bench("  5 x Tensor.__dlpack__()", lambda: (q.__dlpack__(), k.__dlpack__(), v.__dlpack__(),
                                                    out.__dlpack__(), lse.__dlpack__()))
        bench("  5 x to_dlpack", lambda: (cap(q), cap(k), cap(v), cap(out), cap(lse)))
        bench("_C.backward_workspace_size (checks)", lambda: _C.backward_workspace_size(
            cap(q), cap(k), cap(v), softmax_scale=scale, causal=True, stream=stream))
        bench("outputs (_fwd_outputs)", lambda: ops._fwd_outputs(q, k, False))
        bench("options (_options)", lambda: ops._options(q, None, None, scale, True, -1, -1,
                                                         0.0, 0.0, False))
        bench("stream (_stream)", lambda: ops._stream(q))
        bench("3 x _prepare", lambda: (ops._prepare(q), ops._prepare(k), ops._prepare(v)))
    # With autograd: the forward goes through the op (it records the graph); the backward
    # (torch.autograd.grad over a retained graph, as bench/suite.py times it) runs the
    # autograd formula, which calls the bwd op.
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    bench("flash_attn_func, inputs requiring grad", lambda: flash_attn_func(qg, kg, vg, causal=True))
    og = flash_attn_func(qg, kg, vg, causal=True)
    bench("torch.autograd.grad (backward)", lambda: torch.autograd.grad(
        og, (qg, kg, vg), do, retain_graph=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
