"""flash_attn's private functions and compiled-module handle, as other libraries import them
(flashattn.flash_attn_interface: _flash_attn_forward, _flash_attn_varlen_forward,
_flash_attn_backward, _flash_attn_varlen_backward, flash_attn_gpu), on the CPU backend
against the public functions and autograd. Skipped when torch is not installed."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402
from flashattn.flash_attn_interface import (  # noqa: E402
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
    flash_attn_gpu,
)


def randn(g, *shape, requires_grad=False):
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad)


def test_signatures_are_flash_attn_2_8s():
    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(_flash_attn_forward) == [
        "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
        "window_size_right", "softcap", "alibi_slopes", "return_softmax"]
    assert names(_flash_attn_varlen_forward)[:15] == [
        "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
        "dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
        "softcap", "alibi_slopes", "return_softmax"]
    assert names(_flash_attn_varlen_forward)[15:19] == [
        "block_table", "leftpad_k", "seqused_k", "zero_tensors"]
    assert names(_flash_attn_backward) == [
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
        "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
        "alibi_slopes", "deterministic", "rng_state"]
    assert names(_flash_attn_varlen_backward) == [
        "dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
        "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
        "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
        "rng_state", "zero_tensors"]
    for name in ("fwd", "varlen_fwd", "bwd", "varlen_bwd", "fwd_kvcache"):
        assert callable(getattr(flash_attn_gpu, name))
    assert flashattn.flash_attn_interface.flash_attn_func is flash_attn_func


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1))])
def test_forward_backward_match_the_public_function(seed, causal, window):
    g = torch.Generator().manual_seed(seed)
    b, s_q, s_k, h_q, h_k, d = 2, 5, 7, 4, 2, 16
    q = randn(g, b, s_q, h_q, d, requires_grad=True)
    k = randn(g, b, s_k, h_k, d, requires_grad=True)
    v = randn(g, b, s_k, h_k, d, requires_grad=True)
    scale = 0.3
    want, want_lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal,
                                        window_size=window, return_attn_probs=True)
    dout = randn(g, *want.shape)
    want.backward(dout)

    out, lse, s_dmask, rng_state = _flash_attn_forward(q, k, v, 0.0, scale, causal, *window,
                                                       0.0, None, False)
    assert not out.requires_grad  # no autograd, as flash_attn's
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64

    # Out-parameters, including views into one packed gradient (flash_attn's own use).
    dkv = torch.full((b, s_k, 2, h_k, d), float("nan"), dtype=torch.float64)
    dq = torch.full_like(q, float("nan"))
    softmax_d = _flash_attn_backward(dout, q, k, v, out, lse, dq, dkv[:, :, 0], dkv[:, :, 1],
                                     0.0, scale, causal, *window, 0.0, None, False, rng_state)
    torch.testing.assert_close(dq, q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv[:, :, 0], k.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv[:, :, 1], v.grad, rtol=1e-12, atol=1e-12)
    assert softmax_d.dtype == torch.float32 and softmax_d.shape == (b, h_q, s_q)
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).transpose(1, 2).float())


def test_dropout_rng_state_round_trips(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (randn(g, 1, 6, 2, 8) for _ in range(3))
    out, lse, probs, rng_state = _flash_attn_forward(q, k, v, 0.5, 0.25, False, -1, -1, 0.0,
                                                     None, True)
    assert probs.shape == (1, 2, 6, 6)  # the CPU backend's probabilities after dropout
    # The same (seed, offset) in the backward regenerates the mask: gradients as autograd's.
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dout = randn(g, *out.shape)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.5, 0.25, False, -1, -1, 0.0,
                         None, False, rng_state)
    # Oracle: the op's autograd formula with the same rng_state.
    o2, _, _ = torch.ops.flashattn.fwd(qa, ka, va, None, rng_state, 0.25, False, -1, -1, 0.0,
                                       0.5, False, False)
    torch.testing.assert_close(o2.detach(), out, rtol=0, atol=0)
    o2.backward(dout)
    torch.testing.assert_close(dq, qa.grad, rtol=0, atol=0)
    torch.testing.assert_close(dk, ka.grad, rtol=0, atol=0)
    torch.testing.assert_close(dv, va.grad, rtol=0, atol=0)


def test_varlen_forward_backward(seed):
    g = torch.Generator().manual_seed(seed)
    lens_q, lens_k = [3, 5], [4, 6]
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 10], dtype=torch.int32)
    q = randn(g, 8, 4, 16, requires_grad=True)
    k = randn(g, 10, 2, 16, requires_grad=True)
    v = randn(g, 10, 2, 16, requires_grad=True)
    want, want_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True,
                                               return_attn_probs=True)
    dout = randn(g, *want.shape)
    want.backward(dout)
    out, lse, _, rng_state = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q),
                                                        max(lens_k), 0.0, 16 ** -0.5, True)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 5,
                                            6, 0.0, 16 ** -0.5, True, -1, -1, 0.0, None, False,
                                            rng_state)
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert softmax_d.shape == (4, 8)
    with pytest.raises(flashattn.UnsupportedError, match="leftpad_k"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.0, 0.25, True,
                                   leftpad_k=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(flashattn.InvalidArgumentError, match="argument 'k'.*num_blocks"):
        _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.0, 0.25, True,
                                   block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_flash_attn_gpu_module_out_parameters(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (randn(g, 1, 4, 2, 8) for _ in range(3))
    out_ = torch.empty_like(q)
    out, lse, p, rng_state = flash_attn_gpu.fwd(q, k, v, out_, None, 0.0, 0.5, True, -1, -1,
                                                0.0, False, None)
    assert out is out_
    torch.testing.assert_close(out, flash_attn_func(q, k, v, softmax_scale=0.5, causal=True),
                               rtol=0, atol=0)
    dq, dk, dv, softmax_d = flash_attn_gpu.bwd(torch.ones_like(q), q, k, v, out, lse, None,
                                               None, None, None, 0.0, 0.5, True, -1, -1, 0.0,
                                               False, None, rng_state)
    assert dq.shape == q.shape and dk.shape == k.shape and softmax_d.shape == (1, 2, 4)
    # fwd_kvcache: appends in place and returns [out, softmax_lse].
    k_cache, v_cache = torch.zeros(1, 6, 2, 8, dtype=torch.float64), torch.zeros(1, 6, 2, 8, dtype=torch.float64)
    lens = torch.tensor([0], dtype=torch.int32)
    out_kv, lse_kv = flash_attn_gpu.fwd_kvcache(q, k_cache, v_cache, k, v, lens, None, None,
                                                None, None, None, None, None, 0.5, True, -1, -1,
                                                0.0, True, 0)
    torch.testing.assert_close(k_cache[:, :4], k, rtol=0, atol=0)
    torch.testing.assert_close(out_kv, out, rtol=0, atol=0)
    torch.testing.assert_close(lse_kv, lse, rtol=0, atol=0)
    want = flash_attn_with_kvcache(q, torch.zeros_like(k_cache), torch.zeros_like(v_cache), k, v,
                                   cache_seqlens=0, softmax_scale=0.5, causal=True)
    torch.testing.assert_close(out_kv, want, rtol=0, atol=0)
