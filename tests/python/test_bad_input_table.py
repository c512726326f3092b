"""Bad input as a table (issue 24), through the torch layer on CPU tensors: every row
mutates one valid baseline call of flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache (or the varlen op, for seqused_k, which flash_attn_varlen_func
does not take) and asserts (1) the error class, (2) that the message names the argument
with its expected and actual value, and (3) that no tensor of the call was written (the
KV caches are the outputs that a call writes in place; they are compared bytewise, as
are all inputs). test_torch_errors.py holds the one-case-per-test suite of the torch
layer. The valid edge cases (empty batch, zero lengths, a non-unit last stride, element
offsets past 2^31) are rows that compare the result to the fp64 reference."""

import mmap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import reference as ref  # noqa: E402
from flashattn import (  # noqa: E402
    InvalidArgumentError,
    UnsupportedError,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from flashattn import ops  # noqa: E402

F64 = torch.float64
F8 = torch.float8_e4m3fn
B, S_Q, S_K, H_Q, H_K, D = 2, 5, 7, 4, 2, 8


def rand(*shape, dtype=F64):
    return torch.randn(*shape, generator=_gen, dtype=torch.float64).to(dtype)


_gen = torch.Generator().manual_seed(24)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def baseline(entry):
    """The valid call of an entry point: (function, kwargs)."""
    if entry == "func":
        return flash_attn_func, dict(q=rand(B, S_Q, H_Q, D), k=rand(B, S_K, H_K, D),
                                     v=rand(B, S_K, H_K, D))
    if entry == "varlen":
        # q lengths 2, 0, 5 (total 7); k lengths 3, 4, 1 (total 8)
        return flash_attn_varlen_func, dict(
            q=rand(7, H_Q, D), k=rand(8, H_K, D), v=rand(8, H_K, D),
            cu_seqlens_q=i32(0, 2, 2, 7), cu_seqlens_k=i32(0, 3, 7, 8),
            max_seqlen_q=5, max_seqlen_k=4)
    if entry == "varlen_op":
        def varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                      max_seqlen_k):
            return ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, None, None,
                                  max_seqlen_q, max_seqlen_k, D ** -0.5, False, -1, -1, 0.0,
                                  0.0, False, False)
        _, kw = baseline("varlen")
        return varlen_op, dict(kw, seqused_k=i32(3, 0, 1))
    if entry == "kvcache":
        # dense cache [3, 16, h_k, d] holding 5 and 9 keys; 2 new keys each
        return flash_attn_with_kvcache, dict(
            q=rand(B, 1, H_Q, D), k_cache=rand(3, 16, H_K, D), v_cache=rand(3, 16, H_K, D),
            k=rand(B, 2, H_K, D), v=rand(B, 2, H_K, D), cache_seqlens=i32(5, 9))
    raise ValueError(entry)


def paged(kw):
    """The kvcache baseline on a paged cache: 6 blocks of 4 rows, 4 blocks per sequence
    (7 and 11 keys after the append: blocks 0, 2 and 1, 3, 5 are used)."""
    kw["k_cache"], kw["v_cache"] = rand(6, 4, H_K, D), rand(6, 4, H_K, D)
    kw["block_table"] = torch.tensor([[0, 2, -1, -1], [1, 3, 5, 99]], dtype=torch.int32)


def paged_varlen(kw):
    """The varlen baseline on a paged k, v: 6 blocks of 2 rows, 2 blocks per sequence
    (key counts 3, 4, 1 from cu_seqlens_k)."""
    kw["k"], kw["v"] = rand(6, 2, H_K, D), rand(6, 2, H_K, D)
    kw["block_table"] = i32(4, 0, 5, 2, 1, 3).reshape(3, 2)


def setter(**changes):
    def mutate(kw):
        kw.update({name: (f(kw) if callable(f) else f) for name, f in changes.items()})
    return mutate


def all_to(dtype, *names):
    return setter(**{n: (lambda kw, n=n: kw[n].to(dtype)) for n in names})


def with_head_dim(d):
    def mutate(kw):
        for n in ("q", "k", "v"):
            t = kw[n]
            kw[n] = rand(*t.shape[:-1], d)
    return mutate


