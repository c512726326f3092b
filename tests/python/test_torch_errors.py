"""Argument errors of the torch layer (issue 25) and their classes (issue 24): each names
the function, the argument, the expected and the actual value; argument errors are also
RuntimeErrors, as flash_attn's TORCH_CHECKs are. Skipped when torch is not installed."""

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

F64 = dict(dtype=torch.float64)


def qkv(*shape):
    return tuple(torch.zeros(*shape, **F64) for _ in range(3))


def cu(*lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def check(info, argument, *fragments):
    """The error names the argument and carries the library's attributes."""
    e = info.value
    assert isinstance(e, flashattn.InvalidArgumentError)
    assert isinstance(e, RuntimeError) and isinstance(e, ValueError)
    assert e.argument == argument, str(e)
    assert f"argument '{argument}': expected " in str(e)
    for f in fragments:
        assert f in str(e), (f, str(e))


# ------------------------------------------------------------------ ranks, head dim


@pytest.mark.parametrize("shape", [(4, 2, 8), (1, 1, 4, 2, 8)], ids=["rank3", "rank5"])
def test_flash_attn_func_q_of_wrong_rank(shape):
    q, _, _ = qkv(*shape)
    _, k, v = qkv(1, 4, 2, 8)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        flash_attn_func(q, k, v)
    check(info, "q", "rank 4", f"got rank {len(shape)}")


def test_varlen_q_of_wrong_rank():
    q, k, v = qkv(1, 4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_varlen_func(q, k, v, cu(4), cu(4), 4, 4)
    check(info, "q", "rank 3", "got rank 4")


def test_kvcache_q_of_wrong_rank():
    q, kc, vc = qkv(4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_with_kvcache(q, kc[None], vc[None], cache_seqlens=2)
    check(info, "q", "rank 4", "got rank 3")


def test_packed_layouts_are_checked():
    with pytest.raises(RuntimeError) as info:
        flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 8, **F64))
    check(info, "qkv", "shape[2] == 3", "got 2")
    with pytest.raises(RuntimeError) as info:
        flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 8, **F64), torch.zeros(1, 4, 2, 8, **F64))
    check(info, "kv", "rank 5", "got rank 4")
    with pytest.raises(RuntimeError) as info:
        flash_attn_varlen_qkvpacked_func(torch.zeros(4, 3, 2, **F64), cu(4), 4)
    check(info, "qkv", "rank 4", "got rank 3")


def test_head_dim_zero():
    q, k, v = qkv(1, 4, 2, 0)
    with pytest.raises(flashattn.InvalidArgumentError) as info:
        flash_attn_func(q, k, v)
    check(info, "q", "shape[3] >= 1 (head dim)", "got 0")


# ------------------------------------------------------------------ scalars


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (2 ** 31, -1), (-1, -2), 5, ("a", 1)],
                         ids=["1-tuple", "3-tuple", "2^31", "below-1", "int", "str"])
