"""The unified benchmark's pieces that need no GPU (bench/suite_report.py): FLOP and byte
counts, the grid shapes, the repeat budget, the ratio and summary tables, CSV / JSON
round trips and the progress bar. numpy only; the parts that need torch (the naive
computation of bench/suite.py against torch's SDPA, one measured cell on the CPU) or
matplotlib skip without them."""

import json
import math
import os
import re
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH))
import suite_report as R  # noqa: E402


def gemm_flops(m, k, n):
    return 2 * m * k * n


def test_attention_flops_is_two_gemms_per_head(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        b, h, sq, sk, d = (int(x) for x in rng.integers(1, 300, 5))
        # S = Q K^T ([sq, d] x [d, sk]) and O = P V ([sq, sk] x [sk, d]) per (batch, head).
        fwd = b * h * (gemm_flops(sq, d, sk) + gemm_flops(sq, sk, d))
        assert R.attention_flops(b, h, sq, sk, d, False, "fwd") == fwd
        assert R.attention_flops(b, h, sq, sk, d, True, "fwd") == fwd / 2
        assert R.attention_flops(b, h, sq, sk, d, False, "bwd") == 2.5 * fwd
        assert R.attention_flops(b, h, sq, sk, d, True, "fwd_bwd") == 3.5 * fwd / 2
    with pytest.raises(KeyError):
        R.attention_flops(1, 1, 1, 1, 1, False, "sideways")


def test_kv_bytes_matches_the_arrays(seed):
    rng = np.random.default_rng(seed)
    for dtype in (np.float16, np.float32):
        b, s, hk, d = (int(x) for x in rng.integers(1, 40, 4))
        k = np.zeros((b, s, hk, d), dtype)
        v = np.zeros((b, s, hk, d), dtype)
        assert R.kv_bytes(b, s, hk, d, k.itemsize) == k.nbytes + v.nbytes
    # The decode grid's largest cell: 8 x 128k x 8 x 128 bf16, K and V: 4 GiB.
    assert R.kv_bytes(8, 131072, 8, 128) == 4 << 30


def test_rates():
    assert R.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert R.tbps(4.8e12, 1000.0) == pytest.approx(4.8)
    assert math.isnan(R.tflops(1.0, 0.0))
    assert math.isnan(R.tbps(1.0, None))


def test_standard_grid_shapes():
    g = R.STANDARD
    cells = R.standard_cells(g)
    assert len(cells) == 2 * 3 * 2 * 6 * 3
    assert len(set(cells)) == len(cells)
    for dt, d, causal, s, dirn in cells:
        b, h = R.shape_for(g, d, s)
        assert b * s == 16384 and h * d == 2048
        assert dt in ("bf16", "fp16") and dirn in R.DIRECTIONS
    assert {c[3] for c in cells} == {512, 1024, 2048, 4096, 8192, 16384}


def test_repeats_for_stays_in_bounds(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        est = float(rng.uniform(0.001, 200.0))
        n = R.repeats_for(est, 25.0, 3, 30)
        assert 3 <= n <= 30
        if 3 * est <= 25.0 and est * 30 >= 25.0:
            assert n == int(25.0 // est)
    assert R.repeats_for(float("nan"), 25.0, 3, 30) == 30
    assert R.repeats_for(1e6, 25.0, 3, 30) == 3


def test_median_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    for n in (1, 2, 7, 10, 31):
        xs = list(rng.standard_normal(n))
        assert R.median(xs) == pytest.approx(float(np.median(xs)))
    assert math.isnan(R.median([]))


def _rows(rng, peers=("sdpa_flash", "sdpa_cudnn"), broken="sdpa_cudnn"):
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (512, 2048):
                for dirn in R.DIRECTIONS:
                    b, h = R.shape_for(R.STANDARD, d, s)
                    for impl in ("flashattn",) + tuple(peers):
                        if impl == broken and d == 128:
                            rows.append(R.na("standard", impl, "bf16", d, causal, s, b, h, dirn,
                                             "CUDA out of memory. Tried to allocate 8 GiB"))
                            continue
                        t = float(rng.uniform(50, 700))
                        rows.append(R.row("standard", impl, "bf16", d, causal, s, b, h, dirn,
                                          ms=1.0, tflops=t, reps=5))
    return rows


def _parse(table):
    lines = [l for l in table.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    body = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    return head, body


def test_ratio_table_has_every_cell_and_the_ratios(seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)
    head, body = _parse(R.ratio_table(rows))
    assert head[:6] == ["dtype", "dir", "hdim", "causal", "seqlen", "ours TFLOP/s"]
    assert head[6:] == ["vs flash", "vs cudnn"]
    assert len(body) == 2 * 2 * 2 * 3
    idx = {(r["direction"], r["hdim"], r["causal"], r["seqlen"], r["impl"]): r for r in rows}
    for line in body:
        dirn, d, causal = line[1], int(line[2]), line[3] == "yes"
        s = {"512": 512, "2k": 2048}[line[4]]
        ours = idx[(dirn, d, causal, s, "flashattn")]["tflops"]
        assert float(line[5]) == pytest.approx(ours, abs=0.05)
        for col, peer in zip(line[6:], ("sdpa_flash", "sdpa_cudnn")):
            p = idx[(dirn, d, causal, s, peer)]
            if p["status"] != "ok":
                assert col == "n/a"
                continue
            m = re.fullmatch(r"([0-9.]+) \(([0-9]+)\)", col)
            assert m, col
            assert float(m.group(1)) == pytest.approx(ours / p["tflops"], abs=0.006)
            assert int(m.group(2)) == round(p["tflops"])


def test_summary_table_is_the_geometric_mean(seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)
    head, body = _parse(R.summary_table(rows))
    assert head == ["dtype", "dir", "vs flash", "vs cudnn"]
    assert [l[1] for l in body] == list(R.DIRECTIONS)
    for line in body:
        ours = {(r["hdim"], r["causal"], r["seqlen"]): r["tflops"] for r in rows
                if r["impl"] == "flashattn" and r["direction"] == line[1]}
        flash = [ours[(r["hdim"], r["causal"], r["seqlen"])] / r["tflops"] for r in rows
                 if r["impl"] == "sdpa_flash" and r["direction"] == line[1]]
        g = float(np.exp(np.mean(np.log(flash))))
        m = re.match(r"([0-9.]+) \(([0-9.]+)\.\.([0-9.]+)\)", line[2])
        assert float(m.group(1)) == pytest.approx(g, abs=0.006)
        assert float(m.group(2)) == pytest.approx(min(flash), abs=0.006)
        assert float(m.group(3)) == pytest.approx(max(flash), abs=0.006)
        assert line[3].endswith(", 4 n/a")          # hdim 128: 2 causal x 2 seqlens


def test_decode_and_memory_tables():
    rows = [R.row("decode", "flashattn", "bf16", 128, False, 4096, 8, 32, "decode", heads_kv=8,
                  ms=0.05, tbps=2.5),
            R.row("decode", "sdpa_cudnn", "bf16", 128, False, 4096, 8, 32, "decode", heads_kv=8,
                  ms=0.04, tbps=3.0),
            R.na("decode", "sdpa_flash", "bf16", 128, False, 4096, 8, 32, "decode", "no kernel",
                 heads_kv=8),
            R.row("memory", "flashattn", "bf16", 128, False, 65536, 1, 16, "fwd_bwd", peak_gib=1.5),
            R.na("memory", "naive", "bf16", 128, False, 65536, 1, 16, "fwd_bwd",
                 "torch.OutOfMemoryError: CUDA out of memory")]
    _, body = _parse(R.decode_table(rows))
    assert body == [["4k", "2.50 (50)", "n/a", "3.00 (0.83)"]] or \
        body == [["4k", "2.50 (50)", "3.00 (0.83)", "n/a"]]
    _, body = _parse(R.memory_table(rows))
    assert body == [["64k", "1.5", "n/a (out of memory)"]]
    text = R.report({"commit": "abc", "device": "X"}, rows)
    assert "commit abc" in text and "Decode" in text and "Peak memory" in text


def test_short_reason():
    assert R.short_reason("RuntimeError: CUDA out of memory. Tried ...") == "out of memory"
    long = "word " * 100
    r = R.short_reason(long, 50)
    assert len(r) == 50 and r.endswith("...")
    assert R.short_reason("a\n  b\tc") == "a b c"


def test_csv_round_trip(tmp_path, seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)
    rows[0]["tbps"] = float("nan")
    p = tmp_path / "r.csv"
    R.write_csv(p, rows)
    back = R.read_csv(p)
    assert len(back) == len(rows)
    header = open(p).readline().strip().split(",")
    assert tuple(header) == R.FIELDS
    for a, b in zip(rows, back):
        for k in ("grid", "impl", "dtype", "hdim", "causal", "seqlen", "batch", "heads",
                  "direction", "status", "note", "reps"):
            assert a[k] == b[k], k
        if a["tflops"] is None:
            assert b["tflops"] is None
        else:
            assert b["tflops"] == pytest.approx(a["tflops"], rel=1e-5)
    assert back[0]["tbps"] is None


def test_json_round_trip_with_metadata(tmp_path, seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)
    rows[1]["ms"] = float("nan")
    meta = {"commit": "c4733e8", "date": "2026-12-02 19:00 UTC", "device": "NVIDIA H200",
            "driver": "580", "torch": "2.11", "cuda": "13.0", "cudnn": "91900",
            "wall_s": {"standard grid": 12.5}}
    p = tmp_path / "r.json"
    R.write_json(p, meta, rows)
    json.loads(open(p).read())                      # strict JSON: no NaN tokens
    assert "NaN" not in open(p).read()
    m, back = R.read_json(p)
    assert m == meta
    assert back[1]["ms"] is None and back[2]["tflops"] == pytest.approx(rows[2]["tflops"])
    assert len(back) == len(rows)


def test_default_out_dir():
    import datetime
    when = datetime.datetime(2026, 12, 2, 19, 5, tzinfo=datetime.timezone.utc)
    p = R.default_out_dir("/r", "NVIDIA H200 (SXM)", when)
    assert p == "/r/20261202-1905-nvidia-h200-sxm"


def test_progress_bar_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)      # import tqdm fails
    bar = R.Progress(40, "t")
    for i in range(40):
        bar.update(f"cell {i}")
    bar.close()
    err = capsys.readouterr().err
    assert "40/40" in err and "t [" in err
    assert err.count("\n") <= 22                       # one line per 5% (not a terminal)


def test_plots(tmp_path, seed):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(seed)
    rows = _rows(rng) + [
        R.row("memory", "flashattn", "bf16", 128, False, 1024, 1, 16, "fwd_bwd", peak_gib=0.1),
        R.row("memory", "naive", "bf16", 128, False, 1024, 1, 16, "fwd_bwd", peak_gib=1.0),
        R.na("memory", "naive", "bf16", 128, False, 2048, 1, 16, "fwd_bwd", "out of memory")]
    paths = R.plot_all({"device": "test"}, rows, str(tmp_path))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["bwd_bf16.png", "fwd_bf16.png", "fwd_bwd_bf16.png", "memory.png"]
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_naive_and_a_cpu_cell_against_torch(seed):
    torch = pytest.importorskip("torch")
    pytest.importorskip("flashattn")
    import suite  # noqa: PLC0415

    torch.manual_seed(seed)
    impls = suite.Impls(torch, cpu=True)
    b, s, h, d = 2, 37, 3, 16
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        naive = impls.forward("naive", q, k, v, causal)
        ours = impls.forward("flashattn", q, k, v, causal).transpose(1, 2)
        torch.testing.assert_close(naive, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)

    timer = suite.Timer(torch, True, budget_ms=5.0, min_reps=2, max_reps=4)
    pool = torch.randn(2, 4, b * s * h * d, dtype=torch.float32)
    for impl in ("flashattn", "naive", "sdpa_cpu"):
        for dirn in R.DIRECTIONS:
            r = suite.measure_cell(torch, impls, timer, pool, impl, dirn, b, s, h, d, True, 2)
            assert r[0] == "ok", r
            assert r[1] > 0 and 2 <= r[2] <= 4
    # A cell that cannot run (head dim 16 needs 4 x the elements the pool has per tensor)
    # is recorded as n/a with a reason, not raised.
    r = suite.measure_cell(torch, impls, timer, pool, "naive", "fwd", b, 4 * s, h, d, False, 1)
    assert r[0] == "n/a" and r[1]
