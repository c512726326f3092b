"""flashattn: exact FlashAttention with a framework-free C++ core.

The extension ``flashattn._C`` binds the C++ API over DLPack arrays (numpy arrays, torch
tensors, ...). The torch layer (``flash_attn_func`` and friends, a drop-in for flash_attn
2.x) is imported on first use, so ``import flashattn`` works without torch.
"""

from ._C import (  # noqa: F401
    CudaError,
    DTypeError,
    Error,
    InvalidArgumentError,
    UnsupportedError,
    cuda_available,
)
from ._C import version as _version

__version__ = _version()

# The torch layer: flashattn.interface and its names, imported lazily (PEP 562).
_TORCH_NAMES = (
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "apply_rotary_emb",
)

__all__ = [
    "CudaError",
    "DTypeError",
    "Error",
    "InvalidArgumentError",
    "UnsupportedError",
    "cuda_available",
    "__version__",
    *_TORCH_NAMES,
]


def __getattr__(name):
    if name in _TORCH_NAMES:
        from . import interface

        return getattr(interface, name)
    if name.startswith(("ring_attention", "zigzag_")):  # flashattn.ring: context parallelism
        return getattr(__import__(f"{__name__}.ring", fromlist=["ring"]), name)
    if name in ("interface", "flash_attn_interface", "ops", "rotary", "hf"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashattn' has no attribute {name!r}")
