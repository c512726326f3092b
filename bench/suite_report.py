"""The parts of the unified benchmark (bench/suite.py) that need neither torch nor a GPU:
the grids, FLOP and byte counts, the repeat budget, the result rows, the ratio tables,
CSV / JSON writing and reading, the progress bar and the plots (matplotlib, optional).

Tested by tests/python/test_bench_suite.py without torch.
"""

import csv
import datetime
import json
import math
import os
import sys
import time

# ----------------------------------------------------------------- grids

STANDARD = dict(tokens=16384, model_dim=2048, hdims=(64, 128, 256),
                seqlens=(512, 1024, 2048, 4096, 8192, 16384), dtypes=("bf16", "fp16"))
QUICK = dict(tokens=16384, model_dim=2048, hdims=(64, 128), seqlens=(1024, 4096, 16384),
             dtypes=("bf16",))
CPU = dict(tokens=2048, model_dim=256, hdims=(64, 128), seqlens=(128, 256, 512, 1024),
           dtypes=("fp32", "bf16"))
CPU_QUICK = dict(tokens=1024, model_dim=128, hdims=(64,), seqlens=(128, 512), dtypes=("fp32",))

DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
CAUSALS = (False, True)
DECODE = dict(batch=8, heads=32, heads_kv=8, hdim=128, contexts=(4096, 32768, 131072),
              dtype="bf16")
# The CPU decode grid runs each of its dtypes (--dtypes replaces them): fp32 (computed in fp64
# by the CPU backend's exactness rule) and bf16 (issue 24's target).
DECODE_CPU = dict(batch=2, heads=8, heads_kv=2, hdim=64, contexts=(1024, 4096),
                  dtypes=("fp32", "bf16"))
# Speculative decoding (issue 23, --grids spec): s_q draft tokens verified in one call (the
# last s_q keys of each sequence are the drafts), linear (causal) and as a draft tree
# (tree_mask), against one-token decode on the same dense cache; flashattn alone (no peer
# takes a tree); time per token.
SPEC = dict(batch=8, heads=32, heads_kv=8, hdim=128, dtype="bf16", contexts=(4096, 32768),
            drafts=(1, 4, 8))
SPEC_CPU = dict(batch=2, heads=8, heads_kv=2, hdim=64, dtype="fp32", contexts=(512, 2048),
                drafts=(1, 4, 8))
# Memory sweep: forward + backward, batch 1, 16 heads, hdim 128, bf16, non-causal.
MEMORY = dict(batch=1, heads=16, hdim=128, dtype="bf16",
              seqlens=(1024, 2048, 4096, 8192, 16384, 32768, 65536))
MEMORY_CPU = dict(batch=1, heads=4, hdim=64, dtype="fp32", seqlens=(512, 1024, 2048, 4096))
# Prefill chunk (--prefill-chunk): s_q new tokens (causal, bottom-right aligned) against a
# cache of s_k keys (the chunk's own keys included), dense and paged with each block size.
PREFILL = dict(batch=1, heads=32, heads_kv=8, hdim=128, dtype="bf16", seqlen_q=2048,
               seqlen_k=32768, blocks=(16, 256))
PREFILL_CPU = dict(batch=1, heads=4, heads_kv=2, hdim=64, dtype="fp32", seqlen_q=128,
                   seqlen_k=1024, blocks=(16, 256))
# The GEMM ceiling measured in the same run: an n^3 matmul.
GEMM = dict(n=8192, dtype="bf16")
GEMM_CPU = dict(n=512, dtype="fp32")

GPU_IMPLS = ("flashattn", "fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
             "naive")
CPU_IMPLS = ("flashattn", "sdpa_cpu", "naive")
OURS = "flashattn"
# The peers flashattn is measured against in the "best peer" ratio: FlashAttention-4,
# cuDNN (SDPA CUDNN_ATTENTION) and FlashAttention-2 (SDPA FLASH_ATTENTION). On the CPU:
# torch's SDPA.
BEST_PEERS = ("fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_cpu")
FAMILIES = ("auto", "sm80", "sm90")


def is_ours(impl):
    """flashattn, or flashattn under a forced kernel family ('flashattn-sm80')."""
    return impl == OURS or str(impl).startswith(OURS + "-")


