"""The CPU backend's instruction-set path chosen by FLASHATTN_CPU_ISA (read once per
process, so each case runs in a fresh interpreter): avx2 everywhere, avx512bf16 where the
CPU has AVX-512 + AVX512_BF16 (else a clear UnsupportedError naming the variable), a bad
value an InvalidArgumentError naming it; bf16 forward / backward / decode of each path
against an fp64 computation of the same inputs."""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from cpu_features import has_avx512bf16  # noqa: E402


SCRIPT = textwrap.dedent("""
    import torch, flashattn
    from flashattn import flash_attn_func, flash_attn_with_kvcache
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))

    def ref(q, k, v, causal):
        qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
        kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], 1)
        vd = vd.repeat_interleave(qd.shape[1] // vd.shape[1], 1)
        s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            sq, sk = s.shape[-2:]
            m = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
            s = s.masked_fill(~m, float("-inf"))
        return (s.softmax(-1) @ vd).transpose(1, 2)

    worst = 0.0
    for (b, sq, sk, hq, hk, d, causal) in ((2, 37, 131, 4, 2, 17, True), (1, 70, 70, 2, 2, 64, False)):
        q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, sk, hk, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, sk, hk, d, dtype=torch.bfloat16, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=causal)
        want = ref(q.detach(), k.detach(), v.detach(), causal)
        worst = max(worst, ((out.double() - want).abs().max() / want.abs().max()).item())
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), do)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        exp = torch.autograd.grad(ref(qd, kd, vd, causal), (qd, kd, vd), do.double())
        for g, e in zip(got, exp):
            worst = max(worst, ((g.double() - e).abs().max() / e.abs().max()).item())
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    kc = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16)
    vc = torch.randn(2, 300, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([300, 171], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    for i, n in enumerate(lens.tolist()):
        want = ref(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], False)
        worst = max(worst, ((out[i:i + 1].double() - want).abs().max() / want.abs().max()).item())
    print("WORST", worst)
""")


def _run(isa):
    env = dict(os.environ, FLASHATTN_CPU_ISA=isa, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("isa", ["avx2", "avx512bf16"])
def test_path_matches_fp64(isa):
    if isa == "avx512bf16" and not has_avx512bf16():
        r = _run(isa)
        assert r.returncode != 0
        assert "UnsupportedError" in r.stderr and "FLASHATTN_CPU_ISA" in r.stderr, r.stderr
        pytest.skip("this CPU lacks AVX512_BF16: the path is declined (checked)")
    r = _run(isa)
    assert r.returncode == 0, r.stderr
    worst = float(r.stdout.split("WORST")[1])
    # bf16 inputs and outputs: a few bf16 ulps (2^-8) of the largest value, on either path.
    assert worst < 2.0 ** -6, worst


def test_bad_value_names_the_variable():
    r = _run("sse2")
    assert r.returncode != 0
    assert "InvalidArgumentError" in r.stderr, r.stderr
    assert "FLASHATTN_CPU_ISA" in r.stderr and "avx2 or avx512bf16" in r.stderr and "'sse2'" in r.stderr
