"""flashattn.compat: `import flash_attn` answered by flashattn's shim only where its
directory is on the path (a real flash_attn beside it stays importable elsewhere),
bert_padding's pad_input / unpad_input, and tests/python/run_upstream.sh on a small test
file written against flash_attn (the real one needs a GPU)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import compat  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(code, *path, cwd="/tmp"):
    rest = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(list(path) + rest))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True)


@pytest.fixture
def real_flash_attn(tmp_path):
    """A stand-in for a real flash_attn installed in site-packages."""
    pkg = tmp_path / "site" / "flash_attn"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n__version__ = '2.8.3'\n")
    return str(tmp_path / "site")


def test_shim_first_on_the_path_answers_import_flash_attn(real_flash_attn):
    r = run("""
        import flash_attn, flashattn
        from flash_attn.flash_attn_interface import (_get_block_size_n, USE_TRITON_ROCM,
            _flash_attn_forward, flash_attn_gpu)
        from flash_attn.bert_padding import pad_input, unpad_input
        from flash_attn.layers.rotary import apply_rotary_emb
        assert flash_attn.__flashattn_shim__ and not hasattr(flash_attn, "REAL")
        assert flash_attn.flash_attn_func is flashattn.flash_attn_func
        assert flash_attn.flash_attn_with_kvcache is flashattn.flash_attn_with_kvcache
        assert USE_TRITON_ROCM is False and _get_block_size_n("cuda", 64, True, False) == 2**31 - 1
        print("ok", flash_attn.__version__)
        """, compat.shim_path(), real_flash_attn)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "2.8.3"]
    # Without the shim on the path the real one is imported, untouched.
    r = run("import flash_attn; assert flash_attn.REAL; print('real')", real_flash_attn)
    assert r.returncode == 0 and r.stdout.strip() == "real", r.stderr


def test_alias_flash_attn_in_process(real_flash_attn):
    r = run("""
        import flashattn.compat, flash_attn
        try:
            flashattn.compat.alias_flash_attn()
        except RuntimeError as e:
            assert "already imported" in str(e)
            print("refused")
        """, real_flash_attn)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr
    r = run("""
        import flashattn.compat
        m = flashattn.compat.alias_flash_attn()
        import flash_attn, flashattn
        assert m is flash_attn and flash_attn.flash_attn_func is flashattn.flash_attn_func
        assert flashattn.compat.alias_flash_attn() is m
        print("aliased")
        """, real_flash_attn)
    assert r.returncode == 0 and r.stdout.strip() == "aliased", r.stderr
    r = run("print(__import__('subprocess').run(['" + sys.executable + "', '-m', "
            "'flashattn.compat'], capture_output=True, text=True).stdout.strip())")
    assert r.stdout.strip() == compat.shim_path()


def test_pad_unpad_round_trip(seed):
    g = torch.Generator().manual_seed(seed)
    b, s = 3, 7
    x = torch.randn(b, s, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(b, s, generator=g) < 0.6
    mask[1] = False  # an empty sequence
    unused = (torch.rand(b, s, generator=g) < 0.3) & ~mask
    xu, idx, cu, max_s, used = compat.unpad_input(x, mask, unused)
    sel = (mask | unused).numpy()
    want_rows = x.detach().numpy().reshape(b * s, 2, 4)[sel.reshape(-1)]
    np.testing.assert_array_equal(xu.detach().numpy(), want_rows)
    assert cu.dtype == torch.int32 and cu.tolist() == [0] + np.cumsum(sel.sum(1)).tolist()
    assert max_s == int(sel.sum(1).max()) and used.tolist() == mask.sum(1).tolist()
    back = compat.pad_input(xu, idx, b, s)
    np.testing.assert_array_equal(back.detach().numpy(),
                                  np.where(sel[:, :, None, None], x.detach().numpy(), 0.0))
    back.sum().backward()  # differentiable: the gradient is the selection
    np.testing.assert_array_equal(x.grad.numpy(), np.broadcast_to(sel[:, :, None, None],
                                                                  x.shape).astype(float))


def test_run_upstream_sh_on_a_small_flash_attn_test_file(tmp_path):
    test_file = tmp_path / "test_flash_attn.py"
    test_file.write_text(textwrap.dedent("""
        import pytest, torch
        from flash_attn import flash_attn_func
        from flash_attn.bert_padding import pad_input, unpad_input
        from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM

        @pytest.mark.parametrize("i", range(40))
        def test_func(i):
            q = torch.randn(1, 4, 2, 8, dtype=torch.float64)
            out = flash_attn_func(q, q, q, causal=True)
            assert out.shape == q.shape
            assert i % 10 != 3  # 4 of the 40 fail

        @pytest.mark.parametrize("i", range(10))
        def test_skip(i):
            pytest.skip("skipped")
        """))
    script = os.path.join(REPO, "tests", "python", "run_upstream.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    runs = [subprocess.run(["bash", script, str(test_file), "20", "7"], env=env,
                           capture_output=True, text=True) for _ in range(2)]
    summary = [r.stdout.strip().splitlines()[-1] for r in runs]
    assert runs[0].returncode == 0, runs[0].stdout + runs[0].stderr
    assert summary[0] == summary[1]  # the same seed draws the same sample
    assert summary[0].startswith("upstream: ") and "(20 sampled with seed 7;" in summary[0]
    words = summary[0].split()
    passed, run_count = int(words[1]), int(words[4])
    assert 0 < passed <= run_count <= 20
    full = subprocess.run(["bash", script, str(test_file), "0"], env=env, capture_output=True,
                          text=True)
    assert full.stdout.strip().splitlines()[-1] == (
        "upstream: 36 passed of 40 run (50 sampled with seed 0; 4 failed, 0 errors, "
        "10 skipped)"), full.stdout + full.stderr


def test_run_upstream_sh_samples_after_keyword_selection(tmp_path):
    """-- -k NAME draws the sample from the tests -k keeps (the sampler runs after pytest's
    deselection), so a test function with few parametrizations can be sampled on its own."""
    test_file = tmp_path / "test_flash_attn.py"
    test_file.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("i", range(1000))
        def test_many(i):
            pass

        @pytest.mark.parametrize("i", range(12))
        def test_few(i):
            assert i != 5
        """))
    script = os.path.join(REPO, "tests", "python", "run_upstream.sh")
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", script, str(test_file), "12", "3", "--", "-k", "test_few"],
                       env=env, capture_output=True, text=True)
    assert r.stdout.strip().splitlines()[-1] == (
        "upstream: 11 passed of 12 run (12 sampled with seed 3; 1 failed, 0 errors, "
        "0 skipped)"), r.stdout + r.stderr
    r = subprocess.run(["bash", script, str(test_file), "6", "3", "--", "-k", "test_few"],
                       env=env, capture_output=True, text=True)
    words = r.stdout.strip().splitlines()[-1].split()
    assert words[3:6] == ["of", "6", "run"] and int(words[1]) in (5, 6), r.stdout + r.stderr


