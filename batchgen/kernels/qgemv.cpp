// y = x W^T on CPU with W in GGUF's own low-bit blocks, dequantized in registers: batchgen's exact
// low-bit kernel.
//
// The default model ships as a GGUF whose matrices are Q4_1 (layers) and Q8_0 values, so multiplying
// by those blocks computes the very model the GGUF holds, reading 0.625 (Q4_1) or 1.0625 (Q8_0) bytes
// a weight instead of 4 (float32) or 2 (bfloat16). Activations stay float32: no activation is
// quantized (llama.cpp quantizes them to 8 bits for its dot products), so the only rounding is
// float32's.
//
//   Q4_1, a block of 32 weights along K: w = d q + m, q in 0..15 (4 bits), d and m fp16
//   Q8_0, a block of 32 weights along K: w = d q, q in -128..127, d fp16
//
// Held as qs [N/G, K/32, G, 16 or 32] bytes, d (and m) [N/G, K/32, G] fp16: the GGUF's bytes,
// regrouped so that the blocks of G = 8 side-by-side columns lie together (a decode step streams them
// in order, and a block's 8 scales convert in one instruction), 0.625 or 1.0625 bytes a weight still.
//
// Each block's weights are made in registers, exactly as float32 (d q + m, or d q: both exact), and
// multiplied into up to QR rows of x, so at decode's few rows the weights are streamed once from
// memory, and at prefill's many rows a block's unpacking is shared by QR rows. The product is the
// float32 model's (the dequantized weights' product), summed in this kernel's order; every row's sum
// runs in the same order whatever the number of rows, the rows beside it or the threads: a row's
// result does not depend on its batch. The AVX-512 and AVX2 Q4_1 paths sum each block as d (q . x) +
// m (sum of x) instead (the same weights' product, associated per block; see lay_out), where making a
// block's weights cost more than multiplying them; the two give the same bits.
//
// The vector code is written once (the #else branch below) and compiled twice into this library,
// for AVX-512 and for AVX2 (+FMA, F16C), and the one to run is chosen at run time from the CPU's
// flags (or forced, for tests, by `isa`). Elsewhere (Arm, old x86) a portable build of the same code
// serves.
#ifndef BATCHGEN_QGEMV_BODY
#define BATCHGEN_QGEMV_BODY

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BATCHGEN_X86 1
#endif

constexpr int64_t QK = 32;        // weights per block
constexpr int64_t MC = 64;        // rows of x per task: they stay in cache while a task runs its columns
constexpr int64_t G = 8;          // columns a group: their blocks interleaved, side by side; a task's columns
constexpr int64_t PF = 16;        // blocks ahead that a tile prefetches (2 KB of Q4_1 quants)
constexpr int64_t LAID = 1 << 17; // floats (512 KB) of laid-out x a task's rows take at most (Q4_1 on AVX-512, AVX2)

// a kernel: rows [0, M) of x [M, K] (row stride ldx) times the first `ncols` columns of one group
// (qs [K/32, G, block bytes], d and m [K/32, G]); y [M, ncols] (row stride ldy)
using Kernel = void (*)(const float* x, int64_t ldx, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
                        const uint16_t* m, int64_t ncols, float* y, int64_t ldy);

#ifdef BATCHGEN_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace isa_avx512 {
#define QVL 16
#define QR 8
#define QC 8
#include __FILE__
#undef QC
#undef QR
#undef QVL
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("no-avx512f,avx2,fma,f16c")
namespace isa_avx2 {
#define QVL 8
#define QR 4
#define QC 4
#include __FILE__
#undef QC
#undef QR
#undef QVL
}  // namespace isa_avx2
#pragma GCC pop_options
#endif

namespace isa_portable {
#define QVL 8
#define QR 4
#define QC 4
#define QPORTABLE 1
#include __FILE__
#undef QPORTABLE
#undef QC
#undef QR
#undef QVL
}  // namespace isa_portable

