"""Joins two benchmark CSVs (ours, peer) on (hdim, causal, seqlen) and prints the table
of TFLOP/s and the ratio ours / peer.

    python3 bench/peers/compare.py ours.csv peer.csv [title]
"""
import csv
import sys


def load(path):
    with open(path) as f:
        return {(r["hdim"], r["causal"], r["seqlen"]): float(r["tflops"]) for r in csv.DictReader(f)}


def main(ours_path, peer_path, title="ours vs peer"):
    ours, peer = load(ours_path), load(peer_path)
    print(f"| hdim | causal | seqlen | ours TFLOP/s | peer TFLOP/s | ratio |   ({title})")
    print("|---|---|---|---|---|---|")
    for key in ours:
        if key in peer:
            o, p = ours[key], peer[key]
            print(f"| {key[0]} | {'yes' if key[1] == '1' else 'no'} | {key[2]} | {o:.1f} | {p:.1f} | {o / p:.2f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
