"""Rotary position embeddings, in torch, as flash_attn applies them.

flash_attn_with_kvcache rotates q and the new keys before the attention call; this module
is that rotation. cos, sin: [seqlen_ro, rotary_dim / 2]; the first rotary_dim features of
each head are rotated, the rest pass through.
  interleaved=False (GPT-NeoX): pairs (x[i], x[i + rotary_dim / 2]);
  interleaved=True  (GPT-J):    pairs (x[2i], x[2i + 1]).
The rotation is computed in fp32 (fp64 for fp64 inputs) and rounded once to x's dtype.
"""

from typing import Union

import torch
from torch import Tensor


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """x [b, s, h, d] rotated at positions [b, s] (indices into cos/sin rows)."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(
            f"flashattn: rotary_dim = 2 * cos.shape[-1] = {rotary_dim} exceeds the head dim "
            f"{x.shape[-1]}"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"flashattn: rotary_cos {tuple(cos.shape)} and rotary_sin "
                         f"{tuple(sin.shape)} differ in shape")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(compute)[positions].unsqueeze(2)  # [b, s, 1, half]
    s = sin.to(compute)[positions].unsqueeze(2)
    xr = x[..., :rotary_dim].to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def apply_rotary_emb(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    seqlen_offsets: Union[int, Tensor] = 0,
) -> Tensor:
    """flash_attn.layers.rotary.apply_rotary_emb for dense x [b, s, h, d]: token t of
    sequence i sits at position seqlen_offsets (+ [i]) + t. Returns a new tensor."""
    b, s = x.shape[0], x.shape[1]
    pos = torch.arange(s, device=x.device)
    if isinstance(seqlen_offsets, Tensor):
        pos = seqlen_offsets.to(device=x.device, dtype=torch.long)[:, None] + pos[None, :]
    else:
        pos = (pos + int(seqlen_offsets))[None, :].expand(b, s)
    return rotate(x, cos, sin, pos, interleaved)