// isa: 0 = the best this CPU runs, 512 = AVX-512, 2 = AVX2, 1 = the portable build; a build may be
// capped below the CPU's best (BATCHGEN_ISA_CAP, from ATEN_CPU_CAPABILITY: see batchgen.kernels)
#ifndef BATCHGEN_ISA_CAP
#define BATCHGEN_ISA_CAP 512
#endif
static int best_isa() {
#ifdef BATCHGEN_X86
  __builtin_cpu_init();
  if (BATCHGEN_ISA_CAP >= 512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return 512;
  if (BATCHGEN_ISA_CAP >= 2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return 2;  // F16C comes with AVX2 CPUs
#endif
  return 1;
}

static int resolve_isa(int64_t isa) {
  const int best = best_isa();
  if (isa == 0) return best;
  TORCH_CHECK(isa == 1 || isa == 2 || isa == 512, "batchgen qgemv: isa must be 0, 1, 2 or 512, got ", isa);
  TORCH_CHECK(isa == 1 || (isa == 2 && best >= 2) || (isa == 512 && best == 512),
              "batchgen qgemv: this CPU (or its ATEN_CPU_CAPABILITY cap) does not run isa ", isa, " (best: ", best, ")");
  return static_cast<int>(isa);
}

static Kernel pick(int isa, bool q4) {
#ifdef BATCHGEN_X86
  if (isa == 512) return q4 ? isa_avx512::q4_1_cols : isa_avx512::q8_0_cols;
  if (isa == 2) return q4 ? isa_avx2::q4_1_cols : isa_avx2::q8_0_cols;
#endif
  return q4 ? isa_portable::q4_1_cols : isa_portable::q8_0_cols;
}

// silu(g) * u for G side-by-side outputs of `rows` rows (g and u: [rows, G]) into y (row stride ldy)
using Act = void (*)(const float* g, const float* u, int64_t rows, float* y, int64_t ldy);

// What a call does with its products, as each task's tile leaves the kernel: y = x W^T; y = h + x W^T
// (a residual stream plus the layer's output: o_proj, down_proj); or SwiGLU, y = silu(g) * u over the
// two halves of W's rows (gate, then up: a task runs a group of gate columns and the same up columns,
// so the [M, n] product is never written). Each has the bits of the plain product followed by ATen's
// add, or by the silumul kernel (vec.h's silu): the same float32 operations on the same values.
struct Epilogue {
  const float* h = nullptr;  // add: the residual [M, n] (contiguous)
  Act swiglu = nullptr;      // SwiGLU: the chosen build's activation (act_rows)
};

// One task: rows [r0, r0 + rows) times output group g, through the epilogue. `tile(group, out, ldo)`
// runs the kernel on a group of W's columns into out (row stride ldo); y is [M, n], or [M, n / 2] for
// SwiGLU (whose groups count the gate's); tmp holds 2 rows G floats (SwiGLU's gate and up tiles).
template <class Tile>
static inline void task(const Tile& tile, int64_t g, int64_t r0, int64_t rows, int64_t n, const Epilogue& e,
                        float* y, float* tmp) {
  if (e.swiglu) {
    const int64_t half = n / 2;
    tile(g, tmp, G);
    tile(g + half / G, tmp + rows * G, G);
    e.swiglu(tmp, tmp + rows * G, rows, y + r0 * half + g * G, half);
    return;
  }
  float* out = y + r0 * n + g * G;
  tile(g, out, n);
  if (e.h != nullptr) {
    const float* h = e.h + r0 * n + g * G;
    const int64_t cols = std::min(G, n - g * G);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[r * n + c] = h[r * n + c] + out[r * n + c];
  }
}

static Act pick_act(int isa) {
#ifdef BATCHGEN_X86
  if (isa == 512) return isa_avx512::act_rows;
  if (isa == 2) return isa_avx2::act_rows;
#endif
  return isa_portable::act_rows;
}

// The vector builds' Q4_1 tiles read x laid out for their lanes (lay_out below): laid out once, in
// parallel; then tasks as in `run`, over chunks of whole panels whose laid-out x (at most LAID floats)
// stays in cache while a task runs its columns
using LayOut = void (*)(const float* x, int64_t M, int64_t p0, int64_t p1, int64_t KB, float* xe);

static void run_laid(LayOut lay_out_rows, int64_t XB, int64_t R, Kernel kernel, const float* xp, int64_t M, int64_t KB,
                     int64_t NGo, const uint8_t* qp, const uint16_t* dp, const uint16_t* mp, int64_t n, float* yp,
                     const Epilogue& e, const at::TensorOptions& opt) {
  constexpr int64_t BB = QK / 2;
  constexpr int64_t SMALL = 48 * 33;  // floats: decode's lone row (K <= 1,536) laid out here, not allocated
  float small[SMALL];
  at::Tensor laid;
  float* xl = small;
  if (M * KB * XB > SMALL) {
    laid = at::empty({M * KB * XB}, opt);
    xl = laid.data_ptr<float>();
  }
  const int64_t panels = M / R + M % R;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { lay_out_rows(xp, M, p0, p1, KB, xl); });
  const int64_t most = std::max<int64_t>(LAID / (KB * XB) / R, 1) * R;
  const int64_t MB = (M + most - 1) / most, mc = ((M + MB - 1) / MB + R - 1) / R * R;  // chunks alike
  at::parallel_for(0, MB * NGo, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp(e.swiglu ? 2 * mc * G : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / NGo, g = t % NGo;
      const int64_t r0 = mb * mc, rows = std::min(mc, M - r0);
      const float* x = xl + r0 * KB * XB;
      task([&](int64_t gg, float* out, int64_t ldo) {
        kernel(x, 0, rows, KB, qp + gg * KB * G * BB, dp + gg * KB * G, mp + gg * KB * G, std::min(G, n - gg * G),
               out, ldo);
      }, g, r0, rows, n, e, yp, tmp.data());
    }
  });
}

