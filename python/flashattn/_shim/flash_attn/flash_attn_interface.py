"""flash_attn.flash_attn_interface as flashattn provides it (flashattn.flash_attn_interface)."""

from flashattn.compat import USE_TRITON_ROCM, _get_block_size_n  # noqa: F401
from flashattn.flash_attn_interface import (  # noqa: F401
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    apply_rotary_emb,
    flash_attn_func,
    flash_attn_gpu,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
