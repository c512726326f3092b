"""`import flash_attn` answered by flashattn, in one process, without touching a real
flash_attn installed beside it.

flashattn ships a small package named ``flash_attn`` in a directory of its own
(``shim_path()``), outside site-packages: it is importable only where that directory is
put on the module path, so an installed flash_attn stays what every other process imports.
Two ways to use it:

    # the whole process (a script or pytest run written for flash_attn):
    PYTHONPATH="$(python -m flashattn.compat)${PYTHONPATH:+:$PYTHONPATH}" python train.py

    # from code, before anything imports flash_attn:
    import flashattn.compat
    flashattn.compat.alias_flash_attn()
    import flash_attn            # flashattn's drop-in

The shim has what code written for flash_attn 2.x imports: the public functions
(``flash_attn.flash_attn_func``, ...), ``flash_attn.flash_attn_interface`` (with the private
``_flash_attn_forward`` family and ``flash_attn_gpu``), ``flash_attn.bert_padding``
(``pad_input``, ``unpad_input``, ``index_first_axis``) and
``flash_attn.layers.rotary.apply_rotary_emb``; nothing else of flash_attn (no
``flash_attn.modules``, ``flash_attn.ops``, ``flash_attn.cute``).
"""

import os
import sys
from typing import Optional

import torch
from torch import Tensor

from .rotary import apply_rotary_emb as _apply_rotary_emb

# flash_attn's version whose interface the shim follows.
FLASH_ATTN_VERSION = "2.8.3"
USE_TRITON_ROCM = False


def shim_path() -> str:
    """The directory holding the shim package ``flash_attn`` (for sys.path / PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")


def alias_flash_attn():
    """Make ``import flash_attn`` in this process import flashattn's shim. Raises
    RuntimeError when a flash_attn other than the shim is already imported (its modules
    are in use; replacing them would mix two libraries). Returns the shim module."""
    path = shim_path()
    loaded = sys.modules.get("flash_attn")
    if loaded is not None:
        if getattr(loaded, "__flashattn_shim__", False):
            return loaded
        raise RuntimeError(
            f"flashattn.compat.alias_flash_attn: flash_attn is already imported from "
            f"{getattr(loaded, '__file__', '?')}; call it before anything imports flash_attn")
    if path not in sys.path:
        sys.path.insert(0, path)
    import importlib

    importlib.invalidate_caches()
    module = importlib.import_module("flash_attn")
    if not getattr(module, "__flashattn_shim__", False):  # pragma: no cover (path order)
        raise RuntimeError(f"flashattn.compat.alias_flash_attn: import flash_attn found "
                           f"{module.__file__}, not the shim in {path}")
    return module


# ---------------------------------------------------------------- flash_attn.bert_padding


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """x[indices] over the flattened first axis (differentiable)."""
    return x.reshape(-1, *x.shape[1:])[indices]


def index_put_first_axis(values: Tensor, indices: Tensor, first_axis_dim: int) -> Tensor:
    """A zero tensor [first_axis_dim, ...] with rows `indices` set to values
    (differentiable in values)."""
    out = values.new_zeros((first_axis_dim,) + tuple(values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states: Tensor, attention_mask: Tensor,
                unused_mask: Optional[Tensor] = None):
    """flash_attn.bert_padding.unpad_input: hidden_states [b, s, ...], attention_mask [b, s]
    (bool / 0-1; unused_mask: slots that are allocated but not attended to) ->
    (hidden_states of the selected slots [total, ...], their flat indices [total],
    cu_seqlens int32 [b + 1], max_seqlen (int), seqused int32 [b] (attention_mask's count))."""
    selected = attention_mask.bool()
    if unused_mask is not None:
        selected = selected | unused_mask.bool()
    seqlens = selected.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(selected.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    b, s = hidden_states.shape[:2]
    flat = hidden_states.reshape(b * s, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """flash_attn.bert_padding.pad_input: the inverse of unpad_input, zeros elsewhere ->
    [batch, seqlen, ...]."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---------------------------------------------------------------- flash_attn.layers.rotary


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None) -> Tensor:
    """flash_attn.layers.rotary.apply_rotary_emb for dense x [b, s, h, d] (cu_seqlens
    unsupported); inplace writes the result into x as well."""
    if cu_seqlens is not None:
        from ._C import UnsupportedError

        raise UnsupportedError("flashattn.compat.apply_rotary_emb: argument 'cu_seqlens': "
                               "expected None (dense x [b, s, h, d]), got a tensor")
    out = _apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets)
    if inplace:
        x.copy_(out)
        return x
    return out


# ---------------------------------------------------------------- flash_attn_interface


def _get_block_size_n(device, head_dim, is_dropout, is_causal) -> int:
    """The key-block width of S_dmask's scaling, which flash_attn's tests use to normalise
    S_dmask back to probabilities: flash_attn's S_dmask holds exp(s_ij - m) with m the
    running row max at each key block of its kernels; flashattn's holds exp(s_ij - m_i)
    with m_i the max over the whole row, i.e. one block spanning every key: 2^31 - 1."""
    return (1 << 31) - 1


if __name__ == "__main__":
    print(shim_path())