static at::Tensor run(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                      int64_t n, int64_t isa, const Epilogue& epi = {}, const c10::optional<at::Tensor>& h = c10::nullopt) {
  const bool q4 = m.has_value();
  const int64_t BB = q4 ? QK / 2 : QK;
  TORCH_CHECK(x.scalar_type() == at::kFloat, "batchgen qgemv: x must be float32");
  TORCH_CHECK(qs.scalar_type() == (q4 ? at::kByte : at::kChar) && qs.dim() == 4 && qs.size(2) == G &&
              qs.size(3) == BB && qs.is_contiguous(),
              "batchgen qgemv: qs must be [N/", G, ", K/32, ", G, ", ", BB, "] ", q4 ? "uint8" : "int8");
  const int64_t NG = qs.size(0), KB = qs.size(1), K = x.size(-1);
  TORCH_CHECK(K == KB * QK && KB > 0, "batchgen qgemv: x's last size ", K, " is not the weight's K ", KB * QK);
  TORCH_CHECK(n > (NG - 1) * G && n <= NG * G, "batchgen qgemv: n = ", n, " does not fit ", NG, " groups of ", G);
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.sizes() == at::IntArrayRef({NG, KB, G}) && d.is_contiguous(),
              "batchgen qgemv: d must be [N/", G, ", K/32, ", G, "] float16");
  if (q4)
    TORCH_CHECK(m->scalar_type() == at::kHalf && m->sizes() == at::IntArrayRef({NG, KB, G}) && m->is_contiguous(),
                "batchgen qgemv: m must be [N/", G, ", K/32, ", G, "] float16");
  TORCH_CHECK(!epi.swiglu || n % (2 * G) == 0, "batchgen qgemv: SwiGLU needs gate and up halves of whole groups of ",
              G, " rows, got n = ", n);
  const int chosen = resolve_isa(isa);
  const Kernel kernel = pick(chosen, q4);
  const auto x2 = x.contiguous();
  const int64_t M = x2.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = epi.swiglu ? n / 2 : n;
  at::Tensor hc;
  Epilogue e = epi;
  if (h.has_value()) {
    TORCH_CHECK(h->scalar_type() == at::kFloat && h->sizes() == at::IntArrayRef(sizes),
                "batchgen qgemv: the residual must be float32 ", at::IntArrayRef(sizes), ", got ", h->scalar_type(), " ",
                h->sizes());
    hc = h->contiguous();
    e.h = hc.data_ptr<float>();
  }
  auto y = at::empty(sizes, x.options());
  if (M == 0) return y;
  const int64_t NGo = e.swiglu ? n / 2 / G : NG;  // the tasks' output groups
  const float* xp = x2.data_ptr<float>();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = q4 ? reinterpret_cast<const uint16_t*>(m->data_ptr<at::Half>()) : nullptr;
  float* yp = y.data_ptr<float>();
#ifdef BATCHGEN_X86
  if (q4 && chosen == 512) {
    run_laid(isa_avx512::lay_out_rows, isa_avx512::XB, isa_avx512::PANEL, kernel, xp, M, KB, NGo, qp, dp, mp, n, yp, e,
             y.options());
    return y;
  }
  if (q4 && chosen == 2) {
    run_laid(isa_avx2::lay_out_rows, isa_avx2::XB, isa_avx2::PANEL, kernel, xp, M, KB, NGo, qp, dp, mp, n, yp, e,
             y.options());
    return y;
  }
#endif
  // tasks are (chunk of MC rows, group of G columns), groups fastest: at decode's few rows the threads
  // split the groups, each streaming its own contiguous part of the weights
  const int64_t MB = (M + MC - 1) / MC;
  at::parallel_for(0, MB * NGo, 1, [&](int64_t t0, int64_t t1) {
    float tmp[2 * MC * G];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / NGo, g = t % NGo;
      const int64_t r0 = mb * MC, rows = std::min(MC, M - r0);
      const float* xr = xp + r0 * K;
      task([&](int64_t gg, float* out, int64_t ldo) {
        kernel(xr, K, rows, KB, qp + gg * KB * G * BB, dp + gg * KB * G, mp ? mp + gg * KB * G : nullptr,
               std::min(G, n - gg * G), out, ldo);
      }, g, r0, rows, n, e, yp, tmp);
    }
  });
  return y;
}

