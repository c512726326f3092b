// The main job: exact attention through flashattn next to the naive computation
// (S = QK^T materialised, softmax, PV), on the GPU when one is visible, else on the CPU.
// Prints, for each: max error against an fp64 computation, time, throughput and the
// extra memory the computation needed beyond its inputs and output.
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashattn/attention.hpp"
#include "flashattn/half.hpp"
#include "naive.hpp"

namespace fa = flashattn;

namespace {

enum class Precision { kBF16, kFP16, kFP32 };

struct Config {
  int batch = 1, heads = 8, seqlen = 2048, head_dim = 64;
  bool causal = false;
  Precision precision = Precision::kBF16;
  int repeats = 3;
  bool force_cpu = false;
};

Config defaults(bool gpu) {
  Config c;
  if (gpu) {
    c.batch = 4;
    c.heads = 16;
    c.seqlen = 4096;
    c.head_dim = 128;
    c.repeats = 10;
  }
  return c;
}

void usage(std::FILE* to) {
  const Config cpu = defaults(false), gpu = defaults(true);
  std::fprintf(
      to,
      "usage: flashattn_main [--cpu] [--batch N] [--heads N] [--seqlen N] [--head-dim N]\n"
      "                      [--causal] [--bf16|--fp16|--fp32] [--repeats N]\n"
      "Runs exact attention through flashattn and through the naive computation and prints\n"
      "the max error of each against fp64, the time, FLOP/s and the extra memory. Runs on\n"
      "the GPU when one is visible, else (or with --cpu) on the CPU backend.\n"
      "\n"
      "options (default on the GPU / on the CPU):\n"
      "  --cpu          run on the CPU backend even when a GPU is visible\n"
      "  --batch N      batch size, N >= 1 (%d / %d)\n"
      "  --heads N      attention heads, N >= 1 (%d / %d)\n"
      "  --seqlen N     sequence length of queries and keys, N >= 1 (%d / %d)\n"
      "  --head-dim N   head dim, 1 <= N <= 256; a multiple of 8 on the GPU (%d / %d)\n"
      "  --causal       causal mask (off)\n"
      "  --bf16         bfloat16 inputs and output (the default)\n"
      "  --fp16         float16 inputs and output\n"
      "  --fp32         float32 inputs and output (CPU backend only)\n"
      "  --repeats N    timed runs, N >= 1; the best (CPU) or median (GPU) is shown (%d / %d)\n"
      "  -h, --help     this text\n",
      gpu.batch, cpu.batch, gpu.heads, cpu.heads, gpu.seqlen, cpu.seqlen, gpu.head_dim,
      cpu.head_dim, gpu.repeats, cpu.repeats);
}

// A command-line error: the message names the option, the expected and the actual value;
// exit status 2 (as for any usage error).
[[noreturn]] void usage_error(const std::string& msg) {
  std::fprintf(stderr, "flashattn_main: %s\n(flashattn_main --help lists the options)\n",
               msg.c_str());
  std::exit(2);
}

// The integer value of option `name`: the whole text a decimal integer in [lo, hi].
int parse_int(const std::string& name, const char* text, long lo, long hi) {
  const std::string range = hi == INT_MAX ? "an integer >= " + std::to_string(lo)
                                          : "an integer in [" + std::to_string(lo) + ", " +
                                                std::to_string(hi) + "]";
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || x < lo || x > hi) {
    usage_error("option " + name + ": expected " + range + ", got '" + text + "'");
  }
  return static_cast<int>(x);
}

