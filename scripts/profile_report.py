"""Summary of scripts/profile.sh's Nsight Compute exports.
fwd / bwd: chosen raw metrics of our kernel and the peer's per head dim side by side, then the
SASS instructions of ours (and the peer's) that hold the most warp-stall samples, grouped by
opcode.  decode: the metrics of every profiled kernel (ours, then the SDPA peers'), one block
per kernel.
    python3 scripts/profile_report.py DIR HDIM...
    python3 scripts/profile_report.py --metrics OURS.csv PEERS.csv
"""
import collections
import csv
import re
import sys

KEEP = [
    r"^gpu__time_duration\.sum$", r"^launch__registers_per_thread$", r"^launch__grid_size$",
    r"^launch__shared_mem_per_block_dynamic$", r"^smsp__inst_executed\.sum$",
    r"^smsp__issue_active\.avg\.pct_of_peak_sustained_active$",
    r"^sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__inst_executed_op_ldsm\.sum$", r"^smsp__inst_executed_op_shared_(ld|st)\.sum$",
    r"^smsp__inst_executed_op_global_red\.sum$", r"^smsp__inst_executed_op_global_ld\.sum$",
    r"^l1tex__data_pipe_lsu_wavefronts_mem_shared(_op_ld|_op_st)?\.sum$",
    r"^l1tex__data_bank_conflicts_pipe_lsu_mem_shared(_op_ld|_op_st)?\.sum$",
    r"^lts__t_sectors_op_(red|atom|read|write)\.sum$", r"^lts__t_sector_hit_rate\.pct$",
    r"^dram__bytes_(read|write)\.sum$", r"^sm__warps_active\.avg\.pct_of_peak_sustained_active$",
    r"^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$",
    r"^smsp__inst_executed_pipe_.*\.sum$",
]


def read_raw(path):
    try:
        rows = [r for r in csv.reader(open(path)) if r]
    except OSError:
        return {}
    if len(rows) < 3:
        return {}
    hdr, vals = rows[0], rows[2]
    return dict(zip(hdr, vals))


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return None


def raw_table(d, dirn):
    ours, peer = read_raw(f"{dirn}/ours_d{d}_raw.csv"), read_raw(f"{dirn}/peer_d{d}_raw.csv")
    print(f"\n## hdim {d}: ours vs peer (one 16k non-causal launch)")
    names = sorted(set(ours) | set(peer))
    for n in names:
        if not any(re.search(k, n) for k in KEEP):
            continue
        a, b = num(ours.get(n)), num(peer.get(n))
        if (a or 0) == 0 and (b or 0) == 0:
            continue
        r = f"{a / b:.3f}" if a is not None and b else "-"
        short = n.replace("smsp__average_warps_issue_stalled_", "stall_").replace(
            "_per_issue_active.ratio", "")
        print(f"  {short:70s} {ours.get(n, '-'):>16s} {peer.get(n, '-'):>16s}  {r}")


def sass_table(path, label, top=22):
    try:
        rows = [r for r in csv.reader(open(path)) if r]
    except OSError:
        print(f"{label}: no sass export")
        return
    if not rows:
        print(f"{label}: empty sass export")
        return
    # The export may start with a kernel-name line; the header is the row naming "Source".
    hi = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if hi is None:
        print(f"{label}: no Source column; first row: {rows[0][:12]}")
        return
    hdr = rows[hi]
    ix = {h: i for i, h in enumerate(hdr)}
    samp = next((h for h in hdr if h.startswith("Warp Stall Sampling (All")), None)
    if samp is None:
        print(f"{label}: columns {hdr[:40]}")
        return
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    body = [r for r in rows[hi + 1:] if len(r) == len(hdr)]
    tot = sum(num(r[ix[samp]]) or 0 for r in body)
    by_op = collections.Counter()
    count_op = collections.Counter()
    for r in body:
        op = r[ix["Source"]].split()[0] if r[ix["Source"]].split() else "?"
        if op.startswith("@"):
            op = r[ix["Source"]].split()[1] if len(r[ix["Source"]].split()) > 1 else op
        op = op.split(".")[0]
        by_op[op] += num(r[ix[samp]]) or 0
        count_op[op] += 1
    print(f"\n## {label}: {len(body)} SASS instructions, {tot:.0f} stall samples; by opcode (share, static count)")
    print("  " + ", ".join(f"{o} {100 * s / tot:.1f}% ({count_op[o]})" for o, s in by_op.most_common(14)))
    print(f"  top instructions (samples, share, then nonzero stall columns):")
    for r in sorted(body, key=lambda r: -(num(r[ix[samp]]) or 0))[:top]:
        s = num(r[ix[samp]]) or 0
        extra = []
        for c in stall_cols:
            v = num(r[ix[c]])
            if v:
                extra.append(f"{c.replace('stall_', '')}={v:.0f}")
        addr = r[ix["Address"]] if "Address" in ix else ""
        print(f"  {addr:>6s} {s:7.0f} {100 * s / tot:5.1f}%  {r[ix['Source']][:60]:60s} {' '.join(extra[:6])}")
    if stall_cols:
        print("  stall columns: " + ", ".join(stall_cols[:30]))


def metrics_table(path):
    """ncu --metrics ... --csv output: per kernel launch, its metrics on one line."""
    try:
        rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
    except OSError:
        rows = []
    if not rows:
        print(path, "no rows")
        return
    ix = {h: i for i, h in enumerate(rows[0])}
    kernels = collections.OrderedDict()
    for r in rows[1:]:
        key = (r[ix["ID"]], r[ix["Kernel Name"]][:60])
        kernels.setdefault(key, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]]
    for (i, name), m in kernels.items():
        print(f"{path.split('/')[-1]} #{i} {name}")
        print("   " + "  ".join(f"{n}={m[n]}" for n in sorted(m)))


def main():
    if sys.argv[1:2] == ["--metrics"]:
        for path in sys.argv[2:]:
            metrics_table(path)
        return
    dirn, dims = sys.argv[1], sys.argv[2:]
    for d in dims:
        raw_table(d, dirn)
    for d in dims:
        sass_table(f"{dirn}/ours_d{d}_sass.csv", f"ours hdim {d}")
        sass_table(f"{dirn}/peer_d{d}_sass.csv", f"peer hdim {d}", top=10)


if __name__ == "__main__":
    main()