at::Tensor q4_1(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m, int64_t n,
                int64_t isa) {
  return run(x, qs, d, m, n, isa);
}

at::Tensor q8_0(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, int64_t n, int64_t isa) {
  return run(x, qs, d, c10::nullopt, n, isa);
}

// the product's epilogues, on either format (m given: Q4_1, else Q8_0)
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                  int64_t n, int64_t isa) {
  Epilogue e;
  e.swiglu = pick_act(resolve_isa(isa));
  return run(x, qs, d, m, n, isa, e);
}

at::Tensor add(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
               int64_t n, const at::Tensor& h, int64_t isa) {
  return run(x, qs, d, m, n, isa, {}, h);
}

int64_t isa() { return best_isa(); }
int64_t group() { return G; }

TORCH_LIBRARY(batchgen_qgemv, lib) {
  lib.def("q4_1(Tensor x, Tensor qs, Tensor d, Tensor m, int n, int isa=0) -> Tensor");
  lib.def("q8_0(Tensor x, Tensor qs, Tensor d, int n, int isa=0) -> Tensor");
  // silu(x Wg^T) * (x Wu^T) [.., n / 2], W's rows the gate's n / 2 then the up's; m given: Q4_1, else Q8_0
  lib.def("swiglu(Tensor x, Tensor qs, Tensor d, Tensor? m, int n, int isa=0) -> Tensor");
  // h + x W^T
  lib.def("add(Tensor x, Tensor qs, Tensor d, Tensor? m, int n, Tensor h, int isa=0) -> Tensor");
  // no tensor to dispatch on: one kernel for every backend
  lib.def("isa() -> int", &isa);
  lib.def("group() -> int", &group);
}
TORCH_LIBRARY_IMPL(batchgen_qgemv, CPU, lib) {
  lib.impl("q4_1", &q4_1);
  lib.impl("q8_0", &q8_0);
  lib.impl("swiglu", &swiglu);
  lib.impl("add", &add);
}

#else  // ---- the vector code, compiled once per instruction set (QVL floats a vector, QR rows a pass) ----