def then(*mutations):
    def mutate(kw):
        for m in mutations:
            m(kw)
    return mutate


def block_mask(cnt=(2, 1), idx=((1, 0), (0, -5)), block_size=(4, 4), **extra):
    """A block-sparse mask for the func baseline (s_q = 5, s_k = 7, 4 x 4 blocks: M = N = 2)."""
    from flashattn.block_sparse import BlockSparseTensorsTorch

    def make(kw):
        return BlockSparseTensorsTorch(torch.tensor([[list(cnt)]], dtype=torch.int32),
                                       torch.tensor([[list(map(list, idx))]], dtype=torch.int32),
                                       block_size=block_size, **extra)
    return make


META = torch.device("meta")
E = InvalidArgumentError
U = UnsupportedError
IMAX = 2**31 - 1

# (name, entry, mutation, error class, argument, expected fragment, actual fragment)
ROWS = [
    # -------------------------------------------------------------- dtypes
    ("q_k_v_int32", "func", all_to(torch.int32, "q", "k", "v"), E, "q", "a floating-point dtype", "int32"),
    # fp8 q, k, v (issue 21): FlashAttention-3's descales fp32 [b, h_k], out bf16 / fp16
    ("fp8_out_dtype_float32", "func", then(all_to(F8, "q", "k", "v"), setter(out_dtype=torch.float32)), E, "out_dtype", "torch.bfloat16 or torch.float16", "torch.float32"),
    ("fp8_mixed_k_float64", "func", all_to(F8, "q", "v"), E, "k", "dtype float8_e4m3 (same as q)", "float64"),
    ("fp8_q_descale_h_q", "func", then(all_to(F8, "q", "k", "v"), setter(q_descale=torch.ones(B, H_Q))), E, "q_descale", "shape [2, 2] ([b, h_k]", "[2, 4]"),
    ("fp8_k_descale_float64", "func", then(all_to(F8, "q", "k", "v"), setter(k_descale=torch.ones(B, H_K, dtype=F64))), E, "k_descale", "dtype float32", "float64"),
    ("descale_without_fp8", "func", setter(v_descale=torch.ones(B, H_K)), E, "v_descale", "an undefined tensor when q is not float8_e4m3", "float64"),
    ("fp8_dropout_1", "func", then(all_to(F8, "q", "k", "v"), setter(dropout_p=1.0)), E, "dropout_p", "a value in [0, 1)", "1"),
    ("fp8_qv", "func", then(all_to(F8, "q", "k", "v"), setter(qv=lambda kw: kw["q"])), U, "qv", "None with float8_e4m3fn q, k, v", "a tensor of shape [2, 5, 4, 8]"),
    ("fp8_bs_count_above_n", "func", then(all_to(F8, "q", "k", "v"), setter(block_sparse_tensors=block_mask(cnt=(3, 1)))), E, "block_sparse_tensors.mask_block_cnt", "counts in [0, N = ceil(s_k / block_size_k) = ceil(7 / 4) = 2]", "3"),
    ("varlen_fp8_descale_shape", "varlen", then(all_to(F8, "q", "k", "v"), setter(v_descale=torch.ones(B, H_K))), E, "v_descale", "shape [3, 2]", "[2, 2]"),
    ("varlen_fp8_seqused_q_wrong_length", "varlen", then(all_to(F8, "q", "k", "v"), setter(seqused_q=i32(2, 0))), E, "seqused_q", "shape [3]", "[2]"),
    ("varlen_fp8_seqused_q_above_seqlen", "varlen", then(all_to(F8, "q", "k", "v"), setter(seqused_q=i32(2, 0, 6))), E, "seqused_q", "seqused_q[2] in [0, 5]", "seqused_q[2] = 6"),
    ("varlen_fp8_block_table_out_of_range", "varlen", then(paged_varlen, all_to(F8, "q", "k", "v"), setter(block_table=i32(4, 0, 5, 6, 1, 3).reshape(3, 2))), E, "block_table", "used entries in [0, 6)", "block_table[1][1] = 6"),
    ("varlen_fp8_block_table_descale_shape", "varlen", then(paged_varlen, all_to(F8, "q", "k", "v"), setter(k_descale=torch.ones(6, H_K))), E, "k_descale", "shape [3, 2]", "[6, 2]"),
    # fp8 q over an fp8 cache (FlashAttention-3's flash_attn_with_kvcache): descales [b, h_k]
    ("kv_fp8_q_float64_cache", "kvcache", then(all_to(F8, "q"), setter(k=None, v=None)), E, "k_cache", "dtype float8_e4m3 (q is float8_e4m3", "float64"),
    ("kv_fp8_q_k_scale", "kvcache", then(all_to(F8, "q", "k_cache", "v_cache", "k", "v"), setter(k_scale=torch.ones(H_K), v_scale=torch.ones(H_K))), E, "k_scale", "an undefined tensor (q is float8_e4m3", "shape [2]"),
    ("kv_fp8_k_descale_shape", "kvcache", then(all_to(F8, "q", "k_cache", "v_cache", "k", "v"), setter(k_descale=torch.ones(3, H_K))), E, "k_descale", "shape [2, 2] ([b, h_k]", "[3, 2]"),
    ("kv_fp8_v_descale_float64", "kvcache", then(all_to(F8, "q", "k_cache", "v_cache", "k", "v"), setter(v_descale=torch.ones(B, H_K, dtype=F64))), E, "v_descale", "dtype float32", "float64"),
    ("kv_fp8_out_dtype_float32", "kvcache", then(all_to(F8, "q", "k_cache", "v_cache", "k", "v"), setter(out_dtype=torch.float32)), E, "out_dtype", "torch.bfloat16 or torch.float16", "torch.float32"),
    ("kv_fp8_k_new_float64", "kvcache", all_to(F8, "q", "k_cache", "v_cache"), E, "k_new", "dtype float8_e4m3 (same as q)", "float64"),
    ("kv_descale_without_fp8", "kvcache", setter(q_descale=torch.ones(B, H_K)), E, "q_descale", "an undefined tensor when q is not float8_e4m3", "float64"),
    ("mixed_k_float32", "func", all_to(torch.float32, "k"), E, "k", "dtype float64 (same as q)", "float32"),
    ("mixed_v_bfloat16", "func", all_to(torch.bfloat16, "v"), E, "v", "dtype float64 (same as k)", "bfloat16"),
    ("alibi_float64", "func", setter(alibi_slopes=torch.ones(H_Q, dtype=F64)), E, "alibi_slopes", "dtype float32", "float64"),
    ("varlen_mixed_k_float16", "varlen", all_to(torch.float16, "k", "v"), E, "k", "dtype float64 (same as q)", "float16"),
    ("kv_mixed_k_new_float32", "kvcache", all_to(torch.float32, "k", "v"), E, "k_new", "dtype float64 (same as q)", "float32"),
    ("kv_mixed_cache_float32", "kvcache", all_to(torch.float32, "k_cache", "v_cache"), E, "k_cache", "float64", "float32"),
    # -------------------------------------------------------------- shapes
    ("k_head_dim_mismatch", "func", setter(k=lambda kw: rand(B, S_K, H_K, 16)), E, "k", "shape[3] == 8 (head dim of q)", "16"),
    ("k_batch_mismatch", "func", setter(k=lambda kw: rand(3, S_K, H_K, D)), E, "k", "shape[0] == 2 (batch of q)", "3"),
    ("v_seqlen_mismatch", "func", setter(v=lambda kw: rand(B, 6, H_K, D)), E, "v", "shape [2, 7, 2, 8] (same as k but any head dim d_v)", "[2, 6, 2, 8]"),
    ("kv_heads_not_dividing", "func", setter(k=lambda kw: rand(B, S_K, 3, D), v=lambda kw: rand(B, S_K, 3, D)), E, "k", "dividing h_q = 4", "3"),
    ("q_rank_3", "func", setter(q=lambda kw: rand(S_Q, H_Q, D)), E, "q", "rank 4", "rank 3"),
    ("kv_k_new_shape", "kvcache", setter(k=lambda kw: rand(B, 2, H_Q, D)), E, "k_new", "shape [2, 2, 2, 8]", "[2, 2, 4, 8]"),
    # -------------------------------------------------------------- head dim
    ("head_dim_0", "func", with_head_dim(0), E, "q", "shape[3] >= 1 (head dim)", "0"),
    ("head_dim_520", "func", with_head_dim(520), U, "q", "head dim d in [1, 512]", "d = 520"),
    ("varlen_head_dim_513", "varlen", with_head_dim(513), U, "q", "head dim d in [1, 512]", "d = 513"),
    # -------------------------------------------------------------- head dim of v (d_v), qv
    ("v_head_dim_520", "func", setter(v=lambda kw: rand(B, S_K, H_K, 520)), U, "v", "head dim d_v in [1, 512] (CPU backend)", "d_v = 520"),
    ("v_head_dim_0", "func", setter(v=lambda kw: rand(B, S_K, H_K, 0)), E, "v", "shape[3] >= 1 (head dim)", "0"),
    ("varlen_v_heads", "varlen", setter(v=lambda kw: rand(8, 1, 16)), E, "v", "shape [8, 2, 16] (same as k but any head dim d_v)", "[8, 1, 16]"),
    ("kv_v_new_head_dim", "kvcache", setter(v_cache=lambda kw: rand(3, 16, H_K, 16)), E, "v_new", "shape [2, 2, 2, 16] (same as k_new but the head dim d_v of v_cache)", "[2, 2, 2, 8]"),
    ("kv_qv_head_dim", "kvcache", setter(qv=lambda kw: rand(B, 1, H_Q, 4)), E, "qv", "shape [2, 1, 4, 8] (same as q but the head dim d_v of v)", "[2, 1, 4, 4]"),
    ("kv_qv_rank", "kvcache", setter(qv=lambda kw: rand(B, H_Q, D)), E, "qv", "rank 4", "rank 3"),
    ("kv_qv_float32", "kvcache", setter(qv=lambda kw: rand(B, 1, H_Q, D, dtype=torch.float32)), E, "qv", "dtype float64 (same as q)", "float32"),
    ("kv_qv_meta", "kvcache", setter(qv=lambda kw: rand(B, 1, H_Q, D).to(META)), E, "qv", "a tensor on cpu (the device of q)", "a tensor on meta"),
    # -------------------------------------------------------------- block-sparse masks
    ("bs_count_above_n", "func", setter(block_sparse_tensors=block_mask(cnt=(3, 1))), E, "block_sparse_tensors.mask_block_cnt", "counts in [0, N = ceil(s_k / block_size_k) = ceil(7 / 4) = 2]", "3"),
    ("bs_index_out_of_range", "func", setter(block_sparse_tensors=block_mask(idx=((1, 2), (0, 0)))), E, "block_sparse_tensors.mask_block_idx", "key block indices in [0, N)", "2"),
    ("bs_index_duplicated", "func", setter(block_sparse_tensors=block_mask(idx=((0, 0), (0, 0)))), E, "block_sparse_tensors.mask_block_idx", "listed at most once", "key block 0 listed again"),
    ("bs_block_size_disagrees", "func", setter(block_sparse_tensors=block_mask(block_size=(2, 4))), E, "block_sparse_tensors.mask_block_cnt", "M = ceil(s_q / block_size_q) = ceil(5 / 2) = 3", "2"),
    ("bs_block_size_bad", "func", setter(block_sparse_tensors=block_mask(block_size=(1, 2, 3))), E, "block_sparse_tensors.block_size", "(block_q, block_k)", "(1, 2, 3)"),
    ("bs_cnt_int64", "func", setter(block_sparse_tensors=lambda kw: block_mask()(kw)._replace(mask_block_cnt=torch.tensor([[[2, 1]]]))), E, "block_sparse_tensors.mask_block_cnt", "dtype int32", "int64"),
    ("bs_cnt_list", "func", setter(block_sparse_tensors=lambda kw: block_mask()(kw)._replace(mask_block_cnt=[2, 1])), E, "block_sparse_tensors.mask_block_cnt", "a torch.Tensor (int32) or None", "list"),
    ("bs_not_a_mask", "func", setter(block_sparse_tensors=(1, 2)), E, "block_sparse_tensors", "BlockSparseTensorsTorch", "tuple"),
    ("bs_prefix_negative", "func", setter(block_sparse_tensors=block_mask(prefix_keys=i32(1, -1))), E, "block_sparse_tensors.prefix_keys", "values >= 0 at [1]", "-1"),
    # -------------------------------------------------------------- windows
    ("window_left_-2", "func", setter(window_size=(-2, -1)), E, "window_size", "ints in [-1, 2147483647]", "(-2, -1)"),
    ("window_right_-5", "func", setter(window_size=(0, -5)), E, "window_size", "ints in [-1, 2147483647]", "(0, -5)"),
    ("window_int_min", "varlen", setter(window_size=(-2**31, 0)), E, "window_size", "(-1 = unbounded)", "-2147483648"),
    ("kv_window_-3", "kvcache", setter(window_size=(-3, -3)), E, "window_size", "ints in [-1", "(-3, -3)"),
    # -------------------------------------------------------------- softmax_scale, softcap
    ("softmax_scale_nan", "func", setter(softmax_scale=float("nan")), E, "softmax_scale", "a finite value", "nan"),
    ("softmax_scale_inf", "func", setter(softmax_scale=float("inf")), E, "softmax_scale", "a finite value", "inf"),
    ("varlen_softmax_scale_-inf", "varlen", setter(softmax_scale=float("-inf")), E, "softmax_scale", "a finite value", "-inf"),
    ("softcap_nan", "func", setter(softcap=float("nan")), E, "softcap", "a finite value >= 0", "nan"),
    ("softcap_inf", "func", setter(softcap=float("inf")), E, "softcap", "a finite value >= 0", "inf"),
    ("kv_softcap_nan", "kvcache", setter(softcap=float("nan")), E, "softcap", "a finite value >= 0", "nan"),
    ("kv_softmax_scale_inf", "kvcache", setter(softmax_scale=float("inf")), E, "softmax_scale", "a finite value", "inf"),
    # -------------------------------------------------------------- dropout
    ("dropout_1", "func", setter(dropout_p=1.0), E, "dropout_p", "a value in [0, 1)", "1"),
    ("dropout_negative", "func", setter(dropout_p=-0.25), E, "dropout_p", "a value in [0, 1)", "-0.25"),
    ("dropout_nan", "func", setter(dropout_p=float("nan")), E, "dropout_p", "a value in [0, 1)", "nan"),
    ("varlen_dropout_1.5", "varlen", setter(dropout_p=1.5), E, "dropout_p", "a value in [0, 1)", "1.5"),
    # -------------------------------------------------------------- alibi shapes
    ("alibi_shape_h_k", "func", setter(alibi_slopes=torch.ones(H_K)), E, "alibi_slopes", "shape [4] or [2, 4]", "[2]"),
    ("alibi_shape_transposed", "func", setter(alibi_slopes=torch.ones(H_Q, B)), E, "alibi_slopes", "shape [4] or [2, 4]", "[4, 2]"),
    ("varlen_alibi_shape", "varlen", setter(alibi_slopes=torch.ones(2, H_Q)), E, "alibi_slopes", "shape [4] or [3, 4]", "[2, 4]"),
    ("kv_alibi_shape", "kvcache", setter(alibi_slopes=torch.ones(H_Q + 1)), E, "alibi_slopes", "shape [4] or [2, 4]", "[5]"),
    # -------------------------------------------------------------- devices
    ("mixed_devices_k_meta", "func", setter(k=lambda kw: kw["k"].to(META)), E, "k", "a tensor on cpu", "a tensor on meta"),
    ("mixed_devices_alibi_meta", "func", setter(alibi_slopes=torch.ones(H_Q, device=META)), E, "alibi_slopes", "a tensor on cpu", "meta"),
    ("varlen_cu_seqlens_meta", "varlen", setter(cu_seqlens_k=lambda kw: kw["cu_seqlens_k"].to(META)), E, "cu_seqlens_k", "a tensor on cpu", "meta"),
    ("kv_cache_meta", "kvcache", setter(v_cache=lambda kw: kw["v_cache"].to(META)), E, "v_cache", "a tensor on cpu", "meta"),
    # -------------------------------------------------------------- cu_seqlens, seqused_k
    ("cu_seqlens_q_float32", "varlen", setter(cu_seqlens_q=torch.tensor([0.0, 2, 2, 7])), E, "cu_seqlens_q", "dtype int32", "float32"),
    ("cu_seqlens_q_int64", "varlen", setter(cu_seqlens_q=torch.tensor([0, 2, 2, 7])), flashattn.DTypeError, "cu_seqlens_q", "dtype int32", "int64"),
    ("cu_seqlens_k_wrong_length", "varlen", setter(cu_seqlens_k=i32(0, 3, 7)), E, "cu_seqlens_k", "shape [4]", "[3]"),
    ("cu_seqlens_q_not_monotone", "varlen", setter(cu_seqlens_q=i32(0, 4, 2, 7)), E, "cu_seqlens_q", "non-decreasing values", "cu_seqlens_q[2] = 2 < cu_seqlens_q[1] = 4"),
    ("cu_seqlens_q_not_from_0", "varlen", setter(cu_seqlens_q=i32(1, 2, 2, 7)), E, "cu_seqlens_q", "cu_seqlens_q[0] == 0", "1"),
    ("cu_seqlens_k_overrun", "varlen", setter(cu_seqlens_k=i32(0, 3, 7, 9)), E, "cu_seqlens_k", "cu_seqlens_k[3] <= 8 (k.shape[0])", "9"),
    ("max_seqlen_q_too_small", "varlen", setter(max_seqlen_q=4), E, "max_seqlen_q", ">= 5", "4"),
    ("max_seqlen_k_negative", "varlen", setter(max_seqlen_k=-1), E, "max_seqlen_k", "an int in [0, 2147483647]", "-1"),
    ("seqused_k_above_seqlen", "varlen_op", setter(seqused_k=i32(3, 5, 1)), E, "seqused_k", "seqused_k[1] in [0, 4]", "seqused_k[1] = 5"),
    ("seqused_k_negative", "varlen_op", setter(seqused_k=i32(-1, 0, 1)), E, "seqused_k", "seqused_k[0] in [0, 3]", "seqused_k[0] = -1"),
    ("seqused_k_wrong_length", "varlen_op", setter(seqused_k=i32(3, 0)), E, "seqused_k", "shape [3]", "[2]"),
    # -------------------------------------------------------------- kv cache
    ("cache_seqlens_beyond_capacity", "kvcache", setter(cache_seqlens=i32(5, 15)), E, "cache_seqlens", "cache_seqlens[i] + s_new <= 16", "cache_seqlens[1] + 2 = 17"),
    ("cache_seqlens_int_beyond_capacity", "kvcache", setter(cache_seqlens=15), E, "cache_seqlens", "cache_seqlens[i] + s_new <= 16", "+ 2 = 17"),
    ("paged_cache_seqlens_beyond_capacity", "kvcache", then(paged, setter(cache_seqlens=i32(15, 9))), E, "cache_seqlens", "cache_seqlens[i] + s_new <= 16", "cache_seqlens[0] + 2 = 17"),
    ("cache_seqlens_int64", "kvcache", setter(cache_seqlens=torch.tensor([5, 9])), flashattn.DTypeError, "cache_seqlens", "dtype int32", "int64"),
    ("block_table_negative", "kvcache", then(paged, setter(block_table=torch.tensor([[0, -3, -1, -1], [1, 3, 5, 99]], dtype=torch.int32))), E, "block_table", "used entries in [0, 6)", "block_table[0][1] = -3"),
    ("block_table_out_of_range", "kvcache", then(paged, setter(block_table=torch.tensor([[0, 2, -1, -1], [1, 6, 5, 99]], dtype=torch.int32))), E, "block_table", "used entries in [0, 6)", "block_table[1][1] = 6"),
    ("block_table_int64", "kvcache", then(paged, setter(block_table=lambda kw: kw["block_table"].long())), flashattn.DTypeError, "block_table", "dtype int32", "int64"),
    ("cache_leftpad_int64", "kvcache", setter(cache_leftpad=torch.tensor([0, 1])), flashattn.DTypeError, "cache_leftpad", "dtype int32", "int64"),
    ("cache_leftpad_negative", "kvcache", setter(cache_leftpad=i32(0, -1)), E, "cache_leftpad", "values in [0, cache_seqlens[i]]", "cache_leftpad[1] = -1"),
    ("cache_leftpad_past_seqlens", "kvcache", setter(cache_leftpad=i32(6, 0)), E, "cache_leftpad", "(cache_seqlens[0] = 5)", "cache_leftpad[0] = 6"),
    ("cache_leftpad_shape", "kvcache", setter(cache_leftpad=i32(0, 0, 0)), E, "cache_leftpad", "[2]", "[3]"),
    ("cache_leftpad_paged", "kvcache", then(paged, setter(cache_leftpad=i32(0, 1))), U, "cache_leftpad", "paged cache", "shape [2]"),
    ("varlen_block_table_out_of_range", "varlen", then(paged_varlen, setter(block_table=i32(4, 0, 5, 6, 1, 3).reshape(3, 2))), E, "block_table", "used entries in [0, 6)", "block_table[1][1] = 6"),
    ("varlen_block_table_too_short", "varlen", then(paged_varlen, setter(block_table=i32(0, 1, 2).reshape(3, 1), max_seqlen_k=4)), E, "block_table", "<= 2 (max_blocks_per_seq * block_size", "cu_seqlens_k[1] - cu_seqlens_k[0] = 3"),
    ("varlen_block_table_float32", "varlen", then(paged_varlen, setter(block_table=lambda kw: kw["block_table"].float())), E, "block_table", "dtype int32", "float32"),
    ("varlen_block_table_k_rank_3", "varlen", setter(block_table=i32(0, 1, 2).reshape(3, 1)), E, "k", "rank 4 [num_blocks, block_size, h_k, d]", "rank 3"),
    ("cache_batch_idx_out_of_range", "kvcache", setter(cache_batch_idx=i32(0, 3)), E, "cache_batch_idx", "values in [0, 3)", "cache_batch_idx[1] = 3"),
    # -------------------------------------------------------------- sizes past 2^31
    # A [2, 2^31, 4, 8] view of 8 elements (outer strides 0): described, not allocated.
    ("q_seqlen_2^31", "func", setter(q=lambda kw: torch.zeros(D, dtype=F64).as_strided((B, 2**31, H_Q, D), (0, 0, 0, 1))), E, "q", "shape[1] < 2^31", "2147483648"),
    # The same for flash_attn_with_kvcache, whose int cache_seqlens becomes a [b] tensor.
    ("kv_q_batch_2^31", "kvcache", setter(q=lambda kw: torch.zeros(D, dtype=F64).as_strided((2**31, 1, H_Q, D), (0, 0, 0, 1)), cache_seqlens=5), E, "q", "shape[0] < 2^31", "2147483648"),
    ("varlen_total_k_2^31", "varlen", setter(k=lambda kw: torch.zeros(D, dtype=F64).as_strided((2**31, H_K, D), (0, 0, 1))), E, "k", "shape[0] < 2^31", "2147483648"),
]


