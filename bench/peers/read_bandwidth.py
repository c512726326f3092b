"""The device's read bandwidth, the ceiling of decode: torch reductions (sum, amax) over a
4 GiB fp32 tensor, CUDA events around 10 calls, best and median per call.

    python3 bench/peers/read_bandwidth.py
"""
import torch

x = torch.rand(1 << 30, device="cuda")  # 4 GiB
for name, fn in (("sum", lambda: x.sum()), ("amax", lambda: x.amax())):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    ts.sort()
    gb = x.numel() * 4 / 1e12
    print(f"read bandwidth ({name} of 4 GiB fp32): best {gb / ts[0]:.2f} TB/s, median {gb / ts[len(ts) // 2]:.2f} TB/s")
