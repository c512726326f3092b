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
    assert head[:7] == ["dtype", "dir", "hdim", "causal", "seqlen", "ours TFLOP/s", "vs best"]
    assert head[7:] == ["vs cudnn", "vs fa2"]
    assert len(body) == 2 * 2 * 2 * 3
    idx = {(r["direction"], r["hdim"], r["causal"], r["seqlen"], r["impl"]): r for r in rows}
    for line in body:
        dirn, d, causal = line[1], int(line[2]), line[3] == "yes"
        s = {"512": 512, "2k": 2048}[line[4]]
        ours = idx[(dirn, d, causal, s, "flashattn")]["tflops"]
        assert float(line[5]) == pytest.approx(ours, abs=0.05)
        ok = {p: idx[(dirn, d, causal, s, p)] for p in ("sdpa_flash", "sdpa_cudnn")}
        best = max((r for r in ok.values() if r["status"] == "ok"), key=lambda r: r["tflops"])
        m = re.fullmatch(r"([0-9.]+) \((fa2|cudnn)\)", line[6])
        assert m, line[6]
        assert float(m.group(1)) == pytest.approx(ours / best["tflops"], abs=0.006)
        assert m.group(2) == R.SHORT[best["impl"]]
        for col, peer in zip(line[7:], ("sdpa_cudnn", "sdpa_flash")):
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
    assert head == ["dtype", "dir", "vs best", "vs cudnn", "vs fa2"]
    assert [l[1] for l in body] == list(R.DIRECTIONS)
    for line in body:
        ours = {(r["hdim"], r["causal"], r["seqlen"]): r["tflops"] for r in rows
                if r["impl"] == "flashattn" and r["direction"] == line[1]}
        flash = [ours[(r["hdim"], r["causal"], r["seqlen"])] / r["tflops"] for r in rows
                 if r["impl"] == "sdpa_flash" and r["direction"] == line[1]]
        g = float(np.exp(np.mean(np.log(flash))))
        m = re.match(r"([0-9.]+) \(([0-9.]+)\.\.([0-9.]+)\)", line[4])
        assert float(m.group(1)) == pytest.approx(g, abs=0.006)
        assert float(m.group(2)) == pytest.approx(min(flash), abs=0.006)
        assert float(m.group(3)) == pytest.approx(max(flash), abs=0.006)
        assert line[3].endswith(", 4 n/a")          # hdim 128: 2 causal x 2 seqlens
        # vs best: every cell has a best peer (FA2 runs everywhere), so no n/a.
        best = []
        for r in rows:
            if r["impl"] == "flashattn" and r["direction"] == line[1]:
                peers = [p["tflops"] for p in rows if p["impl"] != "flashattn"
                         and p["status"] == "ok" and p["direction"] == line[1]
                         and (p["hdim"], p["causal"], p["seqlen"]) ==
                         (r["hdim"], r["causal"], r["seqlen"])]
                best.append(r["tflops"] / max(peers))
        m = re.fullmatch(r"([0-9.]+) \(([0-9.]+)\.\.([0-9.]+)\)", line[2])
        assert m, line[2]
        assert float(m.group(1)) == pytest.approx(float(np.exp(np.mean(np.log(best)))), abs=0.006)


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
    assert body == [["4k", "2.50 (50)", "0.83 (cudnn)", "3.00 (0.83)", "n/a"]]
    _, body = _parse(R.memory_table(rows))
    assert body == [["64k", "1.5", "n/a (out of memory)"]]
    text = R.report({"commit": "abc", "device": "X"}, rows)
    assert "commit abc" in text and "Decode" in text and "Peak memory" in text