def snapshot(kw):
    return {n: t.detach().clone().view(-1).view(torch.uint8) if t.is_contiguous() else t.detach().clone()
            for n, t in kw.items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.numel() < 1 << 20}


def test_at_least_40_rows():
    assert len(ROWS) >= 40
    assert len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("name,entry,mutate,cls,argument,expected,actual", ROWS,
                         ids=[r[0] for r in ROWS])
def test_bad_input(name, entry, mutate, cls, argument, expected, actual):
    fn, kw = baseline(entry)
    mutate(kw)
    before = snapshot(kw)
    with pytest.raises(Exception) as info:
        fn(**kw)
    e = info.value
    assert type(e) is cls, f"{type(e).__name__}: {e}"
    assert isinstance(e, RuntimeError) and isinstance(e, ValueError)
    assert e.argument == argument, str(e)
    assert f"argument '{argument}': expected " in str(e), str(e)
    assert expected in e.expected, (expected, str(e))
    assert actual in e.actual, (actual, str(e))
    after = snapshot(kw)
    for n, t in before.items():
        assert torch.equal(t, after[n]), f"a rejected call wrote '{n}'"


def test_option_errors_name_the_keyword_and_keep_the_cxx_name():
    # The library calls the option opts.softcap; the caller passed softcap=.
    fn, kw = baseline("kvcache")
    kw["softcap"] = float("nan")
    with pytest.raises(InvalidArgumentError) as info:
        fn(**kw)
    e = info.value
    assert (e.function, e.argument, e.actual) == ("kvcache_forward", "softcap", "nan"), str(e)
    assert str(e).startswith("flashattn::kvcache_forward: argument 'softcap': expected "), str(e)
    assert str(e).endswith(" (flashattn::Options::softcap in C++)"), str(e)
    # The op (the binding's names) keeps the C++ name.
    with pytest.raises(InvalidArgumentError, match=r"argument 'opts\.softmax_scale'"):
        ops.fwd(rand(B, S_Q, H_Q, D), rand(B, S_K, H_K, D), rand(B, S_K, H_K, D), None, None,
                float("nan"), False, -1, -1, 0.0, 0.0, False, False)


