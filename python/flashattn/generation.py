"""A paged KV cache for transformers' generate(), attended by flash_attn_with_kvcache.

    import flashattn.hf
    from flashattn.generation import PagedKVCache
    flashattn.hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fused_attention")
    cache = PagedKVCache(model.config, batch_size=b, max_length=prompt_len + new_tokens)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                         max_new_tokens=new_tokens)

Each layer keeps a key pool and a value pool [num_blocks, block_size, h_k, d]; sequence i
owns the blocks block_table[i] (a shuffled permutation of the pool, so logical and
physical order differ). transformers' attention layers call `Cache.update` with the new
(already rotated) keys and values and then the attention function; `update` hands the new
tokens over unchanged and the "fused_attention" function (flashattn.hf) recognises them
and runs flash_attn_with_kvcache against the pools with the block table: the new keys and
values are appended in place by the call itself, and every query attends to its
sequence's cache (causal, bottom-right aligned). A left-padded chunk (the prompt of a
padded batch) is the exception: its valid tokens are written to their slots first (pad
tokens are never stored, so `cache_seqlens` counts real tokens only), then the same call
runs without append and the padded query rows are zeroed.

Greedy and sampled decoding work; beam search (reorder_cache) and cropping do not.
The cache is inference only (flash_attn_with_kvcache has no backward).
"""

import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import hf
from .interface import flash_attn_with_kvcache


class PagedLayer(CacheLayerMixin):
    """One layer's paged pools. `seen` counts the positions transformers has passed in
    (pads included: the mask and position ids are sized by it); `cache_seqlens` [b] int32
    counts the tokens stored per sequence (pads excluded)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, block_table: torch.Tensor, num_blocks: int, block_size: int):
        super().__init__()
        self.block_table = block_table
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.seen = 0
        self.cache_seqlens = None
        self.pending = None

    @property
    def capacity(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def lazy_initialization(self, key_states, value_states):
        batch, h_k, _, d = key_states.shape
        if batch != self.block_table.shape[0]:
            raise ValueError(f"flashattn.PagedKVCache: built for batch size {self.block_table.shape[0]}, "
                             f"called with {batch}")
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (self.num_blocks, self.block_size, h_k, d)
        self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=self.device)
        self.block_table = self.block_table.to(self.device)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states [b, h_k, s_new, d]: returned unchanged, and remembered
        for the attention call that follows (which writes them into the pools)."""
        if self.pending is not None:
            raise RuntimeError(
                "flashattn.PagedKVCache: the previous keys of this layer never reached the "
                "flashattn attention function (is attn_implementation the name that "
                "flashattn.hf.register() returned?)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen + key_states.shape[2] > self.capacity:
            raise ValueError(f"flashattn.PagedKVCache: {self.seen + key_states.shape[2]} positions "
                             f"exceed max_length = {self.capacity}")
        self.seen += key_states.shape[2]
        self.pending = key_states
        hf._paged_calls.pending = (self, key_states)
        return key_states, value_states

    def attend(self, query, key, value, attention_mask, softmax_scale, window_size, softcap,
               learnable_sink=None):
        """query [b, h_q, s_q, d], key/value [b, h_k, s_q, d] (the tokens of `update`);
        attention_mask None or the 2D padding mask [b, kv_len] (True = token);
        learnable_sink None or the [h_q] sink logits (gpt-oss's s_aux).
        Returns out [b, s_q, h_q, d]."""
        self.pending = None
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        batch, s_q = q.shape[0], q.shape[1]
        mask_q = None
        if attention_mask is not None:
            mask_q = attention_mask[:, -s_q:].to(device=q.device, dtype=torch.bool)
            if bool(mask_q.all()):
                mask_q = None
        kw = dict(block_table=self.block_table, softmax_scale=softmax_scale, causal=True,
                  window_size=window_size, softcap=softcap, learnable_sink=learnable_sink)
        if mask_q is None:
            out = flash_attn_with_kvcache(q, self.keys, self.values, k, v,
                                          cache_seqlens=self.cache_seqlens, **kw)
            self.cache_seqlens = self.cache_seqlens + s_q
            return out

        # Left padding: the valid tokens of a row are its last `counts` positions, so that
        # bottom-right alignment puts each valid query at its own key.
        counts = mask_q.sum(dim=1, dtype=torch.int32)
        t = torch.arange(s_q, device=q.device)
        pad = (s_q - counts).to(torch.long)
        if not bool(torch.equal(mask_q, t[None, :] >= pad[:, None])):
            raise ValueError("flashattn.PagedKVCache: only left padding is supported (the valid "
                             "tokens of each row must be its last ones)")
        position = self.cache_seqlens.to(torch.long)[:, None] + t[None, :] - pad[:, None]
        rows = torch.arange(batch, device=q.device)[:, None].expand(batch, s_q)[mask_q]
        position = position[mask_q]
        blocks = self.block_table[rows, position // self.block_size].to(torch.long)
        offsets = position % self.block_size
        self.keys[blocks, offsets] = k[mask_q]
        self.values[blocks, offsets] = v[mask_q]
        self.cache_seqlens = self.cache_seqlens + counts
        out = flash_attn_with_kvcache(q, self.keys, self.values,
                                      cache_seqlens=self.cache_seqlens, **kw)
        return out * mask_q[:, :, None, None].to(out.dtype)

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.seen = 0
        self.pending = None
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.cache_seqlens.zero_()

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("flashattn.PagedKVCache: beam search is not supported")

    def crop(self, tokens_to_remove):
        raise NotImplementedError("flashattn.PagedKVCache: cropping is not supported")

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError("flashattn.PagedKVCache: batch expansion is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("flashattn.PagedKVCache: batch selection is not supported")


class PagedKVCache(Cache):
    """A transformers Cache whose layers are paged pools read and appended by
    flash_attn_with_kvcache (see the module docstring).

    config: the model's config (layers, KV heads); batch_size: rows of the batch;
    max_length: positions per row, prompt (pads included) plus new tokens; block_size:
    keys per block; num_blocks: blocks per pool (default batch_size * blocks per row; more
    leaves unused blocks in the pool); generator: for the shuffled block table. The pools
    take the dtype and device of the first keys.
    """

    def __init__(self, config, batch_size: int, max_length: int, block_size: int = 16,
                 num_blocks: int = None, generator: torch.Generator = None):
        text_config = config.get_text_config(decoder=True)
        blocks_per_row = math.ceil(max_length / block_size)
        needed = batch_size * blocks_per_row
        num_blocks = needed if num_blocks is None else num_blocks
        if num_blocks < needed:
            raise ValueError(f"flashattn.PagedKVCache: num_blocks = {num_blocks} < {needed} "
                             f"(batch_size * ceil(max_length / block_size))")
        order = torch.randperm(num_blocks, generator=generator)[:needed]
        self.block_table = order.view(batch_size, blocks_per_row).to(torch.int32)
        self._config = config
        layers = [PagedLayer(self.block_table, num_blocks, block_size)
                  for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        implementation = getattr(self._config, "_attn_implementation", None)
        if implementation not in hf.registered_names():
            raise ValueError(
                "flashattn.PagedKVCache: the model's attn_implementation is "
                f"{implementation!r}; it must be a name registered by flashattn.hf.register() "
                f"({sorted(hf.registered_names())})")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
