"""flash_attn.layers.rotary as flashattn provides it (flashattn.compat)."""

from flashattn.compat import apply_rotary_emb  # noqa: F401
