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
DECODE = dict(batch=8, heads=32, heads_kv=8, hdim=128, contexts=(4096, 32768, 131072),
              dtype="bf16")
DECODE_CPU = dict(batch=2, heads=8, heads_kv=2, hdim=64, contexts=(1024, 4096), dtype="fp32")
# Memory sweep: forward + backward, batch 1, 16 heads, hdim 128, bf16, non-causal.
MEMORY = dict(batch=1, heads=16, hdim=128, dtype="bf16",
              seqlens=(1024, 2048, 4096, 8192, 16384, 32768, 65536))
MEMORY_CPU = dict(batch=1, heads=4, hdim=64, dtype="fp32", seqlens=(512, 1024, 2048, 4096))

GPU_IMPLS = ("flashattn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "naive")
CPU_IMPLS = ("flashattn", "sdpa_cpu", "naive")
OURS = "flashattn"

LABELS = {
    "flashattn": "flashattn",
    "sdpa_flash": "SDPA FLASH_ATTENTION",
    "sdpa_cudnn": "SDPA CUDNN_ATTENTION",
    "sdpa_efficient": "SDPA EFFICIENT_ATTENTION",
    "sdpa_math": "SDPA MATH",
    "sdpa_cpu": "SDPA (CPU)",
    "naive": "naive (matmul, softmax, matmul)",
}
SHORT = {"flashattn": "ours", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn",
         "sdpa_efficient": "efficient", "sdpa_math": "math", "sdpa_cpu": "sdpa", "naive": "naive"}


def shape_for(grid, hdim, seqlen):
    """(batch, heads) of a standard-grid cell: batch * seqlen = tokens, heads * hdim = model dim."""
    return max(1, grid["tokens"] // seqlen), grid["model_dim"] // hdim


def standard_cells(grid, directions=DIRECTIONS):
    """Every (dtype, hdim, causal, seqlen, direction) of a grid, in measuring order."""
    return [(dt, d, c, s, dirn) for dt in grid["dtypes"] for d in grid["hdims"]
            for c in (False, True) for s in grid["seqlens"] for dirn in directions]


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
          "direction", "ms", "tflops", "tbps", "peak_gib", "reps", "status", "note")


def row(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction, heads_kv=None,
        ms=None, tflops=None, tbps=None, peak_gib=None, reps=0, status="ok", note=""):
    return dict(grid=grid, impl=impl, dtype=dtype, hdim=int(hdim), causal=bool(causal),
                seqlen=int(seqlen), batch=int(batch), heads=int(heads),
                heads_kv=int(heads if heads_kv is None else heads_kv), direction=direction,
                ms=ms, tflops=tflops, tbps=tbps, peak_gib=peak_gib, reps=int(reps),
                status=status, note=note)


def na(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction, reason, heads_kv=None):
    """A cell a peer does not run: status 'n/a' and the reason."""
    return row(grid, impl, dtype, hdim, causal, seqlen, batch, heads, direction,
               heads_kv=heads_kv, status="n/a", note=short_reason(reason))


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


ORDER = ("flashattn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "sdpa_cpu",
         "naive")


def impls_in(rows, grid):
    order = list(ORDER)
    seen = {r["impl"] for r in rows if r["grid"] == grid}
    return [i for i in order if i in seen] + sorted(seen - set(order))


def ratio_table(rows, grid="standard", unit="TFLOP/s"):
    """Markdown: one line per cell; our TFLOP/s, then per peer 'ours/peer (peer TFLOP/s)'
    or 'n/a' with the status. unit 'GFLOP/s' prints GFLOP/s (the CPU mode)."""
    k = 1e3 if unit == "GFLOP/s" else 1.0
    idx = _index(rows, grid)
    peers = [i for i in impls_in(rows, grid) if i != OURS]
    cells = sorted({k[:5] for k in idx},
                   key=lambda k: (k[0], DIRECTIONS.index(k[1]) if k[1] in DIRECTIONS else 9,
                                  k[2], k[3], k[4]))
    head = ["dtype", "dir", "hdim", "causal", "seqlen", f"ours {unit}"] + \
        [f"vs {SHORT.get(p, p)}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        o = idx.get(c + (OURS,))
        cols = [c[0], c[1], str(c[2]), "yes" if c[3] else "no", _seq(c[4]),
                f"{o['tflops'] * k:.1f}" if _ok(o) else "n/a"]
        for p in peers:
            pr = idx.get(c + (p,))
            q = ratio(o, pr)
            if q is not None:
                cols.append(f"{q:.2f} ({pr['tflops'] * k:.0f})")
            elif pr is not None and pr.get("status") != "ok":
                cols.append("n/a")
            else:
                cols.append("-")
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary_table(rows, grid="standard", min_seqlen=0):
    """Markdown: per dtype x direction, the geometric mean (and min..max) of ours/peer over
    the cells both ran, and how many cells the peer could not run."""
    idx = _index(rows, grid)
    peers = [i for i in impls_in(rows, grid) if i != OURS]
    keys = sorted({(k[0], k[1]) for k in idx},
                  key=lambda k: (k[0], DIRECTIONS.index(k[1]) if k[1] in DIRECTIONS else 9))
    head = ["dtype", "dir"] + [f"vs {SHORT.get(p, p)}" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dt, dirn in keys:
        cols = [dt, dirn]
        for p in peers:
            rs, missing = [], 0
            for k, r in idx.items():
                if k[0] == dt and k[1] == dirn and k[5] == p and k[4] >= min_seqlen:
                    q = ratio(idx.get(k[:5] + (OURS,)), r)
                    if q is None:
                        missing += 1
                    else:
                        rs.append(q)
            g = geomean(rs)
            txt = f"{g:.2f} ({min(rs):.2f}..{max(rs):.2f})" if g else "n/a"
            if missing:
                txt += f", {missing} n/a"
            cols.append(txt)
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def decode_table(rows, unit="TB/s"):
    rs = [r for r in rows if r["grid"] == "decode"]
    if not rs:
        return ""
    k = 1e3 if unit == "GB/s" else 1.0
    peers = [i for i in impls_in(rows, "decode") if i != OURS]
    head = ["context", f"ours {unit} (us)"] + [f"{SHORT.get(p, p)} {unit} (ours/peer)"
                                               for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {(r["seqlen"], r["impl"]): r for r in rs}
    for s in sorted({r["seqlen"] for r in rs}):
        o = by.get((s, OURS))
        cols = [_seq(s), f"{o['tbps'] * k:.2f} ({o['ms'] * 1e3:.0f})" if _ok(o, "tbps") else "n/a"]
        for p in peers:
            pr = by.get((s, p))
            q = ratio(o, pr, "tbps")
            if q is not None:
                cols.append(f"{pr['tbps'] * k:.2f} ({q:.2f})")
            elif _ok(pr, "tbps"):
                cols.append(f"{pr['tbps'] * k:.2f} (-)")
            else:
                cols.append("n/a")
        lines.append("| " + " | ".join(cols) + " |")
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
    keys = ("commit", "date", "device", "driver", "torch", "cuda", "cudnn", "flashattn")
    return ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k))


def report(meta, rows):
    """Everything printed last: metadata, decode and memory tables, the per-cell ratio
    table and the summary (geometric means)."""
    cpu = meta.get("mode") == "cpu"
    unit, bw = ("GFLOP/s", "GB/s") if cpu else ("TFLOP/s", "TB/s")
    parts = [f"# flashattn benchmark: {meta_line(meta)}"]
    if meta.get("wall_s"):
        parts.append("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in meta["wall_s"].items()))
    if any(r["grid"] == "standard" for r in rows):
        parts += ["", f"## Standard grid: ours {unit} and ours/peer (peer {unit}) per cell", "",
                  ratio_table(rows, unit=unit), "",
                  "## Summary: geometric mean of ours/peer (min..max) over the cells both ran", "",
                  summary_table(rows)]
    if any(r["grid"] == "decode" for r in rows):
        parts += ["", "## Decode: KV bytes read per second", "", decode_table(rows, bw)]
    if any(r["grid"] == "memory" for r in rows):
        parts += ["", "## Peak memory, forward + backward", "", memory_table(rows)]
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

_COLORS = {"flashattn": "#d62728", "sdpa_flash": "#1f77b4", "sdpa_cudnn": "#2ca02c",
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
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for impl in impls_in(rows, "decode"):
            pts = sorted((r["seqlen"], r["tbps"] * scale) for r in dec
                         if r["impl"] == impl and _ok(r, "tbps"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        lw=2.2 if impl == OURS else 1.3, color=_COLORS.get(impl),
                        label=LABELS.get(impl, impl))
        ax.set_xscale("log", base=2)
        seqs = sorted({r["seqlen"] for r in dec})
        ax.set_xticks(seqs)
        ax.set_xticklabels([_seq(s) for s in seqs])
        r0 = dec[0]
        ax.set_title(f"decode: b {r0['batch']}, {r0['heads']} q / {r0['heads_kv']} kv heads, "
                     f"hdim {r0['hdim']}, {r0['dtype']}", fontsize=9)
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