def test_window_size_is_a_pair_of_ints(window):
    q, k, v = qkv(1, 4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_func(q, k, v, window_size=window)
    check(info, "window_size", "a pair (left, right) of ints in [-1, 2147483647]",
          f"got {window!r}")
    assert info.value.function == "flashattn.flash_attn_func"


def test_window_size_in_varlen_and_kvcache():
    q, k, v = qkv(4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_varlen_func(q, k, v, cu(4), cu(4), 4, 4, window_size=(1, 2, 3))
    check(info, "window_size")
    q, kc, vc = qkv(1, 4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2, window_size=(2 ** 31, 0))
    check(info, "window_size", "got (2147483648, 0)")


@pytest.mark.parametrize("argument", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_above_int32(argument):
    q, k, v = qkv(4, 2, 8)
    lens = dict(max_seqlen_q=4, max_seqlen_k=4)
    lens[argument] = 2 ** 31
    with pytest.raises(RuntimeError) as info:
        flash_attn_varlen_func(q, k, v, cu(4), cu(4), **lens)
    check(info, argument, "an int in [0, 2147483647]", "got 2147483648")


def test_op_max_seqlen_above_int32_names_it():
    # The op passes the value on; the binding refuses it (not "incompatible arguments").
    q, k, v = qkv(4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        torch.ops.flashattn.varlen_fwd(q, k, v, cu(4), cu(4), None, None, None, 4, 2 ** 40,
                                       1.0, False, -1, -1, 0.0, 0.0, False, False)
    check(info, "max_seqlen_k", "got 1099511627776")


def test_int_cache_seqlens_above_int32():
    q, kc, vc = qkv(1, 4, 2, 8)
    with pytest.raises(RuntimeError) as info:
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=2 ** 31)
    check(info, "cache_seqlens", "an int in [0, 2147483647]")


# ------------------------------------------------------------------ KV cache


def test_rotary_cos_shorter_than_the_cache():
    q, kc, vc = qkv(1, 1, 2, 8)
    kc, vc = torch.zeros(1, 8, 2, 8, **F64), torch.zeros(1, 8, 2, 8, **F64)
    cos, sin = torch.ones(2, 4, **F64), torch.zeros(2, 4, **F64)
    with pytest.raises(RuntimeError) as info:
        flash_attn_with_kvcache(q, kc, vc, q.clone(), q.clone(), rotary_cos=cos,
                                rotary_sin=sin, cache_seqlens=5)
    check(info, "rotary_cos", "shape[0] >= 8", "got 2")
    with pytest.raises(RuntimeError) as info:
        flash_attn_with_kvcache(q, kc, vc, q.clone(), q.clone(), rotary_cos=torch.ones(8, 4, **F64),
                                rotary_sin=torch.zeros(8, 2, **F64), cache_seqlens=5)
    check(info, "rotary_sin", "shape [8, 4]", "got [8, 2]")


def test_int64_block_table_asks_for_int32():
    q = torch.zeros(1, 1, 2, 8, **F64)
    cache = torch.zeros(2, 4, 2, 8, **F64)
    table = torch.tensor([[1, 0]], dtype=torch.int64)
    with pytest.raises(flashattn.DTypeError) as info:
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=6, block_table=table)
    check(info, "block_table", "expected dtype int32, got dtype int64")
    assert isinstance(info.value, TypeError)
    assert info.value.function == "kvcache_forward"


def test_out_of_range_block_table_is_a_runtime_error():
    q = torch.zeros(1, 1, 2, 8, **F64)
    cache = torch.zeros(2, 4, 2, 8, **F64)
    table = torch.tensor([[1, 7]], dtype=torch.int32)
    try:
        flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=6, block_table=table)
    except RuntimeError as e:  # what code written for flash_attn catches
        assert isinstance(e, flashattn.InvalidArgumentError)
        assert e.argument == "block_table" and "got block_table[0][1] = 7" in str(e)
    else:
        pytest.fail("an out-of-range block table was accepted")


def test_k_without_v():
    q, kc, vc = qkv(1, 1, 2, 8)
    with pytest.raises(ValueError) as info:
        flash_attn_with_kvcache(q, kc, vc, k=q.clone(), cache_seqlens=0)
    check(info, "v", "got only k")


# ------------------------------------------------------------------ devices, fake tensors


def test_cpu_q_with_meta_k_is_refused_not_fake():
    # Dispatch picks the fake implementation for a meta k; it must not hand back
    # uninitialised CPU memory.
    q = torch.zeros(1, 4, 2, 8, **F64)
    k = v = torch.zeros(1, 4, 2, 8, device="meta", **F64)
    with pytest.raises(RuntimeError) as info:
        torch.ops.flashattn.fwd(q, k, v, None, None, 1.0, False, -1, -1, 0.0, 0.0, False, False)
    check(info, "k", "a tensor on cpu (the device of q)", "got a tensor on meta")
    with pytest.raises(RuntimeError) as info:
        flash_attn_func(q, k, v)
    check(info, "k")


def test_meta_inputs_still_give_shapes():
    q = torch.zeros(2, 5, 4, 8, device="meta", **F64)
    k = torch.zeros(2, 7, 2, 8, device="meta", **F64)
    out, lse, probs = torch.ops.flashattn.fwd(q, k, k, None, None, 1.0, False, -1, -1, 0.0,
                                              0.0, False, False)
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (2, 4, 5)


def test_every_op_checks_devices():
    q, k, v = qkv(4, 2, 8)
    meta = torch.zeros(2, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError) as info:
        torch.ops.flashattn.varlen_fwd(q, k, v, cu(4), meta, None, None, None, 4, 4, 1.0,
                                       False, -1, -1, 0.0, 0.0, False, False)
    check(info, "cu_seqlens_k", "got a tensor on meta")
    q, kc, vc = qkv(1, 1, 2, 8)
    with pytest.raises(RuntimeError) as info:
        torch.ops.flashattn.kvcache_fwd(q, kc, vc, torch.zeros(1, dtype=torch.int32, device="meta"),
                                        None, None, None, None, None, 1.0, False, -1, -1, 0.0, 0)
    check(info, "cache_seqlens", "got a tensor on meta")
    q, k, v = qkv(1, 4, 2, 8)
    lse = torch.zeros(1, 2, 4, dtype=torch.float32, device="meta")
    with pytest.raises(RuntimeError) as info:
        torch.ops.flashattn.bwd(q, q, k, v, q, lse, None, None, 1.0, False, -1, -1, 0.0, 0.0,
                                False)
    check(info, "lse", "got a tensor on meta")