typedef float fvec __attribute__((vector_size(QVL * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(QVL * sizeof(int32_t))));

static inline fvec loadf(const float* p) { fvec v; std::memcpy(&v, p, sizeof v); return v; }

static inline fvec fma(fvec a, fvec b, fvec c) {  // a b + c, one rounding on every build
#if defined(QPORTABLE)
  fvec r;
  _Pragma("GCC unroll 16") for (int i = 0; i < QVL; ++i) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return r;
#elif QVL == 16
  return (fvec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (fvec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// QVL bytes widened to QVL int32 lanes (zero- or sign-extended): one vpmovzxbd / vpmovsxbd (GCC's
// generic conversion of a byte vector measured as a lane-by-lane insert, 5x slower in all)
static inline ivec wide(const uint8_t* p) {
#if defined(QPORTABLE)
  ivec v;
  _Pragma("GCC unroll 16") for (int i = 0; i < QVL; ++i) v[i] = p[i];
  return v;
#elif QVL == 16
  return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}

static inline fvec sints(const int8_t* p) {
#if defined(QPORTABLE)
  ivec v;
  _Pragma("GCC unroll 16") for (int i = 0; i < QVL; ++i) v[i] = p[i];
#elif QVL == 16
  const ivec v = (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  const ivec v = (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
  return __builtin_convertvector(v, fvec);
}

static inline fvec broadcast(float f) {
#if defined(QPORTABLE)
  return fvec{} + f;
#elif QVL == 16
  return (fvec)_mm512_set1_ps(f);
#else
  return (fvec)_mm256_set1_ps(f);
#endif
}

static inline float hsum(fvec v) {  // a fixed tree: halves added until one lane is left
  float a[QVL];
  std::memcpy(a, &v, sizeof a);
  _Pragma("GCC unroll 16") for (int w = QVL / 2; w > 0; w /= 2)
    _Pragma("GCC unroll 16") for (int i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

static inline float half(uint16_t h) {  // fp16 -> fp32
#if defined(QPORTABLE)
  return c10::detail::fp16_ieee_to_fp32_value(h);
#else
  return _cvtsh_ss(h);
#endif
}

// N halves (N = 1, 4 or 8, side by side) -> floats
template <int N>
static inline void halves(const uint16_t* h, float* f) {
#if !defined(QPORTABLE)
  if constexpr (N == 8) {
    _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))));
    return;
  } else if constexpr (N == 4) {
    _mm_storeu_ps(f, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h))));
    return;
  }
#endif
  _Pragma("GCC unroll 8") for (int i = 0; i < N; ++i) f[i] = half(h[i]);
}

// the Q4_1 weights d q + m of QVL nibbles (the low 4 bits of each lane): d q is exact in float32
// (11 x 4 bits), so one fused d q + m is the reference's rounding of d q + m: these are the model's
// weights exactly, as float32. (AVX-512 and AVX2 run Q4_1 their own way: q4_tile below.)
struct Q4Weights {
  fvec d, m;
  Q4Weights(fvec d_, fvec m_) : d(d_), m(m_) {}
  fvec of(ivec q) const { return fma(__builtin_convertvector(q & 15, fvec), d, m); }
};

// a block's scales (or offsets) for N side-by-side columns, each broadcast to a vector on demand
template <int N>
struct Scales {
  float f[N];
  explicit Scales(const uint16_t* h) { halves<N>(h, f); }
#if !defined(QPORTABLE) && QVL == 16
  fvec splat(int c) const {  // a broadcast load: work for a load port, none for the shuffle port
    __m512 r;                // (GCC would otherwise shuffle in registers)
    asm("vbroadcastss %1, %0" : "=v"(r) : "m"(f[c]));
    return (fvec)r;
  }
#else
  fvec splat(int c) const { return broadcast(f[c]); }
#endif
};

// A tile: ROWS rows of x times COLS columns of a group. Each block's weights are made exact in float32
// registers (Q4_1: d q + m; Q8_0: d q, exact as well: 11 x 8 bits) and multiplied into every row of
// the tile: acc += w x, a block's vector chunks in turn, y = hsum(acc). Each (row, column) pair is
// summed by the same operations in the same order whatever the tile's shape, so a row's result never
// depends on the rows beside it. Decode's lone rows run COLS columns a pass (independent accumulators
// hide the FMA latency, one load of x serves them all, and the group's interleaved blocks stream from
// memory in order); prefill's many rows run QR rows a column (one unpacking serves them all).
template <bool Q4, int ROWS, int COLS>
static inline void tile(const float* __restrict__ x, int64_t ldx, int64_t KB, const uint8_t* __restrict__ qs,
                        const uint16_t* __restrict__ d, const uint16_t* __restrict__ m, float* __restrict__ out,
                        int64_t ldo) {
  constexpr int64_t BB = Q4 ? QK / 2 : QK;  // bytes of quants a block
  fvec acc[ROWS][COLS];
  _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) acc[r][c] = fvec{};
  for (int64_t b = 0; b < KB; ++b) {
    _Pragma("GCC unroll 4") for (int64_t l = 0; l < G * BB; l += 64) __builtin_prefetch(qs + (b + PF) * G * BB + l);
    __builtin_prefetch(d + (b + PF) * G);
    if constexpr (Q4) __builtin_prefetch(m + (b + PF) * G);
    const uint8_t* qb = qs + b * G * BB;  // this block of the tile's first column; the next column's follows
    const float* xb = x + b * QK;
    const Scales<COLS> ds(d + b * G);
    if constexpr (Q4) {
      const Scales<COLS> ms(m + b * G);
      _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
        const Q4Weights w(ds.splat(c), ms.splat(c));
        _Pragma("GCC unroll 4") for (int j = 0; j < QK / 2; j += QVL) {  // byte j: weight j (low), j + 16 (high)
          const ivec qi = wide(qb + c * BB + j);
          const fvec lo = w.of(qi), hi = w.of(qi >> 4);
          _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r) {
            acc[r][c] = fma(lo, loadf(xb + r * ldx + j), acc[r][c]);
            acc[r][c] = fma(hi, loadf(xb + r * ldx + QK / 2 + j), acc[r][c]);
          }
        }
      }
    } else {
      _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) {
        const fvec db = ds.splat(c);
        _Pragma("GCC unroll 4") for (int j = 0; j < QK; j += QVL) {
          const fvec w = sints(reinterpret_cast<const int8_t*>(qb + c * BB + j)) * db;
          _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r) acc[r][c] = fma(w, loadf(xb + r * ldx + j), acc[r][c]);
        }
      }
    }
  }
  _Pragma("GCC unroll 16") for (int r = 0; r < ROWS; ++r)
    _Pragma("GCC unroll 16") for (int c = 0; c < COLS; ++c) out[r * ldo + c] = hsum(acc[r][c]);
}

