"""flashattn.set_kernel_family / get_kernel_family / kernel_family: the process-wide CUDA
kernel-family choice from Python (Options::kernel_family / smem_cap of every call). The
setting, its validation and its restoring run everywhere; that it changes which kernels run
(and never the results) is checked on a GPU."""

import threading

import numpy as np
import pytest

import flashattn
from flashattn import _C


@pytest.fixture(autouse=True)
def restore_default():
    yield
    flashattn.set_kernel_family("auto", 0)


def test_default_is_auto():
    assert flashattn.get_kernel_family() == ("auto", 0)


def test_set_and_get():
    flashattn.set_kernel_family("sm80", 101376)
    assert flashattn.get_kernel_family() == ("sm80", 101376)
    flashattn.set_kernel_family("sm90")
    assert flashattn.get_kernel_family() == ("sm90", 0)


def test_setting_is_process_wide():
    # torch runs a backward on its autograd threads: they must see the caller's choice.
    flashattn.set_kernel_family("sm80", 150000)
    seen = []
    t = threading.Thread(target=lambda: seen.append(flashattn.get_kernel_family()))
    t.start()
    t.join()
    assert seen == [("sm80", 150000)]


def test_context_manager_restores_and_nests():
    flashattn.set_kernel_family("sm90")
    with flashattn.kernel_family("sm80", 101376) as kf:
        assert isinstance(kf, flashattn.kernel_family)
        assert flashattn.get_kernel_family() == ("sm80", 101376)
        with flashattn.kernel_family("auto"):
            assert flashattn.get_kernel_family() == ("auto", 0)
        assert flashattn.get_kernel_family() == ("sm80", 101376)
    assert flashattn.get_kernel_family() == ("sm90", 0)


def test_context_manager_restores_on_error():
    with pytest.raises(KeyError):
        with flashattn.kernel_family("sm80"):
            raise KeyError("inside")
    assert flashattn.get_kernel_family() == ("auto", 0)


def test_decorator():
    @flashattn.kernel_family("sm80")
    def inner(x):
        return flashattn.get_kernel_family(), x

    assert inner(3) == (("sm80", 0), 3)
    assert flashattn.get_kernel_family() == ("auto", 0)


@pytest.mark.parametrize("family", ["sm70", "SM80", "", "hopper"])
def test_unknown_family_is_an_error_naming_it(family):
    with pytest.raises(flashattn.InvalidArgumentError) as e:
        flashattn.set_kernel_family(family)
    assert e.value.function == "set_kernel_family"
    assert e.value.argument == "family"
    assert "'sm80'" in e.value.expected
    assert e.value.actual == f"'{family}'"
    assert flashattn.get_kernel_family() == ("auto", 0), "a rejected call changes nothing"


@pytest.mark.parametrize("cap", [-1, 1, 101375, 1 << 40])
def test_bad_smem_cap_is_an_error_naming_it(cap):
    flashattn.set_kernel_family("sm80")
    with pytest.raises(flashattn.InvalidArgumentError) as e:
        flashattn.set_kernel_family("sm90", cap)
    assert e.value.argument == "smem_cap"
    assert str(cap) in e.value.actual
    assert flashattn.get_kernel_family() == ("sm80", 0), "a rejected call changes nothing"


def test_cpu_calls_ignore_the_family(seed):
    # The family is a CUDA tuning knob: CPU results are the same bits under any setting.
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 11, 3, 16)) for _ in range(3))
    outs = []
    for family in ["auto", "sm80", "sm90"]:
        with flashattn.kernel_family(family, 101376):
            out = np.full(q.shape, np.nan)
            lse = np.full((2, 3, 11), np.nan, dtype=np.float32)
            _C.forward(q, k, v, out, lse, causal=True)
            outs.append((out, lse))
    for out, lse in outs[1:]:
        assert np.array_equal(out, outs[0][0]) and np.array_equal(lse, outs[0][1])


def _cuda():
    torch = pytest.importorskip("torch")
    if not (_C.cuda_available() and torch.cuda.is_available()):
        pytest.skip("no CUDA device")
    return torch


def test_cuda_family_reaches_the_calls(seed):
    # sm90 forced on a GPU other than compute capability 9.0 is an UnsupportedError; on
    # Hopper, sm80 and sm90 agree within bf16 rounding (different kernels, same function).
    torch = _cuda()
    from flashattn import flash_attn_func

    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    with flashattn.kernel_family("sm80"):
        ref = flash_attn_func(q, k, v, causal=True)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        with pytest.raises(flashattn.UnsupportedError):
            with flashattn.kernel_family("sm90"):
                flash_attn_func(q, k, v, causal=True)
        return
    with flashattn.kernel_family("sm90"):
        got = flash_attn_func(q, k, v, causal=True)
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