Config parse(int argc, char** argv, bool gpu) {
  Config c = defaults(gpu);
  int precision_options = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](long lo, long hi) -> int {
      if (i + 1 >= argc) {
        usage_error("option " + a + ": expected a value after it, got the end of the command line");
      }
      return parse_int(a, argv[++i], lo, hi);
    };
    if (a == "--batch") c.batch = value(1, INT_MAX);
    else if (a == "--heads") c.heads = value(1, INT_MAX);
    else if (a == "--seqlen") c.seqlen = value(1, INT_MAX);
    else if (a == "--head-dim") c.head_dim = value(1, 256);
    else if (a == "--repeats") c.repeats = value(1, INT_MAX);
    else if (a == "--causal") c.causal = true;
    else if (a == "--bf16") { c.precision = Precision::kBF16; ++precision_options; }
    else if (a == "--fp16") { c.precision = Precision::kFP16; ++precision_options; }
    else if (a == "--fp32") { c.precision = Precision::kFP32; ++precision_options; }
    else if (a == "--cpu") c.force_cpu = true;
    else if (a == "--help" || a == "-h") { usage(stdout); std::exit(0); }
    else usage_error("unknown option '" + a + "'");
  }
  if (precision_options > 1) {
    usage_error("options --bf16, --fp16, --fp32: expected at most one, got " +
                std::to_string(precision_options));
  }
  if (gpu && c.precision == Precision::kFP32) {
    usage_error("option --fp32: expected --bf16 or --fp16 on the GPU (the CUDA backend "
                "computes 16-bit inputs), got --fp32; add --cpu to run fp32 on the CPU");
  }
  // Inputs, outputs and the naive computation's S and P: refuse sizes whose element
  // counts do not fit in memory indices rather than overflow.
  const double elements = double(c.batch) * c.seqlen * c.heads * c.head_dim;
  const double scores = double(c.batch) * c.heads * c.seqlen * double(c.seqlen);
  if (elements > 9.0e15 || scores > 9.0e15) {
    char text[160];
    std::snprintf(text, sizeof text,
                  "got batch * seqlen * heads * head_dim = %.3g, batch * heads * seqlen^2 = %.3g",
                  elements, scores);
    usage_error(std::string("options --batch, --heads, --seqlen, --head-dim: expected sizes "
                            "below 9e15 elements, ") + text);
  }
  return c;
}

long max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Inputs as 16-bit or 32-bit storage plus the exact values they hold, in double.
struct Inputs {
  std::vector<std::uint16_t> q16, k16, v16;
  std::vector<float> q32, k32, v32;
  std::vector<double> q, k, v;  // values as stored
};

Inputs make_inputs(const Config& c, fa::DType dt, std::uint64_t seed) {
  const std::size_t n = std::size_t(c.batch) * c.seqlen * c.heads * c.head_dim;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Inputs in;
  auto fill = [&](std::vector<std::uint16_t>& s16, std::vector<float>& s32, std::vector<double>& d) {
    d.resize(n);
    if (dt == fa::DType::kFloat32) s32.resize(n); else s16.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = dist(rng);
      if (dt == fa::DType::kFloat32) { s32[i] = x; d[i] = x; }
      else if (dt == fa::DType::kBFloat16) { s16[i] = fa::float_to_bf16(x); d[i] = fa::bf16_to_float(s16[i]); }
      else { s16[i] = fa::float_to_fp16(x); d[i] = fa::fp16_to_float(s16[i]); }
    }
  };
  fill(in.q16, in.q32, in.q);
  fill(in.k16, in.k32, in.k);
  fill(in.v16, in.v32, in.v);
  return in;
}

double to_double(const void* data, fa::DType dt, std::size_t i) {
  switch (dt) {
    case fa::DType::kFloat32: return static_cast<const float*>(data)[i];
    case fa::DType::kBFloat16: return fa::bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    default: return fa::fp16_to_float(static_cast<const std::uint16_t*>(data)[i]);
  }
}

