"""fp8 (e4m3) helpers for FlashAttention-3-style fp8 attention (issue 21): quantization with
per-(sequence, KV head) descales, and an accuracy harness that measures the fp8 forward
against fp64 attention over the dequantized inputs, next to the bf16 forward's error on
the same (dequantized) inputs. The harness runs on any device the library runs on: CPU
tensors (the CPU backend) and CUDA tensors on an sm90 GPU (the fp8 kernel, which rounds P
to e4m3 for the P V product; python -m flashattn.fp8 --device cuda).
"""

import argparse
import math
from typing import Optional

import torch
from torch import Tensor

E4M3_MAX = 448.0


def quantize_e4m3(x: Tensor, h_k: int) -> tuple[Tensor, Tensor]:
    """x [b, s, h, d] (h a multiple of h_k) -> (e4m3 [b, s, h, d], descale fp32 [b, h_k]):
    descale[b, g] = amax / 448 over sequence b and the heads of KV head g's group (1 where
    all are 0), e4m3 = round-to-nearest(x / descale), so that float(e4m3) * descale
    approximates x (FlashAttention-3's q_descale / k_descale / v_descale)."""
    b, s, h, d = x.shape
    groups = x.float().reshape(b, s, h_k, h // h_k, d)
    amax = groups.abs().amax(dim=(1, 3, 4))
    descale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = groups / descale[:, None, :, None, None]
    x8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(b, s, h, d)
    return x8, descale.contiguous()


def dequantize_e4m3(x8: Tensor, descale: Tensor) -> Tensor:
    """The fp64 values of e4m3 [b, s, h, d] with descale [b, h_k]."""
    b, s, h, d = x8.shape
    h_k = descale.shape[1]
    ds = descale.double().repeat_interleave(h // h_k, dim=1)
    return x8.double() * ds[:, None, :, None]


def attention_fp64(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False) -> Tensor:
    """Plain fp64 attention, [b, s, h, d] layout, GQA by repetition (bottom-right causal)."""
    q, k, v = q.double(), k.double(), v.double()
    r = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(r, dim=2), v.repeat_interleave(r, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        s_q, s_k = q.shape[1], k.shape[1]
        i = torch.arange(s_q, device=q.device)[:, None] + s_k - s_q
        j = torch.arange(s_k, device=q.device)[None, :]
        s = s.masked_fill(j > i, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def make_inputs(b: int, s_q: int, s_k: int, h_q: int, h_k: int, d: int, outliers: bool,
                generator: torch.Generator, device="cpu") -> tuple[Tensor, Tensor, Tensor]:
    """bf16 q, k, v ~ N(0, 1); with outliers, 4 channels of q and k (the same for every head)
    scaled x50, as the outlier channels of real activations."""
    q = torch.randn(b, s_q, h_q, d, generator=generator)
    k = torch.randn(b, s_k, h_k, d, generator=generator)
    v = torch.randn(b, s_k, h_k, d, generator=generator)
    if outliers:
        channels = torch.randperm(d, generator=generator)[:4]
        q[..., channels] *= 50.0
        k[..., channels] *= 50.0
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v))


def measure(b=2, s_q=256, s_k=256, h_q=8, h_k=2, d=128, causal=False, outliers=False,
            seed=0, device="cpu", softmax_scale: Optional[float] = None) -> dict:
    """One accuracy measurement: bf16 inputs quantized to e4m3 per (batch, KV head); the fp8
    forward (bf16 out) and the bf16 forward on the dequantized inputs (rounded to bf16) are
    compared with fp64 attention over the dequantized inputs. Errors are max / mean
    absolute, and max relative to max |reference|."""
    from .interface import flash_attn_func

    g = torch.Generator().manual_seed(seed)
    q, k, v = make_inputs(b, s_q, s_k, h_q, h_k, d, outliers, g, device)
    (q8, qs), (k8, ks), (v8, vs) = (quantize_e4m3(t, h_k) for t in (q, k, v))
    qd, kd, vd = dequantize_e4m3(q8, qs), dequantize_e4m3(k8, ks), dequantize_e4m3(v8, vs)
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    ref = attention_fp64(qd, kd, vd, scale, causal)
    out8 = flash_attn_func(q8, k8, v8, softmax_scale=scale, causal=causal, q_descale=qs,
                           k_descale=ks, v_descale=vs)
    out16 = flash_attn_func(qd.to(torch.bfloat16), kd.to(torch.bfloat16), vd.to(torch.bfloat16),
                            softmax_scale=scale, causal=causal)
    # the quantization error itself: fp64 attention of the bf16 inputs vs of the dequantized
    ref_bf16_inputs = attention_fp64(q, k, v, scale, causal)
    m = ref.abs().max().item()

    def stats(out):
        err = (out.double() - ref).abs()
        return dict(max=err.max().item(), mean=err.mean().item(), rel_max=err.max().item() / m)

    quant = (ref_bf16_inputs - ref).abs()
    return dict(shape=(b, s_q, s_k, h_q, h_k, d), causal=causal, outliers=outliers,
                ref_max=m, fp8=stats(out8), bf16=stats(out16),
                quantization=dict(max=quant.max().item(), mean=quant.mean().item()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--s", type=int, default=256)
    a = p.parse_args(argv)
    print("| inputs | causal | max |ref| | fp8 max err | fp8 mean err | fp8 max/max|ref| "
          "| bf16 max err | bf16 mean err | quantization max (vs bf16 inputs) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for outliers in (False, True):
        for causal in (False, True):
            rows = [measure(s_q=a.s, s_k=a.s, d=a.d, causal=causal, outliers=outliers, seed=s,
                            device=a.device) for s in range(a.seeds)]
            worst = lambda key, f: max(r[key][f] for r in rows)  # noqa: E731
            print(f"| {'outliers x50' if outliers else 'N(0, 1)'} | {causal} | "
                  f"{max(r['ref_max'] for r in rows):.3g} | {worst('fp8', 'max'):.3g} | "
                  f"{worst('fp8', 'mean'):.3g} | {worst('fp8', 'rel_max'):.3g} | "
                  f"{worst('bf16', 'max'):.3g} | {worst('bf16', 'mean'):.3g} | "
                  f"{worst('quantization', 'max'):.3g} |")


if __name__ == "__main__":
    main()
