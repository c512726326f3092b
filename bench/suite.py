"""The benchmark of flashattn (issues 6 and 18): flashattn against FlashAttention-4 (when
importable), PyTorch SDPA's CUDNN_ATTENTION, FLASH_ATTENTION (FlashAttention-2),
EFFICIENT_ATTENTION and MATH backends and a naive unfused computation (matmul, softmax,
matmul), all in this one process, on

- the standard grid of the FlashAttention papers: bf16 and fp16, 16k tokens, model dim
  2048 (heads = 2048 / hdim), hdim 64 / 128 / 256, causal and not, seqlen 512 .. 16k;
  forward, backward and forward + backward, in TFLOP/s (4 b h s^2 d, halved when causal;
  backward 2.5x, forward + backward 3.5x);
- the decode grid: bf16, batch 8, 32 query heads over 8 KV heads, hdim 128, one query
  token, contexts 4k / 32k / 128k, in TB/s of K and V read (flashattn through
  flash_attn_with_kvcache; SDPA CUDNN and FLASH on the same dense cache); --decode-batches
  and --decode-contexts make it a sweep (issue 23: 1,8,64 x 1k..128k), each cell rotating
  over enough input sets that L2 holds none of them;
- a memory sweep: peak memory of forward + backward, batch 1, 16 heads, hdim 128, naive
  against flashattn, seqlen 1k .. 64k (naive stops at its first out-of-memory);
- with --grids ...,spec: speculative decoding, 1 / 4 / 8 draft tokens verified in one call
  (causal, and as a draft tree), batch 8, 32 / 8 heads, hdim 128, contexts 4k and 32k, us
  per token against one-token decode (flashattn alone);
- with --prefill-chunk: a 2k-token causal chunk against 32k keys of KV cache, dense and
  paged (block 16 and 256), flashattn through flash_attn_with_kvcache against FA4;
- the ceilings of the run: a bf16 8192^3 torch.matmul in TFLOP/s, and (with the decode
  grid) torch.sum over 4 GiB in TB/s read (--no-gemm skips both).

Every table gives flashattn / best peer per cell (the best of FA4, cuDNN and FA2 that ran)
next to the per-peer ratios; the short table of flashattn / best peer is printed last.
--families auto,sm80 measures flashattn under more than one kernel family in one run
(columns flashattn, flashattn-sm80): each family after the first runs the standard grid in
a subprocess with FLASHATTN_KERNEL_FAMILY set before flashattn loads (the library reads it
once per process).

With --cpu: the CPU backend against the naive computation and torch's CPU SDPA on a small
grid. Results (CSV, JSON with metadata, report.md, PNG plots when matplotlib is present) go
to --out (default build/bench-results/<date>-<device>/). `--plot DIR` redraws the plots
from DIR/results.json (for a machine with matplotlib).

    python3 bench/suite.py [--cpu] [--quick] [--out DIR] [--grids standard,decode,memory,prefill,spec]
                           [--only fwd,bwd,fwd_bwd] [--hdims 64,128] [--seqlens 4k,16k]
                           [--dtypes bf16] [--causal both|yes|no] [--impls ...]
                           [--families auto,sm80] [--prefill-chunk] [--no-gemm]
                           [--decode-batches 1,8,64] [--decode-contexts 1k,4k,128k]
                           [--timing graph|eager]
    python3 bench/suite.py --plot DIR

Method: one warm-up call (FA4 compiles a configuration on its first call there), one call
to estimate the time, then as many timed calls as fit a budget per measurement (default
25 ms, at least 3 and at most 30), median; inputs rotate among 3 sets (1 set where one
call's s x s intermediate alone is larger than the L2). On the GPU the standard grid
(--timing graph, the default) captures rounds x sets calls, rotating over the sets, into a
CUDA graph (about 2 ms of work, at most 16 rounds) and times its replays with CUDA events,
so that the host's time per call (0.1-0.2 ms through Python) does not count where the
kernels are shorter; eager timing where an implementation cannot be captured (the note
says why). --timing eager, the prefill chunk and the ceilings: CUDA events around every
call (host clock on the CPU). Forward is timed without autograd; backward is
torch.autograd.grad over a retained forward graph; forward + backward is both.
"""

import argparse
import contextlib
import datetime
import gc
import math
import os
import platform
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite_report as R  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------- metadata


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                              cwd=REPO).stdout.strip()
    except Exception:
        return ""


def metadata(torch, cpu, args):
    import flashattn

    commit = os.environ.get("FLASHATTN_COMMIT") or _run(["git", "rev-parse", "--short", "HEAD"])
    meta = dict(
        commit=commit or "unknown",
        kernel_family=os.environ.get("FLASHATTN_KERNEL_FAMILY", "auto"),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        mode="cpu" if cpu else "cuda",
        quick=bool(args.quick),
        torch=torch.__version__,
        flashattn=flashattn.__version__,
        python=platform.python_version(),
        budget_ms=args.budget_ms,
        min_reps=args.min_reps,
        max_reps=args.max_reps,
        input_sets=args.sets,
    )
    if cpu:
        model = ""
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        model = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        meta.update(device=model or platform.processor() or "CPU",
                    threads=torch.get_num_threads(), cores=os.cpu_count())
    else:
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm",
                    "--format=csv,noheader"]).splitlines()
        fields = [x.strip() for x in smi[0].split(",")] if smi else []
        meta.update(
            device=torch.cuda.get_device_name(),
            driver=fields[0] if fields else "",
            sm_clock=fields[1] if len(fields) > 1 else "",
            sm_clock_max=fields[2] if len(fields) > 2 else "",
            cuda=torch.version.cuda,
            cudnn=str(torch.backends.cudnn.version()),
            memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            l2_mib=round(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) / 2**20, 1),
        )
    return meta


# ----------------------------------------------------------------- timing