// fp64 attention for query rows `rows` of every (batch, head); returns max |out - ref|.
double max_error_fp64(const Config& c, const Inputs& in, const void* out, fa::DType dt,
                      const std::vector<int>& rows) {
  const int s = c.seqlen, d = c.head_dim, h = c.heads;
  const double scale = 1.0 / std::sqrt(double(d));
  double worst = 0.0;
#pragma omp parallel for collapse(2) reduction(max : worst) schedule(dynamic)
  for (int b = 0; b < c.batch; ++b)
    for (int hh = 0; hh < h; ++hh) {
      std::vector<double> p(s), o(d);
      for (int i : rows) {
        const double* qi = &in.q[((std::size_t(b) * s + i) * h + hh) * d];
        const int kend = c.causal ? i + 1 : s;
        double m = -INFINITY;
        for (int j = 0; j < kend; ++j) {
          const double* kj = &in.k[((std::size_t(b) * s + j) * h + hh) * d];
          double dot = 0;
          for (int x = 0; x < d; ++x) dot += qi[x] * kj[x];
          p[j] = dot * scale;
          m = std::max(m, p[j]);
        }
        double sum = 0;
        for (int j = 0; j < kend; ++j) sum += (p[j] = std::exp(p[j] - m));
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = 0; j < kend; ++j) {
          const double* vj = &in.v[((std::size_t(b) * s + j) * h + hh) * d];
          for (int x = 0; x < d; ++x) o[x] += p[j] * vj[x];
        }
        for (int x = 0; x < d; ++x) {
          const double got = to_double(out, dt, ((std::size_t(b) * s + i) * h + hh) * d + x);
          const double err = std::isfinite(got) ? std::abs(got - o[x] / sum) : INFINITY;
          worst = std::max(worst, err);
        }
      }
    }
  return worst;
}

std::vector<int> sample_rows(int s, int max_rows) {
  std::vector<int> rows;
  const int step = std::max(1, s / max_rows);
  for (int i = 0; i < s; i += step) rows.push_back(i);
  if (rows.back() != s - 1) rows.push_back(s - 1);
  return rows;
}

double attention_flops(const Config& c) {
  const double f = 4.0 * c.batch * c.heads * double(c.seqlen) * c.seqlen * c.head_dim;
  return c.causal ? f / 2 : f;
}

// Throughput in TFLOP/s on the GPU and GFLOP/s on the CPU (flop_unit 1e12 or 1e9).
void print_row(const char* name, double err, double sec, double flops, double flop_unit,
               double extra_bytes) {
  std::printf("| %-22s | %10.2e | %10.3f | %9.2f | %19.1f |\n", name, err, sec * 1e3,
              flops / sec / flop_unit, extra_bytes / (1024.0 * 1024.0));
}