def family_impl(family):
    """The column of flashattn under a kernel family: 'flashattn' for auto (or none)."""
    return OURS if family in (None, "", "auto") else f"{OURS}-{family}"


def parse_list(text, conv=str, allowed=None, what="value"):
    """'a,b' -> [conv(a), conv(b)]; seqlens accept '16k'; raises ValueError naming what."""
    out = []
    for x in str(text).split(","):
        x = x.strip()
        if not x:
            continue
        if conv is int and x.lower().endswith("k"):
            v = int(x[:-1]) * 1024
        else:
            v = conv(x)
        if allowed is not None and v not in allowed:
            raise ValueError(f"{what} {x!r}: expected one of {', '.join(map(str, allowed))}")
        out.append(v)
    if not out:
        raise ValueError(f"no {what} in {text!r}")
    return out

LABELS = {
    "flashattn": "flashattn",
    "fa4": "FlashAttention-4 (flash_attn.cute)",
    "sdpa_flash": "SDPA FLASH_ATTENTION (FlashAttention-2)",
    "sdpa_cudnn": "SDPA CUDNN_ATTENTION",
    "sdpa_efficient": "SDPA EFFICIENT_ATTENTION",
    "sdpa_math": "SDPA MATH",
    "sdpa_cpu": "SDPA (CPU)",
    "naive": "naive (matmul, softmax, matmul)",
}
SHORT = {"flashattn": "ours", "fa4": "fa4", "sdpa_flash": "fa2", "sdpa_cudnn": "cudnn",
         "sdpa_efficient": "efficient", "sdpa_math": "math", "sdpa_cpu": "sdpa", "naive": "naive"}


