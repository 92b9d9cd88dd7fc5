// y = x W^T for bfloat16 on CPU, every row summed in one fixed order: batchgen's batch-invariant bf16
// matmul.
//
// oneDNN's bf16 GEMM picks its blocking (and so the order it adds a row's products in) by the number
// of rows and threads: the same row comes out in different bits alone and in a batch, which makes a
// row's tokens depend on its batch. Here each output is one chain over K in order, 32 at a time, in
// one accumulator, whatever the rows beside it, the batch size or the threads:
//   - with AMX (Sapphire Rapids and later): tiles of 16 rows x 32 K (A) by 32 K x 16 columns (B),
//     accumulated with TDPBF16PS in a 16 x 16 float32 tile, K in order;
//   - with AVX512_BF16 only (Zen 4, Cooper Lake): VDPBF16PS, one 16-column accumulator per row, K in
//     order, pairs at a time; 12 rows x 32 columns a register block.
// A row's result depends only on its own values and W (on one machine: AMX and VDPBF16PS do not
// round alike, so the instruction set used is recorded).
//
// W is held packed as [N/16, K/32, 16, 16, 2] bf16 (N and K padded with zeros to 16 and 32): each
// (column block, K block) is one B tile of 1 KiB in the VNNI order both instructions read, and a
// column block's tiles lie in K order, so a pass over K streams contiguous memory. Built on the
// machine that runs it (batchgen/kernels, -march=native).
//
// Two epilogues, applied as a block's outputs leave the kernel, give the bits of the plain product
// followed by the op they replace, without that op's passes over memory:
//   - bgemm_swiglu: W packed with gate block j beside up block j (a task's 32 columns), and
//     y = round(round(silu(round(g))) * round(u)), silumul.cpp's formula and roundings (vec.h's SiLU);
//     the [T, 2I] product is never written;
//   - bgemm_add: y = round(h + round(x W^T)), ATen's bf16 add (both in float32, rounded once).
// On AMX a block's epilogue runs a few rows at a time between the next block's tile products (the tile
// unit and the vector units then work side by side): SwiGLU's e^x and division had left the tiles idle
// for a third of the MLP's time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

#if !defined(__AVX512BF16__)
#error "batchgen bgemm needs bf16 dot-product instructions (AVX512_BF16 or AMX); this CPU has neither"
#else  // the rest of the file: only the line above where the build must fail

constexpr int64_t TN = 16;    // columns of a B tile
constexpr int64_t TK = 32;    // K of a tile
constexpr int64_t TILE = TN * TK;  // bf16 elements of a B tile
constexpr int64_t MB = 32;    // rows per block (two A tiles)
constexpr int64_t MC = 128;   // rows per task: they stay in cache while the task runs its columns

// Linux hands a process the AMX tile state only when asked (XFEATURE_XTILEDATA = 18)
static bool amx_usable() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return ok;
#else
  return false;
#endif
}

// float32 -> bfloat16 -> float32: rounded to nearest even, as c10::BFloat16 does
static inline __m512 round_f32(__m512 v) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  __m256i hi;
  std::memcpy(&hi, &h, sizeof hi);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

static inline void store16(__m512 v, int64_t cols, c10::BFloat16* y) {
  const __m256bh h = _mm512_cvtneps_pbh(v);
  if (cols >= 16) {
    std::memcpy(y, &h, sizeof h);
  } else {
    c10::BFloat16 tmp[16];
    std::memcpy(tmp, &h, sizeof h);
    std::memcpy(y, tmp, cols * sizeof(*y));
  }
}

// a row's 32 outputs c into y (cols of them)
static inline void store_bf16(const float* c, int64_t cols, c10::BFloat16* y) {
  store16(_mm512_loadu_ps(c), cols, y);
  if (cols > 16) store16(_mm512_loadu_ps(c + 16), cols - 16, y + 16);
}

// the same, plus the residual h (cols of it): round(h + round(c))
static inline void store_add(const float* c, int64_t cols, const c10::BFloat16* h, c10::BFloat16* y) {
  for (int64_t half = 0; half < 2 && half * 16 < cols; ++half) {
    const int64_t n = std::min<int64_t>(16, cols - half * 16);
    const __mmask16 m = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, h + half * 16)), 16));
    store16(_mm512_add_ps(round_f32(_mm512_loadu_ps(c + half * 16)), hv), n, y + half * 16);
  }
}

// gate c[0, 16) and up c[16, 32): silu(g) * u for cols of them, rounded where bgemm then silumul round
static inline void store_swiglu(const float* c, int64_t cols, c10::BFloat16* y) {
  const __m512 g = round_f32(_mm512_loadu_ps(c)), u = round_f32(_mm512_loadu_ps(c + 16));
  batchgen_vec::vec gv;
  std::memcpy(&gv, &g, sizeof gv);
  const batchgen_vec::vec s = batchgen_vec::silu(gv);
  __m512 sv;
  std::memcpy(&sv, &s, sizeof sv);
  store16(_mm512_mul_ps(round_f32(sv), u), cols, y);
}