// the group's first ncols columns for rows [0, M): QR rows a column while QR rows are left, then a row
// QC columns at a time
template <bool Q4>
static void cols(const float* x, int64_t ldx, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
                 const uint16_t* m, int64_t ncols, float* y, int64_t ldy) {
  constexpr int64_t BB = Q4 ? QK / 2 : QK;
  int64_t r = 0;
  for (; r + QR <= M; r += QR)
    for (int64_t c = 0; c < ncols; ++c)
      tile<Q4, QR, 1>(x + r * ldx, ldx, KB, qs + c * BB, d + c, m + c, y + r * ldy + c, ldy);
  for (; r < M; ++r) {
    int64_t c = 0;
    for (; c + QC <= ncols; c += QC)
      tile<Q4, 1, QC>(x + r * ldx, ldx, KB, qs + c * BB, d + c, m + c, y + r * ldy + c, 1);
    for (; c < ncols; ++c)
      tile<Q4, 1, 1>(x + r * ldx, ldx, KB, qs + c * BB, d + c, m + c, y + r * ldy + c, 1);
  }
}

#if !defined(QPORTABLE)
// The vector builds' Q4_1 path. Making a block's weights (AVX-512: a table of its 16 weights, one
// permute a vector) cost as much as the rest of the block's work together (measured on a Zen 4), so a
// block is multiplied without making its weights:
//
//   sum over the block of (d q + m) x  =  d (sum of q x) + m (sum of x)
//
// the same weights' product, associated per block; the sum of x is the row's own, made once a call.
// The 8 columns' blocks (8 x 16 bytes, as stored) are 32-byte (AVX2) or 64-byte (AVX-512) vectors of
// 2 or 4 columns: 32-bit lane l of one holds bytes 4 (l % 4) .. 4 (l % 4) + 3 of its column l / 4's
// block, so its nibble j (bits 4j .. 4j + 3) is the q of weight 4 (l % 4) + j / 2 (+ 16 for an odd j),
// and the x it needs depends on l % 4 only. The nibble is read in place, one mask and one conversion:
// q 2^4j, exact in float32 (4 significant bits), times x 2^-4j, which `lay_out` makes once a call, 4
// floats a nibble (x's own size), and the tile's load broadcasts to every column of the vector. So
// each q x is rounded once, as each w x is (x 2^-4j is exact for |x| >= 2^-98: a smaller x is rounded
// as a subnormal). Nibble 7 (bits 28-31) would convert as a negative int32, and there is no unsigned
// conversion on AVX2: it is shifted down and read as q, against x itself (the same exact product). A
// block then costs 2 operations per lane of weights (shared by a panel's rows) and one multiply-add
// per row and lane. Each column is summed in its 4 lanes by the same operations in every tile, on
// either instruction set, then in one fixed tree: a row's result does not depend on the rows beside
// it, nor on which of the two ran it (tested). Measured on a Zen 4 against the table, one row, weights
// in cache, one thread: 1.8x; from memory, two threads: 1.2x (docs/speed.md).

constexpr int64_t XB = 8 * 4 + 1;       // floats of laid-out x a row and block: 8 nibbles x 4 lanes, and a sum
constexpr int64_t PANEL = QVL == 16 ? 4 : 2;  // rows laid out together, for a tile of as many rows

// P rows of x (row stride ldx) -> a panel: xe[b][j][p][i] = x[p][32 b + 4 i + j / 2 + 16 (j % 2)] 2^-4j
// (j < 7; 1 for j = 7), then the block sums s[b][p], each in one fixed tree (halves added)
void lay_out(const float* x, int64_t ldx, int64_t P, int64_t KB, float* xe) {
  float* sums = xe + KB * 32 * P;
  for (int64_t b = 0; b < KB; ++b)
    for (int64_t p = 0; p < P; ++p) {
      const float* xb = x + p * ldx + b * QK;
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {  // h: the low (even j) or high (odd j) 16 weights
        __m128 r0 = _mm_loadu_ps(xb + 16 * h), r1 = _mm_loadu_ps(xb + 16 * h + 4),
               r2 = _mm_loadu_ps(xb + 16 * h + 8), r3 = _mm_loadu_ps(xb + 16 * h + 12);
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // r_t = x[16 h + t + 4 i], i = 0..3
        const __m128 rt[4] = {r0, r1, r2, r3};
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; ++t) {
          const int j = 2 * t + h;
          _mm_storeu_ps(xe + ((b * 8 + j) * P + p) * 4,
                        _mm_mul_ps(rt[t], _mm_set1_ps(j == 7 ? 1.f : 1.f / float(1u << (4 * j)))));
        }
      }
      float a[16];
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) a[i] = xb[i] + xb[16 + i];
      _Pragma("GCC unroll 4") for (int w = 8; w > 0; w /= 2)
        _Pragma("GCC unroll 8") for (int i = 0; i < w; ++i) a[i] += a[i + w];
      sums[b * P + p] = a[0];
    }
}