def shape_for(grid, hdim, seqlen):
    """(batch, heads) of a standard-grid cell: batch * seqlen = tokens, heads * hdim = model dim."""
    return max(1, grid["tokens"] // seqlen), grid["model_dim"] // hdim


def standard_cells(grid, directions=None):
    """Every (dtype, hdim, causal, seqlen, direction) of a grid, in measuring order
    (grid['directions'] and grid['causals'] select subsets)."""
    directions = directions or grid.get("directions", DIRECTIONS)
    return [(dt, d, c, s, dirn) for dt in grid["dtypes"] for d in grid["hdims"]
            for c in grid.get("causals", CAUSALS) for s in grid["seqlens"] for dirn in directions]


def prefill_flops(batch, heads, seqlen_q, seqlen_k, hdim):
    """4 * b * h * d * (keys the queries see): causal, bottom-right aligned, so query i of
    s_q sees s_k - s_q + i + 1 keys."""
    keys = seqlen_q * (seqlen_k - seqlen_q) + seqlen_q * (seqlen_q + 1) // 2
    return 4.0 * batch * heads * hdim * keys


def gemm_flops(n):
    return 2.0 * n ** 3


# ----------------------------------------------------------------- counts


def attention_flops(batch, heads, seqlen_q, seqlen_k, hdim, causal, direction):
    """The FlashAttention papers' count: 4 * b * h * s_q * s_k * d for the forward (two
    GEMMs), halved when causal; the backward is 2.5 x the forward (five GEMMs, one of
    them recomputing S); forward + backward is 3.5 x."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * hdim
    if causal:
        f /= 2.0
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[direction]


def kv_bytes(batch, seqlen, heads_kv, hdim, elem_bytes=2):
    """Bytes of K and V a decode step reads once: b * s * h_k * d * elem * 2."""
    return 2 * batch * seqlen * heads_kv * hdim * elem_bytes


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def tbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def repeats_for(estimate_ms, budget_ms, min_reps, max_reps):
    """How many timed repeats fit a per-measurement budget, given one call's estimate."""
    if not estimate_ms or estimate_ms <= 0 or math.isnan(estimate_ms):
        return max_reps
    return int(max(min_reps, min(max_reps, budget_ms // estimate_ms)))


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan")
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


# ----------------------------------------------------------------- rows

FIELDS = ("grid", "impl", "dtype", "hdim", "causal", "seqlen", "batch", "heads", "heads_kv",
          "direction", "layout", "ms", "tflops", "tbps", "peak_gib", "reps", "status", "note")


def row(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction, heads_kv=None,
        ms=None, tflops=None, tbps=None, peak_gib=None, reps=0, status="ok", note="",
        layout=""):
    return dict(grid=grid, impl=impl, dtype=dtype, hdim=int(hdim), causal=bool(causal),
                seqlen=int(seqlen), batch=int(batch), heads=int(heads),
                heads_kv=int(heads if heads_kv is None else heads_kv), direction=direction,
                layout=layout, ms=ms, tflops=tflops, tbps=tbps, peak_gib=peak_gib,
                reps=int(reps), status=status, note=note)


def na(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction, reason, heads_kv=None,
       layout=""):
    """A cell a peer does not run: status 'n/a' and the reason."""
    return row(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction,
               heads_kv=heads_kv, status="n/a", note=short_reason(reason), layout=layout)


def short_reason(reason, limit=160):
    text = " ".join(str(reason).split())
    if "out of memory" in text.lower():
        return "out of memory"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------- files


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in rows:
            w.writerow([_csv_value(r.get(k)) for k in FIELDS])


def read_csv(path):
    ints = ("hdim", "seqlen", "batch", "heads", "heads_kv", "reps")
    floats = ("ms", "tflops", "tbps", "peak_gib")
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for k in ints:
                r[k] = int(r[k]) if r[k] != "" else 0
            for k in floats:
                r[k] = float(r[k]) if r[k] != "" else None
            r["causal"] = r["causal"] == "1"
            r.setdefault("layout", "")
            r["layout"] = r["layout"] or ""
            out.append(r)
    return out


def _json_clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    if isinstance(v, dict):
        return {k: _json_clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_clean(x) for x in v]
    return v


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump(_json_clean({"meta": meta, "results": rows}), f, indent=1)
        f.write("\n")


def read_json(path):
    with open(path) as f:
        data = json.load(f)
    return data["meta"], data["results"]


def default_out_dir(root, device_name, when=None):
    when = when or datetime.datetime.now(datetime.timezone.utc)
    slug = "".join(ch if ch.isalnum() else "-" for ch in device_name.lower()).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return os.path.join(root, f"{when:%Y%m%d-%H%M}-{slug or 'device'}")


# ----------------------------------------------------------------- tables


def _index(rows, grid):
    idx = {}
    for r in rows:
        if r["grid"] == grid:
            idx[(r["dtype"], r["direction"], r["hdim"], bool(r["causal"]), r["seqlen"],
                 r["impl"])] = r
    return idx


def _ok(r, key="tflops"):
    return r is not None and r.get("status") == "ok" and r.get(key) not in (None, 0) \
        and not (isinstance(r.get(key), float) and math.isnan(r[key]))


def ratio(ours, peer, key="tflops"):
    """ours / peer of a throughput, or None when either is missing."""
    if not (_ok(ours, key) and _ok(peer, key)):
        return None
    return ours[key] / peer[key]


ORDER = ("flashattn", "fa4", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math",
         "sdpa_cpu", "naive")


def impls_in(rows, grid):
    """The implementations of a grid's rows: flashattn first, then its family columns, then
    the peers in ORDER, then any other."""
    seen = {r["impl"] for r in rows if r["grid"] == grid}
    fams = sorted(i for i in seen if is_ours(i) and i != OURS)
    order = [OURS] + fams + [i for i in ORDER if i != OURS]
    return [i for i in order if i in seen] + sorted(seen - set(order))


def ours_in(rows, grid):
    """The flashattn columns of a grid ('flashattn' first, then one per forced family)."""
    return [i for i in impls_in(rows, grid) if is_ours(i)]


def best_peer(cell_rows, key="tflops", peers=BEST_PEERS):
    """(impl, row) of the fastest of the best-peer set among a cell's rows {impl: row}
    that ran, or (None, None)."""
    best = (None, None)
    for p in peers:
        r = cell_rows.get(p)
        if _ok(r, key) and (best[1] is None or r[key] > best[1][key]):
            best = (p, r)
    return best


def _cells(idx):
    return sorted({k[:5] for k in idx},
                  key=lambda k: (k[0], DIRECTIONS.index(k[1]) if k[1] in DIRECTIONS else 9,
                                 k[2], k[3], k[4]))


def _by_cell(idx):
    out = {}
    for k, r in idx.items():
        out.setdefault(k[:5], {})[k[5]] = r
    return out


def _ratio_text(q, peer_row, k=1.0, key="tflops"):
    return f"{q:.2f} ({peer_row[key] * k:.0f})"


def ratio_table(rows, grid="standard", unit="TFLOP/s"):
    """Markdown: one line per cell; our TFLOP/s, ours / best peer (the best of FA4, cuDNN
    and FA2 that ran, named), then per other column 'ours/peer (peer TFLOP/s)' or 'n/a'.
    A forced-family column (flashattn-sm80) shows its own ratio to the best peer and its
    TFLOP/s. unit 'GFLOP/s' prints GFLOP/s (the CPU mode)."""
    k = 1e3 if unit == "GFLOP/s" else 1.0
    idx = _index(rows, grid)
    ours = ours_in(rows, grid)
    main = ours[0] if ours else OURS
    fams = ours[1:]
    peers = [i for i in impls_in(rows, grid) if not is_ours(i)]
    head = ["dtype", "dir", "hdim", "causal", "seqlen", f"{SHORT.get(main, main)} {unit}",
            "vs best"] + [f"{f} /best" for f in fams] + [f"vs {SHORT.get(p, p)}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = _by_cell(idx)
    for c in _cells(idx):
        cell = by[c]
        o = cell.get(main)
        bname, brow = best_peer(cell)
        cols = [c[0], c[1], str(c[2]), "yes" if c[3] else "no", _seq(c[4]),
                f"{o['tflops'] * k:.1f}" if _ok(o) else "n/a"]
        q = ratio(o, brow)
        cols.append(f"{q:.2f} ({SHORT.get(bname, bname)})" if q is not None else "-")
        for f in fams:
            q = ratio(cell.get(f), brow)
            cols.append(_ratio_text(q, cell[f], k) if q is not None else
                        ("n/a" if f in cell and not _ok(cell[f]) else "-"))
        for p in peers:
            pr = cell.get(p)
            q = ratio(o, pr)
            if q is not None:
                cols.append(_ratio_text(q, pr, k))
            elif pr is not None and pr.get("status") != "ok":
                cols.append("n/a")
            else:
                cols.append("-")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def best_table(rows, grid="standard", unit="TFLOP/s"):
    """Markdown, the short table printed last: per cell, each flashattn column's TFLOP/s,
    the best peer (name and TFLOP/s), each flashattn column / best peer, then flashattn /
    FA4, / cuDNN, / FA2 (those of them measured)."""
    k = 1e3 if unit == "GFLOP/s" else 1.0
    idx = _index(rows, grid)
    ours = ours_in(rows, grid)
    seen = set(impls_in(rows, grid))
    peers = [p for p in BEST_PEERS if p in seen]
    head = ["dtype", "dir", "hdim", "causal", "seqlen"] + \
        [f"{o if o != OURS else 'flashattn'}" for o in ours] + ["best peer"] + \
        [f"{o if o != OURS else 'flashattn'} / best" for o in ours] + \
        [f"/ {SHORT.get(p, p)}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = _by_cell(idx)
    for c in _cells(idx):
        cell = by[c]
        bname, brow = best_peer(cell)
        cols = [c[0], c[1], str(c[2]), "yes" if c[3] else "no", _seq(c[4])]
        cols += [f"{cell[o]['tflops'] * k:.0f}" if _ok(cell.get(o)) else "n/a" for o in ours]
        cols.append(f"{SHORT.get(bname, bname)} {brow['tflops'] * k:.0f}" if brow else "n/a")
        for o in ours:
            q = ratio(cell.get(o), brow)
            cols.append(f"**{q:.2f}**" if q is not None else "-")
        main = cell.get(ours[0]) if ours else None
        for p in peers:
            q = ratio(main, cell.get(p))
            cols.append(f"{q:.2f}" if q is not None else "n/a")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _summary_text(rs, missing):
    g = geomean(rs)
    txt = f"{g:.2f} ({min(rs):.2f}..{max(rs):.2f})" if g else "n/a"
    if missing:
        txt += f", {missing} n/a"
    return txt


def summary_table(rows, grid="standard", min_seqlen=0):
    """Markdown: per dtype x direction, the geometric mean (and min..max) of ours / best
    peer and of ours/peer over the cells both ran, and how many cells the peer could not
    run."""
    idx = _index(rows, grid)
    ours = ours_in(rows, grid)
    main = ours[0] if ours else OURS
    peers = [i for i in impls_in(rows, grid) if not is_ours(i)]
    keys = sorted({(k[0], k[1]) for k in idx},
                  key=lambda k: (k[0], DIRECTIONS.index(k[1]) if k[1] in DIRECTIONS else 9))
    head = ["dtype", "dir"] + [f"{o} vs best" if o != main else "vs best" for o in ours] + \
        [f"vs {SHORT.get(p, p)}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = _by_cell(idx)
    for dt, dirn in keys:
        cells = [c for c in by if c[0] == dt and c[1] == dirn and c[4] >= min_seqlen]
        cols = [dt, dirn]
        for o in ours:
            rs, missing = [], 0
            for c in cells:
                q = ratio(by[c].get(o), best_peer(by[c])[1])
                if q is None:
                    missing += 1
                else:
                    rs.append(q)
            cols.append(_summary_text(rs, missing))
        for p in peers:
            rs, missing = [], 0
            for c in cells:
                if p not in by[c]:
                    continue
                q = ratio(by[c].get(main), by[c][p])
                if q is None:
                    missing += 1
                else:
                    rs.append(q)
            cols.append(_summary_text(rs, missing))
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def decode_table(rows, unit="TB/s"):
    """Markdown: per context, our TB/s (us per call), ours / best peer, then each peer's
    TB/s (ours/peer); with rows of several dtypes (the CPU grid) or batches (the sweep), a
    row per dtype, batch and context, the dtype / batch in the first columns."""
    rs = [r for r in rows if r["grid"] == "decode"]
    if not rs:
        return ""
    k = 1e3 if unit == "GB/s" else 1.0
    peers = [i for i in impls_in(rows, "decode") if not is_ours(i)]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rs))
    batches = sorted({int(r["batch"]) for r in rs})
    several, several_b = len(dtypes) > 1, len(batches) > 1
    head = (["dtype"] if several else []) + (["batch"] if several_b else []) + \
        ["context", f"ours {unit} (us)", "vs best"] + \
        [f"{SHORT.get(p, p)} {unit} (ours/peer)" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["dtype"], int(r["batch"]), r["seqlen"], r["impl"]): r for r in rs}
    for dt in dtypes:
        for b in batches:
            for s in sorted({r["seqlen"] for r in rs if r["dtype"] == dt and int(r["batch"]) == b}):
                o = by.get((dt, b, s, OURS))
                bname, brow = best_peer({p: by.get((dt, b, s, p)) for p in peers}, "tbps")
                q = ratio(o, brow, "tbps")
                cols = ([dt] if several else []) + ([str(b)] if several_b else []) + [
                    _seq(s), f"{o['tbps'] * k:.2f} ({o['ms'] * 1e3:.0f})" if _ok(o, "tbps") else "n/a",
                    f"{q:.2f} ({SHORT.get(bname, bname)})" if q is not None else "-"]
                for p in peers:
                    pr = by.get((dt, b, s, p))
                    q = ratio(o, pr, "tbps")
                    if q is not None:
                        cols.append(f"{pr['tbps'] * k:.2f} ({q:.2f})")
                    elif _ok(pr, "tbps"):
                        cols.append(f"{pr['tbps'] * k:.2f} (-)")
                    else:
                        cols.append("n/a")
                lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def prefill_table(rows, unit="TFLOP/s"):
    """Markdown: per cache layout of the prefill chunk, each implementation's TFLOP/s (ms)
    and ours / best peer."""
    rs = [r for r in rows if r["grid"] == "prefill"]
    if not rs:
        return ""
    k = 1e3 if unit == "GFLOP/s" else 1.0
    impls = impls_in(rows, "prefill")
    head = ["cache"] + [f"{SHORT.get(i, i)} {unit} (ms)" for i in impls] + ["vs best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["layout"], r["impl"]): r for r in rs}
    layouts = []
    for r in rs:
        if r["layout"] not in layouts:
            layouts.append(r["layout"])
    for lay in layouts:
        cols = [lay]
        for i in impls:
            r = by.get((lay, i))
            cols.append(f"{r['tflops'] * k:.0f} ({r['ms']:.2f})" if _ok(r) else
                        (f"n/a ({r['note']})" if r is not None and r.get("note") else "n/a"))
        bname, brow = best_peer({i: by.get((lay, i)) for i in impls if not is_ours(i)},
                                peers=tuple(i for i in impls if not is_ours(i)))
        q = ratio(by.get((lay, OURS)), brow)
        cols.append(f"{q:.2f} ({SHORT.get(bname, bname)})" if q is not None else "-")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def spec_table(rows):
    """Markdown: per context, one-token decode's us per call, then for each draft count and
    kind (linear: causal; tree: a draft tree) us per call, us per token and the per-token
    cost against one-token decode."""
    rs = [r for r in rows if r["grid"] == "spec" and is_ours(r["impl"])]
    if not rs:
        return ""
    cols = [r["layout"] for r in rs if r["layout"] != "linear 1"]
    cols = list(dict.fromkeys(cols))
    head = ["context", "1 token: us"] + [f"{c}: us (per token, / 1 token)" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["seqlen"], r["layout"]): r for r in rs}
    for s in sorted({r["seqlen"] for r in rs}):
        one = by.get((s, "linear 1"))
        line = [_seq(s), f"{one['ms'] * 1e3:.1f}" if _ok(one, "ms") else "n/a"]
        for c in cols:
            r = by.get((s, c))
            if not _ok(r, "ms"):
                line.append(f"n/a ({r['note']})" if r is not None and r.get("note") else "n/a")
                continue
            n = int(c.split()[-1])
            per = r["ms"] * 1e3 / n
            rel = f", {per / (one['ms'] * 1e3):.2f}" if _ok(one, "ms") else ""
            line.append(f"{r['ms'] * 1e3:.1f} ({per:.1f}{rel})")
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


def memory_table(rows):
    rs = [r for r in rows if r["grid"] == "memory"]
    if not rs:
        return ""
    impls = impls_in(rows, "memory")
    lines = ["| seqlen | " + " | ".join(f"{SHORT.get(i, i)} peak GiB" for i in impls) + " |",
             "|" + "---|" * (len(impls) + 1)]
    by = {(r["seqlen"], r["impl"]): r for r in rs}
    for s in sorted({r["seqlen"] for r in rs}):
        cols = [_seq(s)]
        for i in impls:
            r = by.get((s, i))
            if r is None:
                cols.append("-")
            elif r["status"] == "ok" and r.get("peak_gib") is not None:
                cols.append(f"{r['peak_gib']:.3g}")
            else:
                cols.append(f"n/a ({r['note']})" if r.get("note") else "n/a")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def _seq(s):
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def meta_line(meta):
    keys = ("commit", "date", "device", "driver", "torch", "cuda", "cudnn", "flashattn", "fa4")
    return ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k))


def report(meta, rows):
    """Everything printed last: metadata, the GEMM ceiling, the full per-cell table (ours /
    every peer) and its summary, the decode, memory and prefill-chunk tables, and last the
    short table of flashattn / best peer per cell."""
    cpu = meta.get("mode") == "cpu"
    unit, bw = ("GFLOP/s", "GB/s") if cpu else ("TFLOP/s", "TB/s")
    k = 1e3 if cpu else 1.0
    parts = [f"# flashattn benchmark: {meta_line(meta)}"]
    if meta.get("wall_s"):
        parts.append("wall time: " + ", ".join(f"{k_} {v:.1f} s" for k_, v in meta["wall_s"].items()))
    if meta.get("fa4_note"):
        parts.append(meta["fa4_note"])
    if meta.get("families"):
        parts.append("kernel families: " + ", ".join(
            f"{f} -> {family_impl(f)}" for f in meta["families"]))
    gemm = [r for r in rows if r["grid"] == "gemm"]
    for g in gemm:
        parts.append(f"GEMM ceiling: {g['dtype']} {g['seqlen']}^3 torch.matmul "
                     + (f"{g['tflops'] * k:.0f} {unit}" if _ok(g) else f"n/a ({g['note']})"))
    for g in (r for r in rows if r["grid"] == "read"):
        parts.append(f"read ceiling: torch.sum of {g['seqlen'] * 4 / 2**30:g} GiB fp32 "
                     + (f"{g['tbps'] * k:.2f} {bw}" if _ok(g, "tbps") else f"n/a ({g['note']})"))
    if any(r["grid"] == "standard" for r in rows):
        parts += ["", f"## Standard grid: ours {unit}, ours / best peer, ours/peer (peer {unit}) per cell",
                  "", ratio_table(rows, unit=unit), "",
                  "## Summary: geometric mean of ours/peer (min..max) over the cells both ran", "",
                  summary_table(rows)]
    if any(r["grid"] == "decode" for r in rows):
        parts += ["", "## Decode: KV bytes read per second", "", decode_table(rows, bw)]
    if any(r["grid"] == "spec" for r in rows):
        parts += ["", "## Speculative decoding: s_q draft tokens in one call (linear: causal; "
                  "tree: a draft tree), time per token against one-token decode", "",
                  spec_table(rows)]
    if any(r["grid"] == "memory" for r in rows):
        parts += ["", "## Peak memory, forward + backward", "", memory_table(rows)]
    if any(r["grid"] == "prefill" for r in rows):
        p = meta.get("prefill") or {}
        parts += ["", f"## Prefill chunk: s_q {p.get('seqlen_q', '?')} (causal) against "
                  f"{p.get('seqlen_k', '?')} keys of KV cache, {unit}", "", prefill_table(rows, unit)]
    if any(r["grid"] == "standard" for r in rows):
        present = [SHORT[p] for p in BEST_PEERS if p in impls_in(rows, "standard")]
        parts += ["", f"## flashattn / best peer (best of {', '.join(present) or 'none'} "
                  f"that ran), {unit}", "", best_table(rows, unit=unit)]
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------- progress


class Progress:
    """tqdm when it is installed, else a one-line bar on stderr (a line every 5% when
    stderr is not a terminal)."""

    def __init__(self, total, desc="bench"):
        self.total, self.n, self.desc, self.t0 = max(1, total), 0, desc, time.time()
        self._last_pct = -1
        self._tqdm = None
        try:
            from tqdm import tqdm  # noqa: PLC0415
            self._tqdm = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
        except Exception:
            self._tty = sys.stderr.isatty()

    def update(self, label=""):
        self.n += 1
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(label, refresh=False)
            self._tqdm.update(1)
            return
        pct = int(100 * self.n / self.total)
        el = time.time() - self.t0
        eta = el / self.n * (self.total - self.n)
        width = 30
        fill = int(width * self.n / self.total)
        line = (f"{self.desc} [{'#' * fill}{'.' * (width - fill)}] {self.n}/{self.total} "
                f"{el:5.0f}s eta {eta:4.0f}s {label}")
        if self._tty:
            sys.stderr.write("\r" + line[:140].ljust(140))
            if self.n == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif pct // 5 != self._last_pct // 5 or self.n == self.total:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        self._last_pct = pct

    def close(self):
        if self._tqdm is not None:
            self._tqdm.close()


# ----------------------------------------------------------------- plots

_COLORS = {"flashattn": "#d62728", "fa4": "#17becf", "sdpa_flash": "#1f77b4", "sdpa_cudnn": "#2ca02c",
           "sdpa_efficient": "#ff7f0e", "sdpa_math": "#9467bd", "sdpa_cpu": "#1f77b4",
           "naive": "#7f7f7f"}


def _save(fig, path):
    """savefig, then (where Pillow is, as it is wherever matplotlib is) a 64-colour
    palette PNG: a quarter of the size, the same picture for line plots."""
    fig.savefig(path, dpi=80)
    try:
        from PIL import Image  # noqa: PLC0415
        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=64)
        small.save(path, optimize=True)
    except Exception:
        pass


def plot_all(meta, rows, out_dir):
    """PNG plots (needs matplotlib): per dtype and direction, TFLOP/s against seqlen with
    one panel per hdim x causal and a line per implementation; decode TB/s; peak memory.
    Returns the paths written."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    written = []
    title_dev = meta.get("device", "")
    std = [r for r in rows if r["grid"] == "standard"]
    unit = "GFLOP/s" if meta.get("mode") == "cpu" else "TFLOP/s"
    scale = 1e3 if unit == "GFLOP/s" else 1.0
    names = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}
    for dt in sorted({r["dtype"] for r in std}):
        for dirn in DIRECTIONS:
            rs = [r for r in std if r["dtype"] == dt and r["direction"] == dirn]
            if not rs:
                continue
            hdims = sorted({r["hdim"] for r in rs})
            fig, axes = plt.subplots(2, len(hdims), figsize=(4.2 * len(hdims), 6.4),
                                     squeeze=False, sharey=True)
            for ci, causal in enumerate((False, True)):
                for hi, d in enumerate(hdims):
                    ax = axes[ci][hi]
                    for impl in impls_in(rows, "standard"):
                        pts = sorted((r["seqlen"], r["tflops"] * scale) for r in rs
                                     if r["impl"] == impl and r["hdim"] == d
                                     and bool(r["causal"]) == causal and _ok(r))
                        if pts:
                            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                    ms=3, lw=2.2 if impl == OURS else 1.3,
                                    color=_COLORS.get(impl), label=LABELS.get(impl, impl))
                    ax.set_xscale("log", base=2)
                    seqs = sorted({r["seqlen"] for r in rs})
                    ax.set_xticks(seqs)
                    ax.set_xticklabels([_seq(s) for s in seqs], fontsize=8)
                    ax.set_title(f"hdim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
                    ax.grid(alpha=0.3)
                    if hi == 0:
                        ax.set_ylabel(unit)
                    if ci == 1:
                        ax.set_xlabel("sequence length")
            handles, labels = axes[0][0].get_legend_handles_labels()
            fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8,
                       frameon=False)
            fig.suptitle(f"{names[dirn]}, {dt}, {title_dev}", fontsize=11)
            fig.tight_layout(rect=(0, 0.06, 1, 0.96))
            p = os.path.join(out_dir, f"{dirn}_{dt}.png")
            _save(fig, p)
            plt.close(fig)
            written.append(p)

    dec = [r for r in rows if r["grid"] == "decode"]
    if dec:
        batches = sorted({int(r["batch"]) for r in dec})
        fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 3.6), squeeze=False)
        dtypes = list(dict.fromkeys(r["dtype"] for r in dec))
        r0 = dec[0]
        for ax, b in zip(axes[0], batches):
            for dt in dtypes:
                for impl in impls_in(rows, "decode"):
                    pts = sorted((r["seqlen"], r["tbps"] * scale) for r in dec
                                 if r["impl"] == impl and r["dtype"] == dt and
                                 int(r["batch"]) == b and _ok(r, "tbps"))
                    if pts:
                        label = LABELS.get(impl, impl) + (f" {dt}" if len(dtypes) > 1 else "")
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                                lw=2.2 if impl == OURS else 1.3, color=_COLORS.get(impl),
                                ls="-" if dt == dtypes[-1] else "--", label=label)
            ax.set_xscale("log", base=2)
            seqs = sorted({r["seqlen"] for r in dec if int(r["batch"]) == b})
            ax.set_xticks(seqs)
            ax.set_xticklabels([_seq(s) for s in seqs])
            ax.set_title(f"decode: b {b}, {r0['heads']} q / {r0['heads_kv']} kv heads, "
                         f"hdim {r0['hdim']}, {', '.join(dtypes)}", fontsize=9)
            ax.set_xlabel("context length")
            ax.set_ylabel(("GB/s" if scale > 1 else "TB/s") + " of K and V read")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(out_dir, "decode.png")
        _save(fig, p)
        plt.close(fig)
        written.append(p)

    mem = [r for r in rows if r["grid"] == "memory"]
    if mem:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for impl in impls_in(rows, "memory"):
            pts = sorted((r["seqlen"], r["peak_gib"]) for r in mem
                         if r["impl"] == impl and r["status"] == "ok" and r.get("peak_gib"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        lw=2.2 if impl == OURS else 1.3, color=_COLORS.get(impl),
                        label=LABELS.get(impl, impl))
            fails = sorted(r["seqlen"] for r in mem if r["impl"] == impl and r["status"] != "ok")
            if fails and pts:
                ax.annotate(f"{SHORT.get(impl, impl)}: {fails[0] // 1024}k out of memory",
                            xy=(pts[-1][0], pts[-1][1]), xytext=(6, -12),
                            textcoords="offset points", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        seqs = sorted({r["seqlen"] for r in mem})
        ax.set_xticks(seqs)
        ax.set_xticklabels([_seq(s) for s in seqs], fontsize=8)
        r0 = mem[0]
        ax.set_title(f"peak memory, forward + backward: b {r0['batch']}, {r0['heads']} heads, "
                     f"hdim {r0['hdim']}, {r0['dtype']}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("peak allocated GiB")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(out_dir, "memory.png")
        _save(fig, p)
        plt.close(fig)
        written.append(p)
    return written