int run(const Config& c, bool on_gpu) {
  const fa::DType dt = c.precision == Precision::kBF16   ? fa::DType::kBFloat16
                       : c.precision == Precision::kFP16 ? fa::DType::kFloat16
                                                         : fa::DType::kFloat32;
  std::printf("flashattn %s main job on the %s: %s, batch %d, heads %d, seqlen %d, head dim %d%s\n",
              fa::version(), on_gpu ? "GPU" : "CPU", fa::dtype_name(dt), c.batch, c.heads, c.seqlen,
              c.head_dim, c.causal ? ", causal" : "");
  const Inputs in = make_inputs(c, dt, 20261202);
  const std::size_t n = std::size_t(c.batch) * c.seqlen * c.heads * c.head_dim;
  const std::size_t bytes = n * fa::dtype_size(dt);
  const std::size_t lse_bytes = std::size_t(c.batch) * c.heads * c.seqlen * sizeof(float);
  std::vector<unsigned char> out_flash(bytes), out_naive(bytes);
  const void* qh = dt == fa::DType::kFloat32 ? (const void*)in.q32.data() : in.q16.data();
  const void* kh = dt == fa::DType::kFloat32 ? (const void*)in.k32.data() : in.k16.data();
  const void* vh = dt == fa::DType::kFloat32 ? (const void*)in.v32.data() : in.v16.data();

  // Operands where the computation runs.
  const void *q = qh, *k = kh, *v = vh;
  void *of = out_flash.data(), *on = out_naive.data(), *lse = nullptr;
  std::vector<float> lse_host;
  if (on_gpu) {
    void* dq = bench::gpu_alloc(bytes); void* dk = bench::gpu_alloc(bytes); void* dv = bench::gpu_alloc(bytes);
    of = bench::gpu_alloc(bytes); on = bench::gpu_alloc(bytes); lse = bench::gpu_alloc(lse_bytes);
    if (!dq || !dk || !dv || !of || !on || !lse) { std::fprintf(stderr, "GPU out of memory\n"); return 1; }
    bench::gpu_upload(dq, qh, bytes); bench::gpu_upload(dk, kh, bytes); bench::gpu_upload(dv, vh, bytes);
    q = dq; k = dk; v = dv;
  } else {
    lse_host.resize(lse_bytes / sizeof(float));
    lse = lse_host.data();
  }
  const fa::Device dev = on_gpu ? fa::Device::cuda(0) : fa::Device::cpu();
  auto view = [&](const void* p) {
    return fa::Tensor::contiguous(const_cast<void*>(p), dt, {c.batch, c.seqlen, c.heads, c.head_dim}, dev);
  };
  const fa::Tensor lse_view = fa::Tensor::contiguous(lse, fa::DType::kFloat32, {c.batch, c.heads, c.seqlen}, dev);
  fa::Options opts;
  opts.causal = c.causal;
  auto flash = [&] { fa::forward(view(q), view(k), view(v), view(of), lse_view, opts); };
  std::size_t naive_bytes = 0;
  auto naive = [&] {
    naive_bytes = on_gpu ? bench::naive_attention_gpu(q, k, v, on, dt, c.batch, c.seqlen, c.heads, c.head_dim, c.causal)
                         : bench::naive_attention_cpu(q, k, v, on, dt, c.batch, c.seqlen, c.heads, c.head_dim, c.causal);
  };
  auto time_ms = [&](const std::function<void()>& fn) {
    if (on_gpu) return bench::gpu_time_ms(fn, c.repeats);
    double best = 1e30;
    for (int r = 0; r < c.repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      best = std::min(best, seconds_since(t0) * 1e3);
    }
    return best;
  };

  // flashattn first: ru_maxrss only grows, so the naive run's growth is measured after it.
  const long rss0 = max_rss_kib();
  const double t_flash = time_ms(flash);
  const long rss1 = max_rss_kib();
  const double t_naive = time_ms(naive);
  const long rss2 = max_rss_kib();
  if (on_gpu) {
    bench::gpu_download(out_flash.data(), of, bytes);
    if (naive_bytes) bench::gpu_download(out_naive.data(), on, bytes);
  }

  const std::vector<int> rows = sample_rows(c.seqlen, on_gpu ? 64 : 512);
  const double e_flash = max_error_fp64(c, in, out_flash.data(), dt, rows);
  const double e_naive = naive_bytes ? max_error_fp64(c, in, out_naive.data(), dt, rows) : NAN;
  const double flops = attention_flops(c);
  std::printf("\n%s of %d runs; error over %zu query rows of every head; extra memory: %s\n\n",
              on_gpu ? "median" : "best", c.repeats, rows.size(),
              on_gpu ? "scratch the computation allocates" : "peak RSS growth");
  const double unit = on_gpu ? 1e12 : 1e9;
  std::printf("| %-22s | %10s | %10s | %9s | %-19s |\n", "computation", "max |err|", "time (ms)",
              on_gpu ? "TFLOP/s" : "GFLOP/s", "extra memory (MiB)");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(24, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str(), std::string(11, '-').c_str(), std::string(21, '-').c_str());
  const double mib = 1024.0 * 1024.0;
  print_row(on_gpu ? "flashattn (GPU)" : "flashattn (CPU)", e_flash, t_flash * 1e-3, flops, unit,
            on_gpu ? 0.0 : double(rss1 - rss0) * 1024.0);
  if (naive_bytes)
    print_row("naive (S materialised)", e_naive, t_naive * 1e-3, flops, unit,
              on_gpu ? double(naive_bytes) : double(rss2 - rss1) * 1024.0);
  else
    std::printf("| %-22s | could not allocate S and P on the GPU |\n", "naive (S materialised)");
  if (naive_bytes)
    std::printf("\nnaive needs %.1f MiB for S and P; flashattn is %.2fx the naive speed.\n",
                double(naive_bytes) / mib, t_naive / t_flash);
  if (on_gpu) {
    for (void* p : {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), of, on, lse}) bench::gpu_free(p);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool gpu_present = fa::cuda_available();
  bool want_cpu = false;
  for (int i = 1; i < argc; ++i) want_cpu |= std::strcmp(argv[i], "--cpu") == 0;
  const Config c = parse(argc, argv, gpu_present && !want_cpu);
  try {
    if (gpu_present && !c.force_cpu) return run(c, true);
    if (!gpu_present) std::puts("no CUDA device visible: running on the CPU backend");
    return run(c, false);
  } catch (const fa::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