enum class Epilogue { Plain, Add, SwiGLU };

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

// rows [0, 16 * AT) of a (row stride lda) times column blocks b0, b1 (32 columns); c [16 * AT][32].
// between(kb) runs after each K step's tile products are issued: the tile unit works through them
// while the core runs the vector code there (the previous block's epilogue), instead of one waiting
// for the other
template <int AT, typename F>
static inline void amx_block(const c10::BFloat16* a, int64_t lda, int64_t KB, const c10::BFloat16* b0,
                             const c10::BFloat16* b1, float* c, F&& between) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (AT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, a + kb * TK, lda * 2);
    _tile_loadd(6, b0 + kb * TILE, 64);
    _tile_loadd(7, b1 + kb * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (AT == 2) {
      _tile_loadd(5, a + 16 * lda + kb * TK, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    between(kb);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if constexpr (AT == 2) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}
#endif

// the same products with VDPBF16PS: R rows of a times b0, b1 (32 columns); c [R][32]. 2R accumulators
// (24 at R = 12): each pair of weight vectors loaded once serves R rows, each row's pair of x values
// is one broadcast load, so the dot products, not the loads, set the pace
template <int R>
static inline void dp_rows(const c10::BFloat16* a, int64_t lda, int64_t KB, const c10::BFloat16* b0,
                           const c10::BFloat16* b1, float* c) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const c10::BFloat16* w0p = b0 + kb * TILE;
    const c10::BFloat16* w1p = b1 + kb * TILE;
    const c10::BFloat16* ap = a + kb * TK;
#pragma GCC unroll 4
    for (int p = 0; p < TK / 2; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w0p + p * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w1p + p * 32);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, ap + r * lda + 2 * p, 4);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * 32, acc[r][0]);
    _mm512_storeu_ps(c + r * 32 + 16, acc[r][1]);
  }
}

constexpr int DR = 12;  // rows of a VDPBF16PS block

// `rows` (<= MB) rows: DR at a time, then the rest in one smaller block (each row's sums the same)
static void dp_block(const c10::BFloat16* a, int64_t lda, int64_t rows, int64_t KB, const c10::BFloat16* b0,
                     const c10::BFloat16* b1, float* c) {
  int64_t r = 0;
  for (; r + DR <= rows; r += DR) dp_rows<DR>(a + r * lda, lda, KB, b0, b1, c + r * 32);
  const auto* ar = a + r * lda;
  float* cr = c + r * 32;
  switch (rows - r) {
    case 0: break;
    case 1: dp_rows<1>(ar, lda, KB, b0, b1, cr); break;
    case 2: dp_rows<2>(ar, lda, KB, b0, b1, cr); break;
    case 3: dp_rows<3>(ar, lda, KB, b0, b1, cr); break;
    case 4: dp_rows<4>(ar, lda, KB, b0, b1, cr); break;
    case 5: dp_rows<5>(ar, lda, KB, b0, b1, cr); break;
    case 6: dp_rows<6>(ar, lda, KB, b0, b1, cr); break;
    case 7: dp_rows<7>(ar, lda, KB, b0, b1, cr); break;
    case 8: dp_rows<8>(ar, lda, KB, b0, b1, cr); break;
    case 9: dp_rows<9>(ar, lda, KB, b0, b1, cr); break;
    case 10: dp_rows<10>(ar, lda, KB, b0, b1, cr); break;
    default: dp_rows<11>(ar, lda, KB, b0, b1, cr); break;
  }
}

// y [.., n] = x [.., K] W^T through epilogue E; `per` outputs a task's 32 columns give (32, or 16 for
// SwiGLU); h [.., n] the residual for Add
template <Epilogue E>
at::Tensor multiply(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t use_amx, const at::Tensor* h = nullptr) {
  constexpr int64_t per = E == Epilogue::SwiGLU ? 16 : 32;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "batchgen bgemm: bfloat16 only");
  TORCH_CHECK(w.dim() == 5 && w.size(2) == TK / 2 && w.size(3) == TN && w.size(4) == 2 && w.is_contiguous(),
              "batchgen bgemm: weight must be packed [N/16, K/32, 16, 16, 2]");
  const int64_t K = x.size(-1), NB = w.size(0), KB = w.size(1);
  TORCH_CHECK(K > 0, "batchgen bgemm: x has no columns (K = 0)");
  TORCH_CHECK(NB % 2 == 0 && n <= NB / 2 * per && n > (NB / 2 - 1) * per && KB * TK >= K && (KB - 1) * TK < K,
              "batchgen bgemm: shapes do not match");
  const bool amx = use_amx && amx_usable();
  TORCH_CHECK(!use_amx || amx, "batchgen bgemm: AMX asked for but not usable here");
  auto x2 = x.contiguous();
  const int64_t M = x2.numel() / std::max<int64_t>(K, 1);
  const int64_t KP = KB * TK;  // K padded: rows of x are copied to a zero-padded block when K < KP
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  at::Tensor h2;
  if constexpr (E == Epilogue::Add) {
    TORCH_CHECK(h->scalar_type() == at::kBFloat16 && h->sizes() == y.sizes(),
                "batchgen bgemm_add: the residual must be bfloat16 of the output's shape ", y.sizes(), ", got ", h->sizes());
    h2 = h->contiguous();
  }
  const c10::BFloat16* hp = E == Epilogue::Add ? h2.data_ptr<c10::BFloat16>() : nullptr;
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t NP = NB / 2;  // pairs of column blocks: 32 columns a task step
  const int64_t MT = (M + MC - 1) / MC;
  // a block's rows leave through the epilogue: its float32 sums c [rows][32] become y (cols of them)
  auto finish = [&](const float* c, int64_t m, int64_t r0, int64_t r1, int64_t col0, int64_t cols) {
    for (int64_t r = r0; r < r1; ++r) {
      c10::BFloat16* yr = yp + (m + r) * n + col0;
      if constexpr (E == Epilogue::Plain) store_bf16(c + r * 32, cols, yr);
      if constexpr (E == Epilogue::Add) store_add(c + r * 32, cols, hp + (m + r) * n + col0, yr);
      if constexpr (E == Epilogue::SwiGLU) store_swiglu(c + r * 32, cols, yr);
    }
  };
  at::parallel_for(0, MT * NP, 1, [&](int64_t t0, int64_t t1) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) amx_configure();