def test_decode_table_with_several_batches():
    # The sweep (issue 23): a row per batch and context, the batch in the first column, the
    # best peer taken within the same batch and context.
    rows = []
    for b, ours, cudnn, fa2 in ((1, 1.0, 2.0, 0.5), (64, 4.0, 3.0, 3.5)):
        rows += [R.row("decode", "flashattn", "bf16", 128, False, 1024, b, 32, "decode", heads_kv=8,
                       ms=0.01, tbps=ours),
                 R.row("decode", "sdpa_cudnn", "bf16", 128, False, 1024, b, 32, "decode", heads_kv=8,
                       ms=0.01, tbps=cudnn),
                 R.row("decode", "sdpa_flash", "bf16", 128, False, 1024, b, 32, "decode", heads_kv=8,
                       ms=0.01, tbps=fa2)]
    head, body = _parse(R.decode_table(rows))
    assert head[0] == "batch"
    assert [r[:3] for r in body] == [["1", "1k", "1.00 (10)"], ["64", "1k", "4.00 (10)"]]
    assert body[0][3] == "0.50 (cudnn)" and body[1][3] == "1.14 (fa2)"


def test_decode_grid_batches_and_contexts():
    import suite  # noqa: PLC0415  (no torch needed to import it)
    ap = suite.build_parser()
    dec = suite.decode_grid(ap.parse_args(["--decode-batches", "1,8,64",
                                           "--decode-contexts", "1k,128k"]), cpu=False)
    assert dec["batches"] == (1, 8, 64) and dec["contexts"] == (1024, 131072)
    assert "batches" not in suite.decode_grid(ap.parse_args([]), cpu=False)
    with pytest.raises(ValueError, match="--decode-batches"):
        suite.decode_grid(ap.parse_args(["--decode-batches", "0"]), cpu=False)
    with pytest.raises(ValueError, match="--decode-contexts entry"):
        suite.decode_grid(ap.parse_args(["--decode-contexts", ","]), cpu=False)


