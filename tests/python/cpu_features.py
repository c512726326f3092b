"""What this machine's CPU has, for the tests of the CPU backend's instruction-set paths."""


def has_avx512bf16():
    """Whether /proc/cpuinfo lists what FLASHATTN_CPU_ISA=avx512bf16 needs (AVX-512 F, BW, VL,
    DQ and AVX512_BF16); False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"))