// panels [p0, p1) of rows x [M, K] (row stride K): PANEL rows a panel while whole ones are left, then
// one row a panel; the panel that starts at row r is laid out at xe + r K/32 XB
void lay_out_rows(const float* x, int64_t M, int64_t p0, int64_t p1, int64_t KB, float* xe) {
  const int64_t full = M / PANEL;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t r = p < full ? p * PANEL : full * PANEL + (p - full);
    lay_out(x + r * KB * QK, KB * QK, p < full ? PANEL : 1, KB, xe + r * KB * XB);
  }
}

// A tile's start of block b, on either instruction set: the group's 8 scales d (returned), m (sum of x)
// added for the panel's R rows (macc: 8 columns a row), and the group's blocks PF ahead prefetched
// (past its end, the next group's: they are contiguous), so that a call's streams are in flight from
// its start (measured: 1.1x a model's Q4_1 matmuls from memory)
template <int R>
static inline __m256 block_start(const uint8_t* qs, const uint16_t* d, const uint16_t* m, const float* sums,
                                 int64_t b, __m256* macc) {
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * G)));
  const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b * G)));
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
    macc[r] = _mm256_fmadd_ps(m8, _mm256_broadcast_ss(sums + b * R + r), macc[r]);
  _mm_prefetch(reinterpret_cast<const char*>(qs + (b + PF) * G * 16), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(qs + (b + PF) * G * 16 + 64), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + (b + PF) * G), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(m + (b + PF) * G), _MM_HINT_T0);
  return d8;
}

#if QVL == 16
// A panel of R rows times the group's 8 columns: out [R, 8] (row stride ldo), of which the columns
// before ncols are written
template <int R>
static inline void q4_tile(const float* __restrict__ xe, int64_t KB, const uint8_t* __restrict__ qs,
                           const uint16_t* __restrict__ d, const uint16_t* __restrict__ m, float* __restrict__ out,
                           int64_t ldo, int64_t ncols) {
  __m512 acc[R][2];   // d (q . x): 4 lanes a column, columns 0-3 and 4-7
  __m256 macc[R];     // m (sum of x), the 8 columns
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    macc[r] = _mm256_setzero_ps();
    acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  }
  const __m512i spread[2] = {  // lane l <- the scale of column l / 4, or 4 + l / 4
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
      _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7)};
  const float* sums = xe + KB * 32 * R;
  for (int64_t b = 0; b < KB; ++b) {
    const __m256 d8 = block_start<R>(qs, d, m, sums, b, macc);
    const float* xb = xe + b * 32 * R;
    const __m512i qv[2] = {_mm512_loadu_si512(qs + b * G * 16), _mm512_loadu_si512(qs + b * G * 16 + 64)};
    __m512 part[R][2];  // q . x of the block
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
      __m512 q[2];
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)  // q 2^4j, exact (4 significant bits); nibble 7: q
        q[h] = _mm512_cvtepi32_ps(j == 7 ? _mm512_srli_epi32(qv[h], 28)
                                         : _mm512_and_si512(qv[h], _mm512_set1_epi32(int(0xFu << (4 * j)))));
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_broadcast_f32x4(_mm_loadu_ps(xb + (j * R + r) * 4));  // a load, to 4 columns
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          part[r][h] = j == 0 ? _mm512_mul_ps(q[h], xv) : _mm512_fmadd_ps(q[h], xv, part[r][h]);
      }
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
      const __m512 dh = _mm512_permutexvar_ps(spread[h], _mm512_castps256_ps512(d8));
      _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) acc[r][h] = _mm512_fmadd_ps(dh, part[r][h], acc[r][h]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    float mo[8], a[32];
    _mm256_storeu_ps(mo, macc[r]);
    _mm512_storeu_ps(a, acc[r][0]);
    _mm512_storeu_ps(a + 16, acc[r][1]);
    for (int64_t c = 0; c < ncols; ++c)  // a column's 4 lanes in one fixed tree, then m (sum of x)
      out[r * ldo + c] = ((a[4 * c] + a[4 * c + 2]) + (a[4 * c + 1] + a[4 * c + 3])) + mo[c];
  }
}

// M rows of laid-out x (as lay_out_rows made them) times the group's first ncols columns: a panel's
// PANEL rows at a time, then the lone rows
void q4_1_cols(const float* xe, int64_t, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, int64_t ncols, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + PANEL <= M; r += PANEL) q4_tile<PANEL>(xe + r * KB * XB, KB, qs, d, m, y + r * ldy, ldy, ncols);
  for (; r < M; ++r) q4_tile<1>(xe + r * KB * XB, KB, qs, d, m, y + r * ldy, 1, ncols);
}
#else
// AVX2: with 16 registers a tile takes 8 columns of a lone row, or 4 columns of a panel of 2 rows