#endif
    std::vector<c10::BFloat16> pad;  // a block of rows, zero-padded to MB rows and KP columns
    alignas(64) float cbuf[2][MB * 32];  // on tiles: this block's sums, and the last block's awaiting its epilogue
    struct Held { int64_t m = 0, rows = 0, col0 = 0, cols = 0; } held;  // the last block (rows 0: none)
    int cur = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mt = t / NP, np = t % NP;
      const auto* b0 = wp + (2 * np) * KB * TILE;
      const auto* b1 = b0 + KB * TILE;
      const int64_t col0 = np * per, cols = std::min<int64_t>(per, n - col0);
      for (int64_t m = mt * MC; m < std::min(M, (mt + 1) * MC); m += MB) {
        const int64_t rows = std::min<int64_t>(MB, M - m);
        const c10::BFloat16* a = xp + m * K;
        int64_t lda = K;
        if (rows < MB || K != KP) {  // the same instructions on a copy: a row's sums do not change
          pad.assign(MB * KP, c10::BFloat16(0.0f));
          for (int64_t r = 0; r < rows; ++r) std::memcpy(pad.data() + r * KP, a + r * K, K * sizeof(*a));
          a = pad.data();
          lda = KP;
        }
        float* c = cbuf[cur];
        if (amx) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
          // the last block's epilogue, a few rows after each K step of this one
          const float* hc = cbuf[cur ^ 1];
          const int64_t per_kb = (held.rows + KB - 1) / KB;  // K > 0: KB >= 1
          auto between = [&](int64_t kb) {
            const int64_t r0 = kb * per_kb, r1 = std::min(held.rows, r0 + per_kb);
            if (r0 < r1) finish(hc, held.m, r0, r1, held.col0, held.cols);
          };
          if (rows <= 16) {
            amx_block<1>(a, lda, KB, b0, b1, c, between);
          } else {
            amx_block<2>(a, lda, KB, b0, b1, c, between);
          }
          held = {m, rows, col0, cols};
          cur ^= 1;
#endif
        } else {
          dp_block(a, lda, rows, KB, b0, b1, c);
          finish(c, m, 0, rows, col0, cols);
        }
      }
    }
    if (held.rows) finish(cbuf[cur ^ 1], held.m, 0, held.rows, held.col0, held.cols);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) _tile_release();
#endif
  });
  return y;
}

at::Tensor bgemm(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t use_amx) {
  return multiply<Epilogue::Plain>(x, w, n, use_amx);
}

// silu(x Wg^T) * (x Wu^T) [.., n] from a weight packed with gate and up blocks side by side
at::Tensor bgemm_swiglu(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t use_amx) {
  return multiply<Epilogue::SwiGLU>(x, w, n, use_amx);
}

// h + x W^T
at::Tensor bgemm_add(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t use_amx, const at::Tensor& h) {
  return multiply<Epilogue::Add>(x, w, n, use_amx, &h);
}

// "amx" or "avx512-bf16": the instructions bgemm runs on by default here
std::string isa() { return amx_usable() ? "amx" : "avx512-bf16"; }

TORCH_LIBRARY(batchgen_bgemm, m) {
  m.def("bgemm(Tensor x, Tensor w, int n, int use_amx) -> Tensor");
  m.def("bgemm_swiglu(Tensor x, Tensor w, int n, int use_amx) -> Tensor");
  m.def("bgemm_add(Tensor x, Tensor w, int n, int use_amx, Tensor h) -> Tensor");
  m.def("isa() -> str", &isa);
}
TORCH_LIBRARY_IMPL(batchgen_bgemm, CPU, m) {
  m.impl("bgemm", &bgemm);
  m.impl("bgemm_swiglu", &bgemm_swiglu);
  m.impl("bgemm_add", &bgemm_add);
}
#endif  // __AVX512BF16__