def test_spec_grid_tree_and_table():
    torch = pytest.importorskip("torch")
    import suite  # noqa: PLC0415
    g = torch.Generator().manual_seed(3)
    for n in (1, 4, 8, 40):
        m = suite.draft_tree(torch, n, g)
        assert m.shape == (n, (n + 31) // 32) and m.dtype == torch.int32
        bits = [[(int(m[i, t // 32]) >> (t % 32)) & 1 for t in range(n)] for i in range(n)]
        for i in range(n):
            assert bits[i][i] == 1 and not any(bits[i][i + 1:])  # itself, no later draft
            seen = [t for t in range(i) if bits[i][t]]
            if seen:  # a chain: its parent (the latest) and the parent's own row, exactly
                p = max(seen)
                assert seen == [t for t in range(p + 1) if bits[p][t]]
    rows = [R.row("spec", "flashattn", "bf16", 128, True, 4096, 8, 32, "spec", heads_kv=8,
                  ms=0.05, tbps=2.5, layout="linear 1"),
            R.row("spec", "flashattn", "bf16", 128, True, 4096, 8, 32, "spec", heads_kv=8,
                  ms=0.08, tbps=1.6, layout="linear 4"),
            R.na("spec", "flashattn", "bf16", 128, True, 4096, 8, 32, "spec", "no kernel",
                 heads_kv=8, layout="tree 4")]
    head, body = _parse(R.spec_table(rows))
    assert head[:2] == ["context", "1 token: us"]
    assert body == [["4k", "50.0", "80.0 (20.0, 0.40)", "n/a (no kernel)"]]


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


# ----------------------------------------------------------------- issue 18: best peer, FA4,
# kernel-family columns, options, prefill chunk


def _cell(impls_tflops, dirn="fwd", d=128, causal=False, s=16384):
    b, h = R.shape_for(R.STANDARD, d, s)
    rows = []
    for impl, t in impls_tflops.items():
        if t is None:
            rows.append(R.na("standard", impl, "bf16", d, causal, s, b, h, dirn, "no kernel"))
        else:
            rows.append(R.row("standard", impl, "bf16", d, causal, s, b, h, dirn, ms=1.0,
                              tflops=float(t), reps=3))
    return rows


def test_best_peer_is_the_fastest_of_fa4_cudnn_fa2_that_ran(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        t = {p: (None if rng.random() < 0.3 else float(rng.uniform(100, 800)))
             for p in ("fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "naive")}
        cell = {r["impl"]: r for r in _cell(t)}
        name, r = R.best_peer(cell)
        ran = {p: v for p, v in t.items() if v is not None and p in ("fa4", "sdpa_cudnn", "sdpa_flash")}
        if not ran:
            assert (name, r) == (None, None)
        else:
            assert name == max(ran, key=ran.get) and r["tflops"] == ran[name]
    # efficient and naive never count, even when faster.
    cell = {r["impl"]: r for r in _cell({"sdpa_flash": 300, "sdpa_efficient": 900, "naive": 999})}
    assert R.best_peer(cell)[0] == "sdpa_flash"


def test_best_table_is_printed_last_with_the_ratios():
    rows = (_cell({"flashattn": 359, "fa4": 676, "sdpa_cudnn": 612, "sdpa_flash": 353})
            + _cell({"flashattn": 318, "fa4": 619, "sdpa_cudnn": 540, "sdpa_flash": 304},
                    dirn="bwd")
            + _cell({"flashattn": 300, "fa4": None, "sdpa_cudnn": 500, "sdpa_flash": 250},
                    d=256, causal=True))
    text = R.report({"commit": "13e9967", "device": "NVIDIA H200"}, rows)
    last = text.rstrip().split("\n## ")[-1]
    assert last.startswith("flashattn / best peer")
    head, body = _parse(last)
    assert head == ["dtype", "dir", "hdim", "causal", "seqlen", "flashattn", "best peer",
                    "flashattn / best", "/ fa4", "/ cudnn", "/ fa2"]
    by = {(l[1], l[2], l[3]): l for l in body}
    fwd = by[("fwd", "128", "no")]
    assert fwd[5:] == ["359", "fa4 676", f"**{359 / 676:.2f}**", f"{359 / 676:.2f}",
                       f"{359 / 612:.2f}", f"{359 / 353:.2f}"]
    assert by[("bwd", "128", "no")][6] == "fa4 619"
    c = by[("fwd", "256", "yes")]            # FA4 n/a: cuDNN is the best peer
    assert c[6] == "cudnn 500" and c[7] == "**0.60**" and c[8] == "n/a"


def test_fa4_absent_gives_no_column_and_the_tables_still_work(seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)                              # FA2 and cuDNN only
    head, _ = _parse(R.best_table(rows))
    assert "/ fa4" not in head and head[-2:] == ["/ cudnn", "/ fa2"]
    head, _ = _parse(R.ratio_table(rows))
    assert "vs fa4" not in head


def test_load_fa4_reports_why_it_is_absent(monkeypatch):
    import suite  # noqa: PLC0415  (no torch needed to import it)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    mod, version, reason = suite.load_fa4()
    assert mod is None and version is None
    assert reason.startswith(("ModuleNotFoundError", "ImportError"))


def test_family_columns_in_every_table():
    rows = []
    for fam, t in (("flashattn", 359), ("flashattn-sm80", 340), ("flashattn-sm90", 600)):
        rows += _cell({fam: t})
    rows += _cell({"fa4": 676, "sdpa_cudnn": 612, "sdpa_flash": 353})
    assert R.ours_in(rows, "standard") == ["flashattn", "flashattn-sm80", "flashattn-sm90"]
    head, body = _parse(R.best_table(rows))
    assert head[5:11] == ["flashattn", "flashattn-sm80", "flashattn-sm90", "best peer",
                          "flashattn / best", "flashattn-sm80 / best"]
    assert body[0][5:8] == ["359", "340", "600"]
    assert body[0][9:12] == ["**0.53**", "**0.50**", "**0.89**"]
    head, body = _parse(R.ratio_table(rows))
    assert head[7:9] == ["flashattn-sm80 /best", "flashattn-sm90 /best"]
    assert body[0][7:9] == [f"{340 / 676:.2f} (340)", f"{600 / 676:.2f} (600)"]
    assert "vs flashattn-sm80" not in head          # a family column is not a peer
    head, _ = _parse(R.summary_table(rows))
    assert head[:5] == ["dtype", "dir", "vs best", "flashattn-sm80 vs best",
                        "flashattn-sm90 vs best"]
    assert R.family_impl("auto") == "flashattn" and R.family_impl("sm80") == "flashattn-sm80"
    assert R.is_ours("flashattn-sm90") and not R.is_ours("fa4")


def test_options_select_subsets():
    import suite  # noqa: PLC0415
    ap = suite.build_parser()
    a = ap.parse_args(["--only", "fwd", "--hdims", "64,128,256", "--seqlens", "512,16k",
                       "--dtypes", "bf16", "--causal", "yes", "--prefill-chunk",
                       "--grids", "standard"])
    grid, grids, names, fams = suite.resolve(a, cpu=False)
    assert grids == ["standard", "prefill"] and fams == []
    assert grid["directions"] == ("fwd",) and grid["hdims"] == (64, 128, 256)
    assert grid["seqlens"] == (512, 16384) and grid["dtypes"] == ("bf16",)
    assert grid["causals"] == (True,)
    assert names == list(R.GPU_IMPLS)
    cells = R.standard_cells(grid)
    assert len(cells) == 3 * 2 and {c[4] for c in cells} == {"fwd"}
    a = ap.parse_args(["--families", "sm80,auto", "--impls", "flashattn,fa4,sdpa_cudnn"])
    grid, grids, names, fams = suite.resolve(a, cpu=False)
    assert fams == ["sm80", "auto"] and names == ["flashattn-sm80", "fa4", "sdpa_cudnn"]
    assert grid == dict(R.STANDARD, causals=(False, True))
    for bad in (["--only", "sideways"], ["--families", "sm70"], ["--grids", "nope"],
                ["--families", "auto,auto"], ["--hdims", "x"]):
        with pytest.raises(ValueError):
            suite.resolve(ap.parse_args(bad), cpu=False)
    assert suite.main(["--only", "sideways"]) == 2     # a usage error before torch loads


def test_family_subprocess_command_and_failure(monkeypatch, tmp_path):
    import subprocess as sp  # noqa: PLC0415

    import suite  # noqa: PLC0415
    a = suite.build_parser().parse_args(["--families", "auto,sm80", "--only", "fwd,bwd",
                                         "--hdims", "128", "--seqlens", "4k,16k"])
    grid, _, _, _ = suite.resolve(a, cpu=False)
    a.budget_ms, a.min_reps, a.max_reps, a.sets = 25.0, 3, 30, 3
    cmd = suite.family_command(a, grid, "sm80", str(tmp_path))
    sub = suite.build_parser().parse_args(cmd[2:])
    g2, grids2, names2, fams2 = suite.resolve(sub, cpu=False)
    assert sub.worker and sub.no_gemm and grids2 == ["standard"]
    assert fams2 == ["sm80"] and names2 == ["flashattn-sm80"]
    assert R.standard_cells(g2) == R.standard_cells(grid)
    seen = {}

    def fake_run(cmd, env, cwd):
        seen["env"] = env
        return sp.CompletedProcess(cmd, 3)
    monkeypatch.setattr(suite.subprocess, "run", fake_run)
    rows = []
    assert suite.run_family(a, grid, "sm80", str(tmp_path), rows) == 3
    assert seen["env"]["FLASHATTN_KERNEL_FAMILY"] == "sm80"
    assert len(rows) == len(R.standard_cells(grid))
    assert all(r["impl"] == "flashattn-sm80" and r["status"] == "n/a" for r in rows)
    # With results: its standard rows are taken as they are.
    good = _cell({"flashattn-sm80": 340})
    R.write_json(tmp_path / "results.json", {}, good)
    rows = []
    suite.run_family(a, grid, "sm80", str(tmp_path), rows)
    assert [r["tflops"] for r in rows] == [340.0]


def test_prefill_flops_counts_the_visible_keys(seed):
    rng = np.random.default_rng(seed)
    for _ in range(10):
        sq = int(rng.integers(1, 60))
        sk = sq + int(rng.integers(0, 100))
        b, h, d = (int(x) for x in rng.integers(1, 5, 3))
        keys = sum(sk - sq + i + 1 for i in range(sq))      # bottom-right causal
        assert R.prefill_flops(b, h, sq, sk, d) == 4 * b * h * d * keys
    # s_q = s_k: the causal half (plus the diagonal) of the square.
    assert R.prefill_flops(1, 1, 4, 4, 1) == 4 * 10
    assert R.gemm_flops(8192) == 2 * 8192 ** 3


def test_prefill_table_and_gemm_line():
    rows = [R.row("prefill", "flashattn", "bf16", 128, True, 32768, 1, 32, "fwd", heads_kv=8,
                  ms=2.0, tflops=500.0, layout="dense"),
            R.row("prefill", "fa4", "bf16", 128, True, 32768, 1, 32, "fwd", heads_kv=8,
                  ms=1.6, tflops=625.0, layout="dense"),
            R.row("prefill", "flashattn", "bf16", 128, True, 32768, 1, 32, "fwd", heads_kv=8,
                  ms=2.2, tflops=450.0, layout="paged 16"),
            R.na("prefill", "fa4", "bf16", 128, True, 32768, 1, 32, "fwd", "page size",
                 heads_kv=8, layout="paged 16"),
            R.row("gemm", "torch.matmul", "bf16", 0, False, 8192, 1, 1, "gemm", ms=1.4,
                  tflops=782.0)]
    _, body = _parse(R.prefill_table(rows))
    assert body == [["dense", "500 (2.00)", "625 (1.60)", "0.80 (fa4)"],
                    ["paged 16", "450 (2.20)", "n/a (page size)", "-"]]
    text = R.report({"prefill": {"seqlen_q": 2048, "seqlen_k": 32768}}, rows)
    assert "GEMM ceiling: bf16 8192^3 torch.matmul 782 TFLOP/s" in text
    assert "s_q 2048 (causal) against 32768 keys" in text


def test_csv_reads_files_without_the_layout_column(tmp_path):
    p = tmp_path / "old.csv"
    fields = [f for f in R.FIELDS if f != "layout"]
    with open(p, "w") as f:
        f.write(",".join(fields) + "\n")
        f.write("standard,flashattn,bf16,128,0,4096,4,16,16,fwd,1.5,300,,,5,ok,\n")
    (r,) = R.read_csv(p)
    assert r["layout"] == "" and r["tflops"] == 300.0


def test_cpu_run_end_to_end_with_two_family_columns(tmp_path):
    """The whole suite on the CPU, the standard grid's smallest cells, with --families
    auto,sm80 (the second in a subprocess) and the prefill chunk: every table is written."""
    pytest.importorskip("torch")
    pytest.importorskip("flashattn")
    import suite  # noqa: PLC0415
    out = tmp_path / "run"
    rc = suite.main(["--cpu", "--quick", "--grids", "standard,prefill", "--only", "fwd",
                     "--seqlens", "128", "--dtypes", "fp32", "--families", "auto,sm80",
                     "--budget-ms", "2", "--min-reps", "1", "--max-reps", "2", "--no-plot",
                     "--out", str(out)])
    assert rc == 0
    meta, rows = R.read_json(out / "results.json")
    assert meta["families"] == ["auto", "sm80"] and meta["gemm_tflops"] > 0
    impls = {r["impl"] for r in rows if r["grid"] == "standard"}
    assert impls == {"flashattn", "flashattn-sm80", "sdpa_cpu", "naive"}
    pre = [r for r in rows if r["grid"] == "prefill"]
    assert [r["layout"] for r in pre] == ["dense", "paged 16", "paged 256"]
    assert all(r["status"] == "ok" for r in pre), pre
    text = open(out / "report.md").read()
    assert "flashattn-sm80 / best" in text and "Prefill chunk" in text


# ----------------------------------------------------------------- standard-grid timing:
# CUDA graph replays or eager events (a fake torch: no GPU here)


class _FakeCuda:
    """A GPU clock advanced by the calls: an eager call costs host_ms + kernel_ms between
    its events (the host is slower than the kernel), a replayed one kernel_ms only."""

    def __init__(self, kernel_ms, host_ms, capturable=True):
        self.kernel_ms, self.host_ms, self.capturable = kernel_ms, host_ms, capturable
        self.clock, self.capturing, self.captured, self.replays = 0.0, False, 0, 0
        self.streams_entered = 0
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = cuda.clock

            def elapsed_time(self, other):
                return other.t - self.t

        class Stream:
            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def __init__(self):
                self.calls = 0

            def replay(self):
                cuda.replays += 1
                cuda.clock += self.calls * cuda.kernel_ms

        class graph:
            def __init__(self, g, stream=None):
                self.g = g

            def __enter__(self):
                cuda.capturing, cuda.captured = True, 0

            def __exit__(self, *exc):
                cuda.capturing = False
                self.g.calls = cuda.captured
                return False

        import contextlib

        @contextlib.contextmanager
        def stream(s):
            cuda.streams_entered += 1
            yield

        self.Event, self.Stream, self.CUDAGraph, self.graph, self.stream = (
            Event, Stream, CUDAGraph, graph, stream)

    def current_stream(self):
        return self.Stream()

    def synchronize(self):
        pass

    def empty_cache(self):
        pass

    def call(self):
        if self.capturing:
            if not self.capturable:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.captured += 1
        else:
            self.clock += self.host_ms + self.kernel_ms


class _FakeTorch:
    def __init__(self, cuda):
        self.cuda = cuda


def test_graph_rounds():
    import suite  # noqa: PLC0415
    assert suite.graph_rounds(0.1, 3, 2.0, 16) == 7          # ceil(2 / 0.3)
    assert suite.graph_rounds(0.001, 3, 2.0, 16) == 16       # at most max_rounds
    assert suite.graph_rounds(50.0, 3, 2.0, 16) == 1         # at least one round
    assert suite.graph_rounds(float("nan"), 3, 2.0, 16) == 16


def test_time_cell_graph_replays_hide_the_host_time():
    import suite  # noqa: PLC0415
    cuda = _FakeCuda(kernel_ms=0.128, host_ms=0.06)
    timer = suite.Timer(_FakeTorch(cuda), False, 25.0, 3, 30, timing="graph")
    calls = [cuda.call] * 3
    with timer.cell_stream():
        ms, reps, how = timer.time_cell(calls)
    assert cuda.streams_entered == 1
    assert ms == pytest.approx(0.128)                        # the kernel only
    rounds = suite.graph_rounds(0.188, 3, timer.GRAPH_MS, timer.GRAPH_MAX_ROUNDS)
    n = 3 * rounds
    assert cuda.captured == n and how == f"CUDA graph, {n} calls per replay"
    assert reps == R.repeats_for(0.188 * n, 25.0, 1, 30)
    assert cuda.replays == reps + 1                          # a warm-up replay
    # eager: the host time shows (events around every call)
    cuda = _FakeCuda(kernel_ms=0.128, host_ms=0.06)
    timer = suite.Timer(_FakeTorch(cuda), False, 25.0, 3, 30, timing="eager")
    with timer.cell_stream():
        ms, reps, how = timer.time_cell([cuda.call] * 3)
    assert ms == pytest.approx(0.188) and how == "eager" and cuda.streams_entered == 0
    assert cuda.replays == 0 and reps == 30


def test_time_cell_falls_back_to_eager_when_capture_fails():
    import suite  # noqa: PLC0415
    cuda = _FakeCuda(kernel_ms=1.0, host_ms=0.5, capturable=False)
    timer = suite.Timer(_FakeTorch(cuda), False, 25.0, 3, 30, timing="graph")
    with timer.cell_stream():
        ms, reps, how = timer.time_cell([cuda.call] * 2)
    assert ms == pytest.approx(1.5) and reps == 16
    assert how.startswith("eager: CUDA graph capture failed (RuntimeError: operation not "
                          "permitted") and cuda.replays == 0


def test_time_cell_on_the_cpu_is_the_host_clock():
    import suite  # noqa: PLC0415
    timer = suite.Timer(None, True, 5.0, 2, 4, timing="graph")
    assert timer.timing == "eager"
    n = []
    ms, reps, how = timer.time_cell([lambda: n.append(1)])
    assert how == "" and 2 <= reps <= 4 and ms >= 0 and len(n) == 2 + reps


def test_timing_option():
    import suite  # noqa: PLC0415
    ap = suite.build_parser()
    assert suite.timing_mode(ap.parse_args([]), cpu=False) == "graph"
    assert suite.timing_mode(ap.parse_args(["--timing", "eager"]), cpu=False) == "eager"
    assert suite.timing_mode(ap.parse_args([]), cpu=True) == "host clock"
    with pytest.raises(SystemExit):
        ap.parse_args(["--timing", "sometimes"])
    with pytest.raises(ValueError, match="--timing graph"):
        suite.resolve(ap.parse_args(["--timing", "graph"]), cpu=True)
    assert suite.main(["--cpu", "--timing", "graph"]) == 2  # before torch loads
    # a family subprocess times like its parent
    a = ap.parse_args(["--families", "auto,sm80", "--timing", "eager"])
    grid, _, _, _ = suite.resolve(a, cpu=False)
    a.budget_ms, a.min_reps, a.max_reps, a.sets = 25.0, 3, 30, 3
    cmd = suite.family_command(a, grid, "sm80", "/tmp/x")
    assert cmd[cmd.index("--timing") + 1] == "eager"
    a = ap.parse_args(["--families", "auto,sm80"])
    a.budget_ms, a.min_reps, a.max_reps, a.sets = 25.0, 3, 30, 3
    cmd = suite.family_command(a, grid, "sm80", "/tmp/x")
    assert cmd[cmd.index("--timing") + 1] == "graph"


def test_measure_cell_records_how_it_was_timed(seed):
    torch = pytest.importorskip("torch")
    pytest.importorskip("flashattn")
    import suite  # noqa: PLC0415

    class Timer(suite.Timer):
        def time_cell(self, calls):
            ms, reps = self.time(calls)
            return ms, reps, "CUDA graph, 6 calls per replay"

    impls = suite.Impls(torch, cpu=True)
    timer = Timer(torch, True, budget_ms=2.0, min_reps=1, max_reps=2)
    pool = torch.randn(2, 4, 2 * 8 * 2 * 16, dtype=torch.float32)
    r = suite.measure_cell(torch, impls, timer, pool, "flashattn", "fwd", 2, 8, 2, 16, True, 2)
    assert r[0] == "ok" and r[3] == "CUDA graph, 6 calls per replay"


def test_cpu_decode_grid_follows_dtypes_and_runs_each(seed):
    import suite  # noqa: PLC0415
    ap = suite.build_parser()
    assert suite.decode_grid(ap.parse_args([]), cpu=True)["dtypes"] == ("fp32", "bf16")
    assert suite.decode_grid(ap.parse_args(["--dtypes", "bf16"]), cpu=True)["dtypes"] == ("bf16",)
    # The GPU grid stays bf16 whatever the standard grid's dtypes.
    assert suite.decode_dtypes(suite.decode_grid(ap.parse_args(["--dtypes", "fp16"]), cpu=False)) \
        == ("bf16",)
    torch = pytest.importorskip("torch")
    pytest.importorskip("flashattn")
    torch.manual_seed(seed)
    impls = suite.Impls(torch, cpu=True)
    timer = suite.Timer(torch, True, budget_ms=2.0, min_reps=2, max_reps=3)
    args = ap.parse_args(["--cpu", "--dtypes", "bf16,fp32"])
    args.sets = 2
    cfg = dict(suite.decode_grid(args, cpu=True), contexts=(67, 130))

    class NoProgress:
        def update(self, _):
            pass
    rows = []
    suite.run_decode(torch, impls, timer, cfg, True, args, rows, NoProgress())
    assert {(r["dtype"], r["seqlen"], r["impl"]) for r in rows} == {
        (dt, s, i) for dt in ("bf16", "fp32") for s in (67, 130) for i in ("flashattn", "sdpa_cpu")}
    for r in rows:
        assert r["status"] == "ok" and r["ms"] > 0, r
        assert "interleaved rounds" in r["note"]
    _, body = _parse(R.decode_table(rows))
    assert [row[:2] for row in body] == [["bf16", "67"], ["bf16", "130"], ["fp32", "67"],
                                         ["fp32", "130"]]