// A panel of R rows times V column pairs of the group, from column 2 v0: out [R, 2 V] (row stride
// ldo), of which the columns before ncols (counted from the tile's first) are written
template <int R, int V>
static inline void q4_tile(const float* __restrict__ xe, int64_t KB, const uint8_t* __restrict__ qs,
                           const uint16_t* __restrict__ d, const uint16_t* __restrict__ m, int v0,
                           float* __restrict__ out, int64_t ldo, int64_t ncols) {
  __m256 acc[R][V];  // d (q . x): 4 lanes a column, 2 columns a vector
  __m256 macc[R];    // m (sum of x), the group's 8 columns
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
    macc[r] = _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const float* sums = xe + KB * 32 * R;
  for (int64_t b = 0; b < KB; ++b) {
    const __m256 d8 = block_start<R>(qs, d, m, sums, b, macc);
    const float* xb = xe + b * 32 * R;
    const __m256i* qv = reinterpret_cast<const __m256i*>(qs + b * G * 16) + v0;
    __m256 part[R][V];  // q . x of the block
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
      __m256 xv[R];
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
        xv[r] = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xb + (j * R + r) * 4));
      _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {
        const __m256i raw = _mm256_loadu_si256(qv + v);
        const __m256 q = _mm256_cvtepi32_ps(j == 7 ? _mm256_srli_epi32(raw, 28)  // q; the others q 2^4j, exact
                                                   : _mm256_and_si256(raw, _mm256_set1_epi32(int(0xFu << (4 * j)))));
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
          part[r][v] = j == 0 ? _mm256_mul_ps(q, xv[r]) : _mm256_fmadd_ps(q, xv[r], part[r][v]);
      }
    }
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) {  // lanes 0-3 <- column 2 (v0 + v)'s d, 4-7 <- the next's
      const __m256 dv = _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(2 * (v0 + v), 2 * (v0 + v), 2 * (v0 + v),
                                                                        2 * (v0 + v), 2 * (v0 + v) + 1, 2 * (v0 + v) + 1,
                                                                        2 * (v0 + v) + 1, 2 * (v0 + v) + 1));
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[r][v] = _mm256_fmadd_ps(dv, part[r][v], acc[r][v]);
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
    float mo[8], a[8 * V];
    _mm256_storeu_ps(mo, macc[r]);
    _Pragma("GCC unroll 4") for (int v = 0; v < V; ++v) _mm256_storeu_ps(a + 8 * v, acc[r][v]);
    for (int64_t c = 0; c < std::min<int64_t>(ncols, 2 * V); ++c)  // as AVX-512's: 4 lanes in a fixed tree, then m
      out[r * ldo + c] = ((a[4 * c] + a[4 * c + 2]) + (a[4 * c + 1] + a[4 * c + 3])) + mo[2 * v0 + c];
  }
}

// M rows of laid-out x times the group's first ncols columns: a panel's 2 rows 4 columns at a time,
// then the lone rows 8 columns at a time
void q4_1_cols(const float* xe, int64_t, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, int64_t ncols, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + PANEL <= M; r += PANEL)
    for (int h = 0; h < 2 && 4 * h < ncols; ++h)
      q4_tile<PANEL, 2>(xe + r * KB * XB, KB, qs, d, m, 2 * h, y + r * ldy + 4 * h, ldy, ncols - 4 * h);
  for (; r < M; ++r) q4_tile<1, 4>(xe + r * KB * XB, KB, qs, d, m, 0, y + r * ldy, 1, ncols);
}
#endif
#else
void q4_1_cols(const float* x, int64_t ldx, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, int64_t ncols, float* y, int64_t ldy) {
  cols<true>(x, ldx, M, KB, qs, d, m, ncols, y, ldy);
}
#endif

void q8_0_cols(const float* x, int64_t ldx, int64_t M, int64_t KB, const uint8_t* qs, const uint16_t* d,
               const uint16_t* m, int64_t ncols, float* y, int64_t ldy) {
  cols<false>(x, ldx, M, KB, qs, d, m, ncols, y, ldy);
}

// SwiGLU's activation on a task's G gate and G up outputs a row, in this build's vectors: vec.h's silu,
// lane by lane, so the bits of silumul.cpp's float32 path built for the same instructions
void act_rows(const float* g, const float* u, int64_t rows, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < G; c += QVL) {  // zero-padded where a vector is wider than a group
      const int64_t w = std::min<int64_t>(QVL, G - c);
      float gp[QVL] = {}, up[QVL] = {}, yp[QVL];
      std::memcpy(gp, g + r * G + c, w * sizeof(float));
      std::memcpy(up, u + r * G + c, w * sizeof(float));
      const fvec s = batchgen_vec::silu_of<fvec, ivec>(loadf(gp)) * loadf(up);
      std::memcpy(yp, &s, sizeof s);
      std::memcpy(y + r * ldy + c, yp, w * sizeof(float));
    }
}

#endif
