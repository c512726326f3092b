"""flash_attn.bert_padding as flashattn provides it (flashattn.compat)."""

from flashattn.compat import (  # noqa: F401
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
)