def test_run_upstream_sh_cpu_emulation(tmp_path):
    """UPSTREAM_CPU=1 turns the file's CUDA device strings into "cpu" and forces the
    drop-in's CUDA-tensor paths (interface._EMULATE_CUDA) in a copy; the original stays."""
    test_file = tmp_path / "test_flash_attn.py"
    source = textwrap.dedent("""
        import torch
        import flashattn.interface
        from flash_attn import flash_attn_func
        is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)

        def test_emulated():
            device = "cuda"
            assert is_sm90 and flashattn.interface._EMULATE_CUDA
            q = torch.randn(1, 5, 2, 59, device=device, dtype=torch.float64)
            out, lse, s = flash_attn_func(q, q, q, 0.5, return_attn_probs=True)
            assert out.shape == q.shape and s.shape == (1, 2, 128, 128)
        """)
    test_file.write_text(source)
    script = os.path.join(REPO, "tests", "python", "run_upstream.sh")
    env = dict(os.environ, PYTHON=sys.executable, UPSTREAM_CPU="1")
    r = subprocess.run(["bash", script, str(test_file), "0"], env=env, capture_output=True,
                       text=True)
    assert r.stdout.strip().splitlines()[-1].startswith("upstream: 1 passed of 1 run"), (
        r.stdout + r.stderr)
    assert test_file.read_text() == source