# ------------------------------------------------------------------ valid edge cases


def close(actual, expected, tol=1e-12):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=tol, atol=tol)


def test_valid_empty_batch():
    q, k = rand(0, S_Q, H_Q, D), rand(0, S_K, H_K, D)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == (0, S_Q, H_Q, D) and lse.shape == (0, H_Q, S_Q)


def test_valid_empty_varlen_batch():
    q, k = rand(0, H_Q, D), rand(0, H_K, D)
    out = flash_attn_varlen_func(q, k, k, i32(0), i32(0), 0, 0)
    assert out.shape == (0, H_Q, D)


def test_valid_zero_keys():
    q, k = rand(B, 3, H_Q, D), rand(B, 0, H_K, D)
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))


def test_valid_zero_length_sequences():
    # q lengths 0, 3, 0, 2; k lengths 2, 0, 0, 3: sequence 1 sees no key.
    q, k, v = rand(5, H_Q, D), rand(5, H_K, D), rand(5, H_K, D)
    cq, ck = i32(0, 0, 3, 3, 5), i32(0, 2, 2, 2, 5)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cq, ck, 3, 3, return_attn_probs=True)
    r = ref.attention(q.numpy(), k.numpy(), v.numpy(), cu_seqlens_q=cq.numpy(),
                      cu_seqlens_k=ck.numpy())
    close(out, r["out"])
    close(lse, r["lse"], 1e-6)  # lse is stored in fp32
    assert torch.equal(out[0:3], torch.zeros_like(out[0:3]))


