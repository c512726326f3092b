"""flash_attn as flashattn provides it (see flashattn.compat): not flash_attn itself."""

from flashattn.compat import FLASH_ATTN_VERSION
from flashattn.interface import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = FLASH_ATTN_VERSION
__flashattn_shim__ = True