class Timer:
    """Times a list of calls, rotating among them: CUDA events around every call (host
    clock on the CPU), a warm-up call, a call to estimate, then repeats within a budget.

    time_cell (the standard grid) does that in eager mode; in graph mode it captures the
    calls, rotating over the input sets, into a CUDA graph (rounds x sets calls, enough
    for about graph_ms of work) and times its replays, so that the host's time per call
    (argument checks, dispatch, launches: 0.1-0.2 ms) does not count where a call's
    kernels are shorter than it. Where capture fails for an implementation it falls back to
    eager timing and says so."""

    GRAPH_MS = 2.0        # work per replay that rounds aim at
    GRAPH_MAX_ROUNDS = 16

    def __init__(self, torch, cpu, budget_ms, min_reps, max_reps, timing="eager"):
        self.torch, self.cpu = torch, cpu
        self.budget_ms, self.min_reps, self.max_reps = budget_ms, min_reps, max_reps
        self.timing = "eager" if cpu else timing
        self._stream = None

    def sync(self):
        if not self.cpu:
            self.torch.cuda.synchronize()

    def _times(self, calls, n):
        if self.cpu:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                calls[i % len(calls)]()
                out.append((time.perf_counter() - t0) * 1e3)
            return out
        ev = [(self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
        for i in range(n):
            ev[i][0].record()
            calls[i % len(calls)]()
            ev[i][1].record()
        self.torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in ev]

    def time(self, calls):
        calls[0]()                                   # warm-up (plans, handles, first touch)
        self.sync()
        est = self._times(calls[1 % len(calls):] + calls[: 1 % len(calls)], 1)[0]
        reps = R.repeats_for(est, self.budget_ms, self.min_reps, self.max_reps)
        return R.median(self._times(calls, reps)), reps

    @contextlib.contextmanager
    def cell_stream(self):
        """The context a standard-grid cell builds and times its calls in: in graph mode
        the capture stream (so that a backward cell's retained forward, and so its
        autograd backward, run on the stream the graph captures), ordered after the
        current stream's work and before its later work; else nothing."""
        if self.timing != "graph":
            yield
            return
        cuda = self.torch.cuda
        if self._stream is None:
            self._stream = cuda.Stream()
        current = cuda.current_stream()
        self._stream.wait_stream(current)
        try:
            with cuda.stream(self._stream):
                yield
        finally:
            current.wait_stream(self._stream)

    def time_cell(self, calls):
        """(ms per call, repeats, how): how is "CUDA graph, N calls per replay" or "eager"
        (with the reason where capture failed); "" on the CPU (host clock)."""
        if self.cpu:
            return (*self.time(calls), "")
        if self.timing != "graph":
            return (*self.time(calls), "eager")
        cuda = self.torch.cuda
        calls[0]()                                   # warm-up on the capture stream
        self.sync()
        est = self._times(calls[1 % len(calls):] + calls[: 1 % len(calls)], 1)[0]
        rounds = graph_rounds(est, len(calls), self.GRAPH_MS, self.GRAPH_MAX_ROUNDS)
        try:
            graph = cuda.CUDAGraph()
            with cuda.graph(graph, stream=self._stream):
                for _ in range(rounds):
                    for c in calls:
                        c()
        except Exception as exc:  # an implementation that cannot be captured
            graph = None          # (its memory pool goes with it)
            self.sync()
            cuda.empty_cache()
            ms, reps = self.time(calls)
            return ms, reps, "eager: CUDA graph capture failed (" + R.short_reason(
                f"{type(exc).__name__}: {exc}", 100) + ")"
        n = rounds * len(calls)
        graph.replay()                               # warm-up (upload)
        self.sync()
        reps = R.repeats_for(est * n, self.budget_ms, max(1, -(-self.min_reps // n)),
                             self.max_reps)
        ms = R.median(self._times([graph.replay], reps)) / n
        del graph
        return ms, reps, f"CUDA graph, {n} calls per replay"


def graph_rounds(est_ms, nsets, target_ms, max_rounds):
    """Rounds over the input sets one CUDA graph holds: enough for about target_ms of work
    (one eager call estimated at est_ms), at least 1, at most max_rounds."""
    if not est_ms or est_ms <= 0 or math.isnan(est_ms):
        return max_rounds
    return int(max(1, min(max_rounds, math.ceil(target_ms / (est_ms * nsets)))))


def is_oom(exc):
    text = str(exc)
    return (type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower()
            or "ALLOC_FAILED" in text or "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE" in text)


def reason_of(exc, caught):
    msgs = [str(w.message).strip() for w in caught]
    msgs = [m for m in msgs if m and "not used because" not in m]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if is_oom(exc):
        return "out of memory"
    return R.short_reason(("; ".join(msgs[:2]) + " | " if msgs else "") + first, 200)


# ----------------------------------------------------------------- implementations


def load_fa4():
    """(module, version, None) when FlashAttention-4 imports, else (None, None, reason)."""
    try:
        from flash_attn.cute import interface as fa4
    except Exception as exc:  # not installed (the usual case), or a broken install
        return None, None, R.short_reason(f"{type(exc).__name__}: {exc}", 120)
    version = ""
    try:
        from importlib import metadata as md
        for name in ("flash-attn-4", "flash_attn_4", "flash-attn"):
            try:
                version = md.version(name)
                break
            except md.PackageNotFoundError:
                pass
    except Exception:
        pass
    return fa4, version or "unknown version", None


class Impls:
    """Forward functions over [b, s, h, d] inputs; each returns the output ([b, s, h, d]
    for flashattn and FA4, [b, h, s, d] for SDPA and naive; see bhsd)."""

    def __init__(self, torch, cpu, fa4=None):
        self.torch, self.cpu, self.fa4 = torch, cpu, fa4
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from flashattn import flash_attn_func, flash_attn_with_kvcache

        self.F, self.sdpa_kernel = F, sdpa_kernel
        self.fa, self.fa_kvcache = flash_attn_func, flash_attn_with_kvcache
        self.backends = {
            "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa_math": SDPBackend.MATH,
        }
        self._masks = {}

    def context(self, impl):
        """The SDPA backend context for an implementation (a null context otherwise)."""
        import contextlib

        if impl in self.backends:
            return self.sdpa_kernel([self.backends[impl]])
        return contextlib.nullcontext()

    def bhsd(self, impl):
        """Whether the implementation's output (and so dout) is [b, h, s, d]."""
        return not (R.is_ours(impl) or impl == "fa4")

    def _mask(self, s, device):
        key = (s, str(device))
        if key not in self._masks:
            self._masks.clear()
            self._masks[key] = self.torch.ones(s, s, dtype=self.torch.bool,
                                               device=device).triu_(1)
        return self._masks[key]

    def forward(self, impl, q, k, v, causal):
        if R.is_ours(impl):  # flashattn-<family>: this process's family (set at its start)
            return self.fa(q, k, v, causal=causal)
        if impl == "fa4":
            if self.fa4 is None:
                raise RuntimeError("FlashAttention-4 is not importable here")
            out = self.fa4.flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if impl == "naive":
            s = self.torch.matmul(qt, kt.transpose(-2, -1))
            s.mul_(q.shape[-1] ** -0.5)
            if causal:
                s.masked_fill_(self._mask(q.shape[1], q.device), float("-inf"))
            return self.torch.matmul(self.torch.softmax(s, dim=-1), vt)
        return self.F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


# ----------------------------------------------------------------- standard grid


def run_standard(torch, impls, timer, grid, impl_names, cpu, args, rows, progress):
    device = "cpu" if cpu else "cuda"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    l2 = 0 if cpu else getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    n = grid["tokens"] * grid["model_dim"]
    oom_at = {}
    for dt_name in grid["dtypes"]:
        dt = dtypes[dt_name]
        gen = torch.Generator(device=device).manual_seed(1234)
        pool = torch.randn(args.sets, 4, n, dtype=dt, device=device, generator=gen)
        for d in grid["hdims"]:
            for causal in grid.get("causals", R.CAUSALS):
                for s in grid["seqlens"]:
                    b, h = R.shape_for(grid, d, s)
                    for dirn in grid.get("directions", R.DIRECTIONS):
                        flops = R.attention_flops(b, h, s, s, d, causal, dirn)
                        for impl in impl_names:
                            label = f"{dt_name} d{d} {'c' if causal else 'n'} {s} {dirn} {impl}"
                            key = (impl, dt_name, d, causal, dirn)
                            if args.deadline and time.time() > args.deadline:
                                rows.append(R.na("standard", impl, dt_name, d, causal, s, b, h,
                                                 dirn, f"not run: --time-limit {args.time_limit} s"))
                                progress.update(label)
                                continue
                            if key in oom_at:
                                rows.append(R.na("standard", impl, dt_name, d, causal, s, b, h,
                                                 dirn, f"out of memory (at seqlen {oom_at[key]})"))
                                progress.update(label)
                                continue
                            big = impl in ("naive", "sdpa_math") and b * h * s * s * 2 > l2
                            nsets = 1 if big else args.sets
                            r = measure_cell(torch, impls, timer, pool, impl, dirn, b, s, h, d,
                                             causal, nsets)
                            if r[0] == "ok":
                                ms, reps = r[1], r[2]
                                note = "; ".join(x for x in (
                                    r[3], "" if nsets > 1 else "1 input set") if x)
                                rows.append(R.row("standard", impl, dt_name, d, causal, s, b, h,
                                                  dirn, ms=ms, tflops=R.tflops(flops, ms),
                                                  reps=reps, note=note))
                            else:
                                if r[1] == "out of memory":
                                    oom_at[key] = s
                                rows.append(R.na("standard", impl, dt_name, d, causal, s, b, h,
                                                 dirn, r[1]))
                            if not cpu and (big or r[0] != "ok"):
                                gc.collect()
                                torch.cuda.empty_cache()
                            progress.update(label)
        del pool
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def measure_cell(torch, impls, timer, pool, impl, dirn, b, s, h, d, causal, nsets):
    """('ok', ms, reps, how) or ('n/a', reason); how is Timer.time_cell's."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with impls.context(impl), timer.cell_stream():
                calls = []
                for i in range(nsets):
                    q, k, v, do = (pool[i, j].view(b, s, h, d) for j in range(4))
                    if impls.bhsd(impl):
                        do = do.transpose(1, 2)
                    if dirn == "fwd":
                        calls.append(_fwd_call(torch, impls, impl, q, k, v, causal))
                    else:
                        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                        if dirn == "bwd":
                            out = impls.forward(impl, q, k, v, causal)
                            calls.append(_bwd_call(torch, out, (q, k, v), do))
                        else:
                            calls.append(_fb_call(torch, impls, impl, q, k, v, do, causal))
                ms, reps, how = timer.time_cell(calls)
                del calls
                return ("ok", ms, reps, how)
        except Exception as exc:  # unsupported cell, out of memory
            return ("n/a", reason_of(exc, caught))


def _fwd_call(torch, impls, impl, q, k, v, causal):
    def call():
        with torch.no_grad():
            impls.forward(impl, q, k, v, causal)
    return call


def _bwd_call(torch, out, inputs, do):
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


def _fb_call(torch, impls, impl, q, k, v, do, causal):
    return lambda: torch.autograd.grad(impls.forward(impl, q, k, v, causal), (q, k, v), do)


# ----------------------------------------------------------------- kernel families


def family_command(args, grid, family, out):
    """The command line that measures flashattn alone under one kernel family on the same
    standard grid, in a process of its own (FLASHATTN_KERNEL_FAMILY is read once, when the
    library loads)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--families", family,
           "--impls", R.family_impl(family), "--grids", "standard", "--no-gemm", "--no-plot",
           "--worker", "--out", out,
           "--dtypes", ",".join(grid["dtypes"]), "--hdims", ",".join(map(str, grid["hdims"])),
           "--seqlens", ",".join(map(str, grid["seqlens"])),
           "--only", ",".join(grid.get("directions", R.DIRECTIONS)),
           "--causal", {(False, True): "both", (True,): "yes", (False,): "no"}[
               tuple(grid.get("causals", R.CAUSALS))],
           "--budget-ms", str(args.budget_ms), "--min-reps", str(args.min_reps),
           "--max-reps", str(args.max_reps), "--sets", str(args.sets)]
    if args.cpu:
        cmd.append("--cpu")
    else:
        cmd += ["--timing", timing_mode(args, False)]
    if args.time_limit:
        cmd += ["--time-limit", str(args.time_limit)]
    return cmd


def run_family(args, grid, family, out, rows):
    """Runs family_command and appends its rows (impl flashattn-<family>); when the
    subprocess leaves no results, one n/a row per cell with the reason."""
    env = dict(os.environ, FLASHATTN_KERNEL_FAMILY=family)
    impl = R.family_impl(family)
    print(f"== flashattn under kernel family {family} (column {impl}): a subprocess with "
          f"FLASHATTN_KERNEL_FAMILY={family}", flush=True)
    res = subprocess.run(family_command(args, grid, family, out), env=env, cwd=REPO)
    path = os.path.join(out, "results.json")
    if os.path.exists(path):
        _, got = R.read_json(path)
        rows += [r for r in got if r["grid"] == "standard"]
        return res.returncode
    for dt, d, causal, s, dirn in R.standard_cells(grid):
        b, h = R.shape_for(grid, d, s)
        rows.append(R.na("standard", impl, dt, d, causal, s, b, h, dirn,
                         f"family subprocess exited {res.returncode} without results"))
    return res.returncode


# ----------------------------------------------------------------- GEMM ceiling


def run_gemm(torch, timer, cfg, cpu, rows):
    """The run's compute ceiling: an n^3 matmul in TFLOP/s (GFLOP/s-scale on the CPU)."""
    device = "cpu" if cpu else "cuda"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    n = cfg["n"]
    try:
        a, b = (torch.randn(n, n, dtype=dt, device=device) for _ in range(2))
        out = torch.empty(n, n, dtype=dt, device=device)
        ms, reps = timer.time([lambda: torch.matmul(a, b, out=out)])
        r = R.row("gemm", "torch.matmul", cfg["dtype"], 0, False, n, 1, 1, "gemm", ms=ms,
                  tflops=R.tflops(R.gemm_flops(n), ms), reps=reps)
        del a, b, out
    except Exception as exc:
        r = R.na("gemm", "torch.matmul", cfg["dtype"], 0, False, n, 1, 1, "gemm",
                 reason_of(exc, []))
    rows.append(r)
    if not cpu:
        torch.cuda.empty_cache()
    return r


def run_read_bandwidth(torch, timer, cpu, rows):
    """The decode grid's ceiling: torch.sum over a 4 GiB fp32 tensor (64 MiB on the CPU),
    in TB/s of bytes read."""
    device = "cpu" if cpu else "cuda"
    n = (1 << 24) if cpu else (1 << 30)
    try:
        x = torch.rand(n, device=device)
        ms, reps = timer.time([lambda: x.sum()])
        r = R.row("read", "torch.sum", "fp32", 0, False, n, 1, 1, "read", ms=ms,
                  tbps=R.tbps(4 * n, ms), reps=reps)
        del x
    except Exception as exc:
        r = R.na("read", "torch.sum", "fp32", 0, False, n, 1, 1, "read", reason_of(exc, []))
    rows.append(r)
    if not cpu:
        torch.cuda.empty_cache()
    return r


# ----------------------------------------------------------------- prefill chunk


def run_prefill(torch, impls, timer, cfg, cpu, args, rows, progress):
    """A chunk of s_q new tokens (causal, bottom-right aligned) against s_k keys of cache:
    dense [b, s_k, h_k, d] and paged [blocks, block, h_k, d] with a shuffled block table.
    flashattn through flash_attn_with_kvcache; FA4 through flash_attn_func (dense) and
    flash_attn_varlen_func with page_table (paged), n/a with the reason where it refuses."""
    device = "cpu" if cpu else "cuda"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    b, hq, hk, d, sq, sk = (cfg[x] for x in ("batch", "heads", "heads_kv", "hdim", "seqlen_q",
                                             "seqlen_k"))
    flops = R.prefill_flops(b, hq, sq, sk, d)
    names = [args.ours] + (["fa4"] if impls.fa4 is not None and not cpu else [])
    gen = torch.Generator(device="cpu").manual_seed(5)
    q = torch.randn(b, sq, hq, d, dtype=dt, device=device)
    seqlens = torch.full((b,), sk, dtype=torch.int32, device=device)
    layouts = [("dense", None)] + [(f"paged {bs}", bs) for bs in cfg["blocks"]]
    for lay, bs in layouts:
        try:
            if bs is None:
                kc, vc = (torch.randn(b, sk, hk, d, dtype=dt, device=device) for _ in range(2))
                table = None
            else:
                nb = b * sk // bs
                kc, vc = (torch.randn(nb, bs, hk, d, dtype=dt, device=device) for _ in range(2))
                table = torch.randperm(nb, generator=gen).to(torch.int32).view(b, sk // bs)
                table = table.to(device)
        except Exception as exc:
            for impl in names:
                rows.append(R.na("prefill", impl, cfg["dtype"], d, True, sk, b, hq, "fwd",
                                 reason_of(exc, []), heads_kv=hk, layout=lay))
                progress.update(f"prefill {lay} {impl}")
            continue
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
        for impl in names:
            if R.is_ours(impl):
                call = (lambda kc=kc, vc=vc, table=table: impls.fa_kvcache(
                    q, kc, vc, cache_seqlens=seqlens, block_table=table, causal=True))
            elif table is None:
                call = (lambda kc=kc, vc=vc: impls.fa4.flash_attn_func(q, kc, vc, causal=True))
            else:
                call = (lambda kc=kc, vc=vc, table=table: impls.fa4.flash_attn_varlen_func(
                    q.view(b * sq, hq, d), kc, vc, cu_seqlens_q=cu_q, seqused_k=seqlens,
                    max_seqlen_q=sq, max_seqlen_k=sk, page_table=table, causal=True))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with torch.no_grad():
                        ms, reps = timer.time([call])
                    rows.append(R.row("prefill", impl, cfg["dtype"], d, True, sk, b, hq, "fwd",
                                      heads_kv=hk, ms=ms, tflops=R.tflops(flops, ms), reps=reps,
                                      layout=lay, note=f"s_q {sq}"))
                except Exception as exc:
                    rows.append(R.na("prefill", impl, cfg["dtype"], d, True, sk, b, hq, "fwd",
                                     reason_of(exc, caught), heads_kv=hk, layout=lay))
            progress.update(f"prefill {lay} {impl}")
        del kc, vc
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


# ----------------------------------------------------------------- decode


DECODE_ROUNDS_CPU = 3


def decode_dtypes(cfg):
    """The dtypes the decode grid runs: cfg["dtypes"] (the CPU grid, where --dtypes replaces
    them), else its one cfg["dtype"]."""
    return tuple(cfg.get("dtypes") or (cfg["dtype"],))


def decode_batches(cfg):
    """The batches the decode grid runs: cfg["batches"] (--decode-batches), else its one
    cfg["batch"]."""
    return tuple(cfg.get("batches") or (cfg["batch"],))


def run_decode(torch, impls, timer, cfg, cpu, args, rows, progress):
    for dt_name in decode_dtypes(cfg):
        for b in decode_batches(cfg):
            run_decode_dtype(torch, impls, timer, dict(cfg, batch=b), dt_name, cpu, args, rows,
                             progress)


def decode_sets(args, nbytes, cpu):
    """Input sets a decode cell rotates over: --sets, more where one set's K and V are small
    (enough for >= 512 MiB in all on the GPU, so that L2 does not hold one call's keys for the
    next; 64 at most), fewer where they would not fit in half the free device memory."""
    if cpu:
        return args.sets
    import torch
    n = max(args.sets, min(64, (512 << 20) // max(nbytes, 1) + 1))
    free = torch.cuda.mem_get_info()[0]
    return max(1, min(n, int(free * 0.5) // max(nbytes, 1)))


def run_decode_dtype(torch, impls, timer, cfg, dt_name, cpu, args, rows, progress):
    device = "cpu" if cpu else "cuda"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt_name]
    b, hq, hk, d = cfg["batch"], cfg["heads"], cfg["heads_kv"], cfg["hdim"]
    g = hq // hk
    peers = ["sdpa_cpu"] if cpu else ["sdpa_cudnn", "sdpa_flash"]
    elem = torch.empty((), dtype=dt).element_size()
    for s in cfg["contexts"]:
        nbytes = R.kv_bytes(b, s, hk, d, elem)
        sets = []
        try:
            for _ in range(decode_sets(args, nbytes, cpu)):
                sets.append(dict(
                    q=torch.randn(b, 1, hq, d, dtype=dt, device=device),
                    k=torch.randn(b, s, hk, d, dtype=dt, device=device),
                    v=torch.randn(b, s, hk, d, dtype=dt, device=device)))
            seqlens = torch.full((b,), s, dtype=torch.int32, device=device)
        except Exception as exc:
            for impl in [R.OURS] + peers:
                rows.append(R.na("decode", impl, dt_name, d, False, s, b, hq, "decode",
                                 reason_of(exc, []), heads_kv=hk))
                progress.update(f"decode {s} {impl}")
            continue

        def ours(t):
            return lambda: impls.fa_kvcache(t["q"], t["k"], t["v"], cache_seqlens=seqlens)

        def gqa(t):
            return lambda: impls.F.scaled_dot_product_attention(
                t["q"].transpose(1, 2), t["k"].transpose(1, 2), t["v"].transpose(1, 2),
                enable_gqa=True)

        def packed(t):
            # The g query heads of a KV head as g query rows of that head (one query token,
            # no mask): the same function, K and V read once.
            return lambda: impls.F.scaled_dot_product_attention(
                t["q"].view(b, hk, g, d), t["k"].transpose(1, 2), t["v"].transpose(1, 2))

        variants = {R.OURS: [("", ours)]}
        for p in peers:
            variants[p] = [("enable_gqa", gqa), ("query heads as rows", packed)]
        # On the CPU every variant is timed DECODE_ROUNDS_CPU times, ours and the peers'
        # in turn within each round (a shared machine's load drifts over seconds), and a
        # variant's time is the median of its rounds.
        rounds = DECODE_ROUNDS_CPU if cpu else 1
        times, why = {}, {impl: [] for impl in variants}
        for _ in range(rounds):
            for impl in [R.OURS] + peers:
                for vname, make in variants[impl]:
                    if (impl, vname) in times and times[(impl, vname)] is None:
                        continue  # failed in an earlier round
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        try:
                            with impls.context(impl):
                                ms, reps, how = time_decode(torch, timer,
                                                            [make(t) for t in sets], cpu)
                            times.setdefault((impl, vname), []).append((ms, reps, how))
                        except Exception as exc:
                            times[(impl, vname)] = None
                            why[impl].append(f"{vname or impl}: {reason_of(exc, caught)}")
        for impl in [R.OURS] + peers:
            best = None
            for vname, _ in variants[impl]:
                got = times.get((impl, vname))
                if not got:
                    continue
                ms = R.median([m for m, _, _ in got])
                note = ", ".join(x for x in (vname, got[-1][2]) if x)
                if rounds > 1:
                    note = ", ".join(x for x in (note, f"median of {rounds} interleaved rounds") if x)
                if best is None or ms < best[0]:
                    best = (ms, sum(r for _, r, _ in got), note)
            if best:
                rows.append(R.row("decode", impl, dt_name, d, False, s, b, hq, "decode",
                                  heads_kv=hk, ms=best[0], tbps=R.tbps(nbytes, best[0]),
                                  reps=best[1], note=best[2]))
            else:
                rows.append(R.na("decode", impl, dt_name, d, False, s, b, hq, "decode",
                                 "; ".join(why[impl]), heads_kv=hk))
            progress.update(f"decode {s} {impl}")
        del sets
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def draft_tree(torch, n, gen):
    """tree_mask int32 [n, ceil(n / 32)] of a random draft tree: draft t hangs under a random
    earlier draft (or the context), and query i sees draft t when t is i or an ancestor."""
    parent = [-1] + [int(torch.randint(-1, t, (1,), generator=gen)) for t in range(1, n)]
    mask = torch.zeros(n, (n + 31) // 32, dtype=torch.int64)
    for i in range(n):
        t = i
        while t >= 0:
            mask[i, t // 32] |= 1 << (t % 32)
            t = parent[t]
    return torch.where(mask >= 1 << 31, mask - (1 << 32), mask).to(torch.int32)


def spec_kinds(cfg):
    """(kind, drafts) of the spec grid's cells per context: one-token decode, then each
    draft count above 1 linear and as a tree."""
    return [("linear", 1)] + [(k, n) for n in cfg["drafts"] if n > 1 for k in ("linear", "tree")]


def run_spec(torch, impls, timer, cfg, cpu, args, rows, progress):
    """Speculative decoding (issue 23): n draft tokens verified in one flash_attn_with_kvcache
    call against a dense cache whose last n keys are the drafts, causal (linear) and with a
    draft tree (tree_mask), against one-token decode (n = 1); flashattn only, timed as the
    decode grid (CUDA graphs on the GPU)."""
    device = "cpu" if cpu else "cuda"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    b, hq, hk, d = cfg["batch"], cfg["heads"], cfg["heads_kv"], cfg["hdim"]
    elem = torch.empty((), dtype=dt).element_size()
    gen = torch.Generator(device="cpu").manual_seed(7)
    kinds = spec_kinds(cfg)
    for s in cfg["contexts"]:
        nbytes = R.kv_bytes(b, s, hk, d, elem)
        try:
            sets = [dict(k=torch.randn(b, s, hk, d, dtype=dt, device=device),
                         v=torch.randn(b, s, hk, d, dtype=dt, device=device))
                    for _ in range(decode_sets(args, nbytes, cpu))]
            seqlens = torch.full((b,), s, dtype=torch.int32, device=device)
        except Exception as exc:
            for kind, n in kinds:
                rows.append(R.na("spec", R.OURS, cfg["dtype"], d, True, s, b, hq, "spec",
                                 reason_of(exc, []), heads_kv=hk, layout=f"{kind} {n}"))
                progress.update(f"spec {s} {kind} {n}")
            continue
        for kind, n in kinds:
            lay = f"{kind} {n}"
            try:
                q = torch.randn(b, n, hq, d, dtype=dt, device=device)
                tm = None
                if kind == "tree":
                    tm = draft_tree(torch, n, gen).unsqueeze(0).expand(b, -1, -1).contiguous()
                    tm = tm.to(device)
                calls = [lambda t=t: impls.fa_kvcache(q, t["k"], t["v"], cache_seqlens=seqlens,
                                                      causal=True, tree_mask=tm) for t in sets]
                with impls.context(R.OURS):
                    ms, reps, how = time_decode(torch, timer, calls, cpu)
                rows.append(R.row("spec", R.OURS, cfg["dtype"], d, True, s, b, hq, "spec",
                                  heads_kv=hk, ms=ms, tbps=R.tbps(nbytes, ms), reps=reps,
                                  note=how, layout=lay))
            except Exception as exc:
                rows.append(R.na("spec", R.OURS, cfg["dtype"], d, True, s, b, hq, "spec",
                                 reason_of(exc, []), heads_kv=hk, layout=lay))
            progress.update(f"spec {s} {lay}")
        del sets
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def time_decode(torch, timer, calls, cpu):
    """(ms per call, repeats, how): on the GPU the calls (one per input set, 8 rounds)
    captured into a CUDA graph whose replays are timed, so that launch gaps of these
    short calls do not count; eager timing where capture fails."""
    if cpu:
        ms, reps = timer.time(calls)
        return ms, reps, ""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls * 2:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rounds = 8
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for c in calls:
                    c()
        ms, reps = timer.time([graph.replay])
        return ms / (rounds * len(calls)), reps, "CUDA graph"
    except Exception:
        torch.cuda.synchronize()
        ms, reps = timer.time(calls)
        return ms, reps, "eager"


# ----------------------------------------------------------------- memory


def _cpu_rss():
    with open("/proc/self/status") as f:
        vals = {l.split(":")[0]: int(l.split()[1]) for l in f if l.startswith(("VmRSS", "VmHWM"))}
    return vals["VmRSS"] * 1024, vals["VmHWM"] * 1024


def _cpu_reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_memory(torch, impls, cfg, cpu, rows, progress):
    device = "cpu" if cpu else "cuda"
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg["dtype"]]
    b, h, d = cfg["batch"], cfg["heads"], cfg["hdim"]
    for impl in (R.OURS, "naive"):
        failed = None
        for s in cfg["seqlens"]:
            label = f"memory {impl} {s}"
            if failed:
                rows.append(R.na("memory", impl, cfg["dtype"], d, False, s, b, h, "fwd_bwd",
                                 f"not run: out of memory at seqlen {failed}"))
                progress.update(label)
                continue
            gc.collect()
            try:
                if cpu:
                    _cpu_reset_peak()
                    base = _cpu_rss()[0]
                else:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                q, k, v = (torch.randn(b, s, h, d, dtype=dt, device=device, requires_grad=True)
                           for _ in range(3))
                do = torch.randn(b, s, h, d, dtype=dt, device=device)
                if impls.bhsd(impl):
                    do = do.transpose(1, 2)
                grads = torch.autograd.grad(impls.forward(impl, q, k, v, False), (q, k, v), do)
                if cpu:
                    peak = _cpu_rss()[1] - base
                else:
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - base
                ms = (time.perf_counter() - t0) * 1e3
                del q, k, v, do, grads
                rows.append(R.row("memory", impl, cfg["dtype"], d, False, s, b, h, "fwd_bwd",
                                  ms=ms, peak_gib=peak / 2**30, reps=1,
                                  note="peak allocated incl. inputs and gradients"
                                  if not cpu else "peak RSS growth"))
            except Exception as exc:
                failed = s
                rows.append(R.na("memory", impl, cfg["dtype"], d, False, s, b, h, "fwd_bwd",
                                 reason_of(exc, [])))
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
            progress.update(label)


# ----------------------------------------------------------------- main


def plot_dir(path):
    """Plots from DIR/results.json, or from DIR/results.csv (and DIR/meta.json if there)."""
    if os.path.exists(os.path.join(path, "results.json")):
        meta, rows = R.read_json(os.path.join(path, "results.json"))
    else:
        rows = R.read_csv(os.path.join(path, "results.csv"))
        meta = {}
        if os.path.exists(os.path.join(path, "meta.json")):
            import json
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
    for p in R.plot_all(meta, rows, path):
        print("wrote", p)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU backend, small grid")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (a smoke run)")
    ap.add_argument("--out", help="results directory (default build/bench-results/<date>-<device>)")
    ap.add_argument("--grids", default="standard,decode,memory",
                    help="comma list of standard, decode, memory, prefill, spec")
    ap.add_argument("--only", metavar="DIRS",
                    help="standard grid directions: comma list of fwd, bwd, fwd_bwd (default all)")
    ap.add_argument("--hdims", help="standard grid head dims, e.g. 64,128,256")
    ap.add_argument("--seqlens", help="standard grid seqlens, e.g. 512,2k,16k")
    ap.add_argument("--dtypes", help="standard grid dtypes: comma list of bf16, fp16 (fp32 on the "
                    "CPU); on the CPU also the decode grid's (default fp32 and bf16)")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both",
                    help="standard grid: causal cells, non-causal cells or both")
    ap.add_argument("--impls", help="comma list of implementations (default: all; "
                    + ", ".join(R.GPU_IMPLS) + "; on the CPU " + ", ".join(R.CPU_IMPLS) + ")")
    ap.add_argument("--families", help="flashattn kernel families to measure, comma list of "
                    + ", ".join(R.FAMILIES) + " (columns flashattn, flashattn-sm80, ...); the "
                    "first in this process, each other in a subprocess (standard grid only)")
    ap.add_argument("--prefill-chunk", action="store_true",
                    help="also the prefill-chunk measurement (the same as adding 'prefill' to --grids)")
    ap.add_argument("--decode-batches", help="decode grid batches, e.g. 1,8,64 (default 8)")
    ap.add_argument("--decode-contexts", help="decode grid contexts, e.g. 1k,4k,128k (default 4k,32k,128k)")
    ap.add_argument("--no-gemm", action="store_true", help="skip the ceilings (GEMM, and the read bandwidth before the decode grid)")
    ap.add_argument("--budget-ms", type=float, help="timed milliseconds per measurement")
    ap.add_argument("--min-reps", type=int)
    ap.add_argument("--max-reps", type=int)
    ap.add_argument("--sets", type=int, default=None, help="input sets to rotate among")
    ap.add_argument("--timing", choices=("graph", "eager"),
                    help="standard grid on the GPU: graph (default: the calls captured into a "
                    "CUDA graph, its replays timed, so that host time per call does not count; "
                    "eager where capture fails) or eager (CUDA events around every call)")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds for the standard grid; cells after it are recorded as not run")
    ap.add_argument("--plot", metavar="DIR", help="only draw the plots from DIR/results.json")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def timing_mode(args, cpu):
    """The standard grid's timing: "host clock" on the CPU; on the GPU --timing, default
    "graph". --timing graph with --cpu is a usage error (ValueError)."""
    if cpu:
        if getattr(args, "timing", None) == "graph":
            raise ValueError("--timing graph: CUDA graphs need the GPU (the CPU mode times "
                             "with the host clock)")
        return "host clock"
    return getattr(args, "timing", None) or "graph"


def resolve(args, cpu):
    """(standard grid, grids, implementation names, families) from the options; raises
    ValueError with the option's name on a bad value. Needs neither torch nor a GPU."""
    grids = R.parse_list(args.grids, allowed=("standard", "decode", "memory", "prefill", "spec"),
                         what="--grids entry")
    if args.prefill_chunk and "prefill" not in grids:
        grids.append("prefill")
    grid = dict((R.CPU_QUICK if args.quick else R.CPU) if cpu else
                (R.QUICK if args.quick else R.STANDARD))
    if args.only:
        grid["directions"] = tuple(R.parse_list(args.only, allowed=R.DIRECTIONS,
                                                what="--only direction"))
    if args.hdims:
        grid["hdims"] = tuple(R.parse_list(args.hdims, int, what="--hdims entry"))
    if args.seqlens:
        grid["seqlens"] = tuple(R.parse_list(args.seqlens, int, what="--seqlens entry"))
    if args.dtypes:
        grid["dtypes"] = tuple(R.parse_list(args.dtypes, allowed=("bf16", "fp16", "fp32"),
                                            what="--dtypes entry"))
    grid["causals"] = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    timing_mode(args, cpu)  # raises on --timing graph with --cpu
    families = (R.parse_list(args.families, allowed=R.FAMILIES, what="--families entry")
                if args.families else [])
    if len(set(families)) != len(families):
        raise ValueError(f"--families {args.families!r}: a family is named twice")
    first = families[0] if families else os.environ.get("FLASHATTN_KERNEL_FAMILY", "auto")
    ours = R.family_impl(first)
    names = [ours if n == R.OURS else n for n in (R.CPU_IMPLS if cpu else R.GPU_IMPLS)]
    if args.impls:
        want = R.parse_list(args.impls, what="--impls entry")
        want = [ours if n == R.OURS else n for n in want]
        names = [n for n in names if n in want]
    return grid, grids, names, families


def decode_grid(args, cpu):
    """The decode grid of the options: R.DECODE_CPU with the --dtypes of the run on the CPU
    (default fp32 and bf16), R.DECODE (bf16) on the GPU, with fewer contexts for --quick;
    --decode-batches / --decode-contexts replace its batch and contexts on either."""
    if cpu:
        dec = dict(R.DECODE_CPU)
        if args.dtypes:
            dec["dtypes"] = tuple(R.parse_list(args.dtypes, allowed=("bf16", "fp16", "fp32"),
                                               what="--dtypes entry"))
    else:
        dec = dict(R.DECODE)
        if args.quick:
            dec["contexts"] = (4096, 32768)
    if args.decode_batches:
        dec["batches"] = tuple(R.parse_list(args.decode_batches, int, what="--decode-batches entry"))
    if args.decode_contexts:
        dec["contexts"] = tuple(R.parse_list(args.decode_contexts, int, what="--decode-contexts entry"))
    if any(x < 1 for x in dec.get("batches", ()) + dec["contexts"]):
        raise ValueError("--decode-batches / --decode-contexts: expected values >= 1")
    return dec


def main(argv=None):
    args = build_parser().parse_args(argv)

    if args.plot:
        plot_dir(args.plot)
        return 0
    cpu = args.cpu
    try:
        grid, grids, names, families = resolve(args, cpu)
    except ValueError as exc:
        print(f"bench/suite.py: {exc}", file=sys.stderr)
        return 2
    args.ours = R.family_impl(families[0] if families else
                              os.environ.get("FLASHATTN_KERNEL_FAMILY", "auto"))
    if families:
        # Before flashattn loads: the library reads the variable once per process.
        os.environ["FLASHATTN_KERNEL_FAMILY"] = families[0]

    import torch

    if not cpu and not torch.cuda.is_available():
        print("bench/suite.py: no CUDA device visible to torch; use --cpu", file=sys.stderr)
        return 2
    import flashattn

    if not cpu and not flashattn.cuda_available():
        print("bench/suite.py: flashattn was built without the CUDA backend", file=sys.stderr)
        return 2
    args.budget_ms = args.budget_ms or (150.0 if cpu else 25.0)
    args.min_reps = args.min_reps or (2 if cpu else 3)
    args.max_reps = args.max_reps or (10 if cpu else 30)
    args.sets = args.sets or (2 if cpu else 3)
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = False

    fa4 = fa4_version = fa4_reason = None
    if not cpu and "fa4" in names:
        fa4, fa4_version, fa4_reason = load_fa4()
        if fa4 is None:
            names.remove("fa4")
    try:
        dec = decode_grid(args, cpu)
    except ValueError as exc:
        print(f"bench/suite.py: {exc}", file=sys.stderr)
        return 2
    mem = R.MEMORY_CPU if cpu else R.MEMORY
    pre = R.PREFILL_CPU if cpu else R.PREFILL
    spec = R.SPEC_CPU if cpu else R.SPEC
    if args.quick and not cpu:
        mem = dict(mem, seqlens=(4096, 16384, 32768))

    meta = metadata(torch, cpu, args)
    out = args.out or R.default_out_dir(os.path.join(REPO, "build", "bench-results"), meta["device"])
    os.makedirs(out, exist_ok=True)
    meta["grid"] = {k: list(v) if isinstance(v, tuple) else v for k, v in grid.items()}
    meta["grids"] = grids
    meta["impls"] = names
    meta["timing"] = timing_mode(args, cpu)
    if families:
        meta["families"] = families
    if "prefill" in grids:
        meta["prefill"] = {k: list(v) if isinstance(v, tuple) else v for k, v in pre.items()}
    if fa4 is not None:
        meta["fa4"] = fa4_version
        meta["fa4_note"] = f"FA4: flash-attn-4 {fa4_version} (flash_attn.cute) is a peer in this run"
    elif not cpu and not args.worker:
        meta["fa4"] = "absent"
        meta["fa4_note"] = (f"FA4: not importable here ({fa4_reason or 'not selected'}); no FA4 "
                            "column (to bring it to the GPU machine: ../shared/peers/README.md)")
    print(f"flashattn benchmark: {R.meta_line(meta)}; results in {out}", flush=True)
    if meta.get("fa4_note"):
        print(meta["fa4_note"], flush=True)

    total = 0
    if "standard" in grids:
        total += len(R.standard_cells(grid)) * len(names)
    if "decode" in grids:
        total += (len(dec["contexts"]) * len(decode_batches(dec)) *
                  len(decode_dtypes(dec)) * (3 if not cpu else 2))
    if "memory" in grids:
        total += 2 * len(mem["seqlens"])
    if "prefill" in grids:
        total += (1 + len(pre["blocks"])) * (2 if fa4 is not None and not cpu else 1)
    if "spec" in grids:
        total += len(spec["contexts"]) * len(spec_kinds(spec))
    progress = R.Progress(total, "bench")
    impls = Impls(torch, cpu, fa4)
    timer = Timer(torch, cpu, args.budget_ms, args.min_reps, args.max_reps,
                  timing=timing_mode(args, cpu))
    rows, wall = [], {}
    meta["wall_s"] = wall
    t_all = time.time()

    def save():
        # After every grid, so that a later failure keeps what was measured.
        wall["total"] = time.time() - t_all
        R.write_csv(os.path.join(out, "results.csv"), rows)
        R.write_json(os.path.join(out, "results.json"), meta, rows)

    if not args.no_gemm:
        g = run_gemm(torch, timer, R.GEMM_CPU if cpu else R.GEMM, cpu, rows)
        meta["gemm_tflops"] = g["tflops"]
        unit = "GFLOP/s" if cpu else "TFLOP/s"
        print(f"GEMM ceiling: {g['dtype']} {g['seqlen']}^3 torch.matmul " +
              (f"{g['tflops'] * (1e3 if cpu else 1):.0f} {unit}" if g["status"] == "ok"
               else f"n/a ({g['note']})"), flush=True)
    # Decode last: it is the grid whose calls (CUDA graph capture) are likeliest to fail.
    if "standard" in grids:
        t0 = time.time()
        args.deadline = t0 + args.time_limit if args.time_limit else 0
        run_standard(torch, impls, timer, grid, names, cpu, args, rows, progress)
        wall["standard grid"] = time.time() - t0
        save()
        for fam in families[1:]:
            t0 = time.time()
            run_family(args, grid, fam, os.path.join(out, f"family-{fam}"), rows)
            wall[f"standard grid, family {fam}"] = time.time() - t0
            save()
    if "prefill" in grids:
        t0 = time.time()
        run_prefill(torch, impls, timer, pre, cpu, args, rows, progress)
        wall["prefill chunk"] = time.time() - t0
        save()
    if "spec" in grids:
        t0 = time.time()
        run_spec(torch, impls, timer, spec, cpu, args, rows, progress)
        wall["speculative decoding"] = time.time() - t0
        save()
    if "memory" in grids:
        t0 = time.time()
        run_memory(torch, impls, mem, cpu, rows, progress)
        wall["memory sweep"] = time.time() - t0
        save()
    if "decode" in grids:
        t0 = time.time()
        if not args.no_gemm:
            rb = run_read_bandwidth(torch, timer, cpu, rows)
            meta["read_tbps"] = rb["tbps"]
        run_decode(torch, impls, timer, dec, cpu, args, rows, progress)
        wall["decode grid"] = time.time() - t0
    progress.close()
    save()
    if args.worker:
        return 0
    text = R.report(meta, rows)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    if not args.no_plot:
        try:
            for p in R.plot_all(meta, rows, out):
                print("wrote", p)
        except ImportError:
            print(f"matplotlib is not installed here: draw the plots elsewhere with "
                  f"`python3 bench/suite.py --plot {out}` (or `bash scripts/bench.sh --plot {out}`)")
    print(f"results: {out}/results.csv, results.json, report.md")
    print()
    print(text, end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