def test_valid_kvcache_zero_cached_keys():
    q, kc, vc = rand(B, 1, H_Q, D), rand(3, 16, H_K, D), rand(3, 16, H_K, D)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(0, 0), return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))


def test_valid_non_unit_last_stride_is_computed_correctly():
    # The torch layer copies a tensor whose last dimension is not contiguous (the library
    # itself rejects it): the result is that of the contiguous tensor.
    q, k, v = rand(B, S_Q, H_Q, 2 * D)[..., ::2], rand(B, S_K, H_K, D), rand(B, S_K, H_K, D)
    assert q.stride(-1) == 2
    out = flash_attn_func(q, k, v)
    close(out, ref.attention(q.numpy(), k.numpy(), v.numpy())["out"])


def test_valid_element_offsets_past_2_31():
    # q's second batch starts 2^31 + 64 elements after its first: 16 GiB of address space
    # (an anonymous NORESERVE mapping, two pages touched), read through numpy and torch.
    far = 2**31 + 64
    n = S_Q * H_Q * D
    nbytes = (far + n) * 8
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                        | getattr(mmap, "MAP_NORESERVE", 0))
    except (OSError, ValueError) as e:
        pytest.skip(f"cannot reserve {nbytes} bytes of address space: {e}")
    base = np.frombuffer(buf, dtype=np.float64)
    compact = rand(B, S_Q, H_Q, D)
    base[:n] = compact[0].reshape(-1).numpy()
    base[far:far + n] = compact[1].reshape(-1).numpy()
    view = np.lib.stride_tricks.as_strided(base, (B, S_Q, H_Q, D),
                                           (far * 8, H_Q * D * 8, D * 8, 8))
    q = torch.from_numpy(view)
    assert q.stride(0) == far
    k, v = rand(B, S_K, H_K, D), rand(B, S_K, H_K, D)
    out = flash_attn_func(q, k, v)
    assert torch.equal(out, flash_attn_func(compact, k, v))
    close(out, ref.attention(compact.numpy(), k.numpy(), v.numpy())["out"])
    del q, view, base
