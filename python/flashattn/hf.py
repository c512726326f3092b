"""flashattn as a Hugging Face transformers attention implementation.

    import flashattn.hf
    flashattn.hf.register()                     # name "fused_attention"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fused_attention")

(transformers treats every implementation name containing "flash" as a flash-attention
kernel to load from its hub, hence a name without it.)

The attention function follows transformers' flash-attention integration: the mask
interface hands it None (no padding: dense flash_attn_func) or the 2D padding mask
[b, kv_len] (True = token), in which case the valid tokens are gathered into packed
sequences for flash_attn_varlen_func and the output is scattered back (zeros at padded
query positions). sliding_window w becomes window_size (w - 1, w - 1) with causal masking,
softcap and scaling pass through. Attention sinks: the s_aux keyword (gpt-oss passes its
module's `sinks` parameter, [h_q], as s_aux=self.sinks) becomes learnable_sink, with its
gradient in training.

With a flashattn.generation.PagedKVCache as past_key_values, the cache hands the new keys
and values over unchanged and this function attends them through flash_attn_with_kvcache
against the cache's paged pools (see flashattn/generation.py).
"""

import threading

import torch

from .interface import flash_attn_func, flash_attn_varlen_func

NAME = "fused_attention"

_registered = set()

# The (PagedLayer, key tensor) of the last PagedKVCache.update on this thread: the
# attention call that receives exactly that key tensor runs on the paged cache.
_paged_calls = threading.local()


def registered_names():
    """The names register() has registered in this process."""
    return frozenset(_registered)


def _take_paged_layer(key):
    pending = getattr(_paged_calls, "pending", None)
    if pending is None or pending[1] is not key:
        return None
    _paged_calls.pending = None
    return pending[0]


def _unpad(x, index, batch, length):
    """x [b, s, h, d] -> [total, h, d], the tokens of `index` (flattened b*s positions)."""
    return x.reshape(batch * length, *x.shape[2:]).index_select(0, index)


def _cu_seqlens(mask):
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return cu, int(lengths.max()) if lengths.numel() else 0


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention signature: query [b, h_q, s_q, d], key/value [b, h_k, s_k, d];
    returns (out [b, s_q, h_q, d], None)."""
    paged = _take_paged_layer(key)
    if paged is not None:
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
        return paged.attend(query, key, value, attention_mask, scaling, window,
                            softcap or 0.0, s_aux), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    kw = dict(dropout_p=dropout if module.training else 0.0, softmax_scale=scaling,
              causal=bool(causal), window_size=window, softcap=softcap or 0.0,
              learnable_sink=s_aux)
    if attention_mask is None:
        return flash_attn_func(q, k, v, **kw), None
    if attention_mask.dim() != 2:
        raise ValueError("flashattn: expected a 2D padding mask [b, kv_len] (register the "
                         f"mask function too), got shape {tuple(attention_mask.shape)}")
    b, s_q, s_k = q.shape[0], q.shape[1], k.shape[1]
    mask_k = attention_mask[:, -s_k:].to(torch.bool)
    mask_q = mask_k[:, -s_q:]
    index_q = mask_q.flatten().nonzero().flatten()
    index_k = mask_k.flatten().nonzero().flatten()
    cu_q, max_q = _cu_seqlens(mask_q)
    cu_k, max_k = _cu_seqlens(mask_k)
    out = flash_attn_varlen_func(_unpad(q, index_q, b, s_q), _unpad(k, index_k, b, s_k),
                                 _unpad(v, index_k, b, s_k), cu_q, cu_k, max_q, max_k, **kw)
    full = out.new_zeros(b * s_q, *out.shape[1:]).index_copy(0, index_q, out)
    return full.view(b, s_q, *out.shape[1:]), None


def register(name: str = NAME) -> str:
    """Registers the attention function and its mask function (transformers' flash-attention
    mask: None or the 2D padding mask) under `name`; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(name, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    _registered.add(name)
    return name
