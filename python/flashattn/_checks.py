"""Argument checks of the Python layer, raising the library's own error types with the
C++ library's message format: "<function>: argument '<name>': expected <e>, got <a>"."""

import operator

from ._C import InvalidArgumentError

INT32_MAX = (1 << 31) - 1


def invalid(function: str, argument: str, expected: str, actual, cls=InvalidArgumentError):
    """An InvalidArgumentError (a ValueError and a RuntimeError) with .function,
    .argument, .expected and .actual, like the ones the C++ library raises."""
    actual = str(actual)
    e = cls(f"{function}: argument '{argument}': expected {expected}, got {actual}")
    e.function, e.argument, e.expected, e.actual = function, argument, expected, actual
    return e


def shape_text(t) -> str:
    return "[" + ", ".join(str(int(n)) for n in t.shape) + "]"


def check_rank(function: str, argument: str, t, rank: int, layout: str) -> None:
    """t (a tensor or None) has the given rank and every size below 2^31 (the library's
    limit, checked here too: the outputs, sized from q, are allocated before the library
    sees the call); layout names the dimensions."""
    if t is None:
        return
    shape = t.shape
    if len(shape) != rank:
        raise invalid(function, argument, f"rank {rank} {layout}",
                      f"rank {t.dim()} (shape {shape_text(t)})")
    if rank and max(shape) > INT32_MAX:  # (one C-level pass on the hot path)
        for i, n in enumerate(shape):
            if n > INT32_MAX:
                raise invalid(function, argument, f"shape[{i}] < 2^31", int(n))


def check_head_dim(function: str, argument: str, t) -> None:
    if t.shape[-1] < 1:
        raise invalid(function, argument, f"shape[{t.dim() - 1}] >= 1 (head dim)",
                      int(t.shape[-1]))


def check_device(function: str, q, **tensors) -> None:
    """Every tensor given (None skipped) on q's device: the fake implementations and the
    library would otherwise see tensors on two devices (a CPU q with meta k and v)."""
    check_devices(function, q, tensors.items())


def check_devices(function: str, q, named) -> None:
    """check_device over (name, tensor or None) pairs (no keyword dict on the hot path)."""
    device = q.device
    for name, t in named:
        if t is not None and t.device != device:
            raise invalid(function, name, f"a tensor on {device} (the device of q)",
                          f"a tensor on {t.device}")


def check_int(function: str, argument: str, value, lo: int, hi: int) -> int:
    try:
        x = operator.index(value)
    except TypeError:
        raise invalid(function, argument, f"an int in [{lo}, {hi}]",
                      f"{value!r} of type {type(value).__name__}") from None
    if not lo <= x <= hi:
        raise invalid(function, argument, f"an int in [{lo}, {hi}]", x)
    return x


def window(function: str, window_size):
    """(left, right) from window_size, a pair of ints in [-1, 2^31 - 1] (-1 = unbounded)."""
    expected = f"a pair (left, right) of ints in [-1, {INT32_MAX}] (-1 = unbounded)"
    try:
        pair = tuple(window_size)
    except TypeError:
        raise invalid(function, "window_size", expected, repr(window_size)) from None
    try:
        left, right = (operator.index(x) for x in pair) if len(pair) == 2 else (None, None)
    except TypeError:
        left = right = None
    if left is None or not (-1 <= left <= INT32_MAX and -1 <= right <= INT32_MAX):
        raise invalid(function, "window_size", expected, repr(window_size))
    return left, right
