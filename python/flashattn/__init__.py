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
    check_errors,
    cuda_available,
    get_kernel_family,
    set_kernel_family,
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
    "check_errors",
    "cuda_available",
    "get_kernel_family",
    "set_kernel_family",
    "kernel_family",
    "__version__",
    *_TORCH_NAMES,
]


class kernel_family:
    """Context manager (and decorator) that runs the calls inside it on one CUDA kernel
    family: ``with flashattn.kernel_family("sm80"): ...``. ``family`` is 'auto', 'sm80' or
    'sm90'; ``smem_cap`` caps the shared memory per block a configuration may use (0: the
    device's limit; e.g. 101376 runs the 99 KiB configurations of an RTX 4090 on an H100).
    The setting is process-wide (torch's autograd threads see it), restored on exit."""

    def __init__(self, family, smem_cap=0):
        self.family, self.smem_cap = family, smem_cap
        self._saved = []

    def __enter__(self):
        self._saved.append(get_kernel_family())
        set_kernel_family(self.family, self.smem_cap)
        return self

    def __exit__(self, *exc):
        set_kernel_family(*self._saved.pop())
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with kernel_family(self.family, self.smem_cap):
                return fn(*args, **kwargs)

        return wrapped


def __getattr__(name):
    if name in _TORCH_NAMES:
        from . import interface

        return getattr(interface, name)
    if name.startswith(("ring_attention", "zigzag_")):  # flashattn.ring: context parallelism
        return getattr(__import__(f"{__name__}.ring", fromlist=["ring"]), name)
    if name in ("interface", "flash_attn_interface", "ops", "rotary", "hf", "block_sparse"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashattn' has no attribute {name!r}")
