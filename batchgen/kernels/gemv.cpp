// y = x W^T for float32 on CPU, with W held blocked as [ceil(N / BN), K, BN]: batchgen's decode matmul.
//
// A decode step multiplies a few rows of activations by every weight matrix once, so its time is the
// time to stream the weights from memory. oneDNN's prepacked kernel reached 19-27 GB/s on a 2-core
// Zen 4 whose memory reads at ~41 GB/s (SmolLM2-135M's matrices, batch 1). This kernel streams each
// column block of W (K x BN floats, contiguous) once, keeping BN outputs for up to R rows in vector
// registers: the shape of Inductor's own CPU GEMM template for small M, without its need for the
// weights to be graph constants. It is built on the machine that runs it (batchgen/kernels,
// -march=native), so the vector width below is the machine's.
//
// gemv_swiglu: SwiGLU's gate and up matmuls with the activation applied as each output tile leaves the
// registers, silu(x Wg^T) * (x Wu^T), from a weight blocked so that block b holds gate columns
// [b H, b H + H) then the same up columns (H = BN / 2). The [M, 2I] product is never written: in a
// 4,096-token prefill step that is 50 MB a layer, faulted in afresh by the allocator, written and read
// back by the activation. Each gate and up sum is the same chain of operations as gemv's, and the
// activation the same as silumul.cpp's float32 one (vec.h's e^x), so the result has the bits of the two
// ops one after the other.
//
// gemv_add: h + x W^T, the residual stream added as each output tile leaves the registers (a layer's
// o_proj and down_proj): the bits of gemv then the add, without the product in memory and the add's
// second pass over it (a 4,096-token prefill step: 60 adds of [4,096, 576]).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "vec.h"

#if defined(__AVX512F__)
constexpr int VL = 16;  // floats per vector register
// 32 registers: 24 accumulators, 4 weight vectors. 6 rows of 4 vectors, not 8 of 3: each row's
// broadcast serves 4 FMAs, not 3 (faster on SmolLM2-135M's matrices with AVX-512, the same bits; 12 x 2,
// 7 x 4, 5 x 5, 4 x 6 and 3 x 8 all measured slower than 6 x 4)
constexpr int R = 6;    // rows per pass over a block: R * NV accumulators + NV weights <= 32 registers
constexpr int NV = 4;   // vectors per column block: NV independent FMA chains per row
#elif defined(__AVX__)
constexpr int VL = 8;
// 16 registers: 12 accumulators, 2 weight vectors, 1 broadcast. 6 rows of 2 vectors, not 4 of 3: each
// weight vector loaded serves 6 FMAs, not 4 (SmolLM2-135M's four matrices on a 2-core Zen 3, float32:
// 4,096 rows 109-129 -> 142-160 GFLOP/s, 64 rows 141-144 -> 180-189, one row the same; 3 runs each)
constexpr int R = 6;
constexpr int NV = 2;
#else
constexpr int VL = 4;   // SSE (16 registers), NEON (32)
constexpr int R = 4;
constexpr int NV = 3;
#endif
constexpr int BN = VL * NV;  // columns per block
constexpr int64_t MC = 64;   // rows per task: a task's rows of x (MC x K floats) stay in cache while
                             // it runs over its column blocks

typedef float vec __attribute__((vector_size(VL * sizeof(float))));  // GCC/Clang: the machine's vectors

static inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }

// The output of one column block: its first `cols` (<= BN) columns as they are (gemv; the last block of
// an N that is not a multiple of BN drops its padding), silu(gate) * up over its two halves (swiglu;
// `cols` <= BN / 2 outputs), or added to the residual h's same columns (add). h is read by Residual only.
struct Plain {
  static void put(const vec* acc, float* y, const float*, int64_t cols) {
    if (cols == BN) {
      std::memcpy(y, acc, BN * sizeof(float));  // a constant size: vector stores, not a call
    } else {
      std::memcpy(y, acc, cols * sizeof(float));
    }
  }
};
struct SwiGLU {
  static constexpr int H = BN / 2;
  static vec act(vec g, vec u) { return batchgen_vec::silu(g) * u; }  // silumul.cpp's float32
  static void put(const vec* acc, float* y, const float*, int64_t cols) {
    if constexpr (H % VL == 0) {  // AVX2 (NV = 2): the gate's vectors, then the up's
      if (cols == H) {
        for (int v = 0; v < NV / 2; ++v) {
          const vec a = act(acc[v], acc[NV / 2 + v]);
          std::memcpy(y + v * VL, &a, sizeof a);
        }
        return;
      }
    }
    alignas(64) float t[BN + VL], o[H + VL];  // past BN: room for a last vector's spare lanes (discarded)
    std::memcpy(t, acc, BN * sizeof(float));
    for (int j = 0; j < H; j += VL) {
      const vec a = act(load(t + j), load(t + H + j));
      std::memcpy(o + j, &a, sizeof a);
    }
    if (cols == H) {
      std::memcpy(y, o, H * sizeof(float));
    } else {
      std::memcpy(y, o, cols * sizeof(float));
    }
  }
};

struct Residual {
  static void put(const vec* acc, float* y, const float* h, int64_t cols) {
    if (cols == BN) {
      for (int v = 0; v < NV; ++v) {
        const vec a = load(h + v * VL) + acc[v];
        std::memcpy(y + v * VL, &a, sizeof a);
      }
      return;
    }
    alignas(64) float t[BN];
    std::memcpy(t, acc, BN * sizeof(float));
    for (int64_t j = 0; j < cols; ++j) y[j] = h[j] + t[j];
  }
};

// A share of the next column block's lines a pass asks for (prefetch, into L2) while it multiplies:
// `lines` lines from p, `per` at each k. At decode's few rows a task's first pass over its block streamed
// it from memory while the FMAs waited, and its other passes computed while the memory idled. SmolLM2-135M's
// four matrices, 30 layers, float32 on the 2-core Xeon with AVX-512 (in-process A/B, median of 11, the
// same bits): 64 rows 1.05-1.13x, 256 rows 1.05-1.09x, 2 to 32 rows 1.04-1.44x, one row level. At 1,024 and
// 3,757 rows it was 0.95-1.06x by matrix, so prompt-sized products (over 256 rows) ask for nothing.
// Balancing 64 rows' 9 column blocks over 2 threads by splitting the rows as well gained nothing over it.
// Not measured on an AVX2 machine.
struct NextBlock {
  const char* p = nullptr;
  int64_t lines = 0, per = 0;
};

// rows [0, ROWS) of x times one column block wb [K, BN], put to y by Out (h: the residual's rows, beside y's)
template <int ROWS, typename Out>
static inline void block_rows(const float* __restrict__ x, int64_t K, const float* __restrict__ wb,
                              float* __restrict__ y, const float* __restrict__ h, int64_t ldy, int64_t cols,
                              NextBlock a = {}) {
  vec acc[ROWS][NV];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < a.per; ++i)
      if (k * a.per + i < a.lines) __builtin_prefetch(a.p + (k * a.per + i) * 64, 0, 2);
    vec w[NV];
    for (int v = 0; v < NV; ++v) w[v] = load(wb + k * BN + v * VL);
    for (int r = 0; r < ROWS; ++r) {
      const float xk = x[r * K + k];
      for (int v = 0; v < NV; ++v) acc[r][v] += xk * w[v];
    }
  }
  for (int r = 0; r < ROWS; ++r) Out::put(acc[r], y + r * ldy, h ? h + r * ldy : nullptr, cols);
}

// the last rows of a chunk, fewer than R: one pass with `left` rows
template <int ROWS, typename Out>
static inline void rest_rows(int64_t left, const float* x, int64_t K, const float* wb, float* y, const float* h,
                             int64_t ldy, int64_t cols, NextBlock a) {
  if constexpr (ROWS > 0) {
    if (left == ROWS) {
      block_rows<ROWS, Out>(x, K, wb, y, h, ldy, cols, a);
    } else {
      rest_rows<ROWS - 1, Out>(left, x, K, wb, y, h, ldy, cols, a);
    }
  }
}

// y [.., n] = x [.., K] times the blocked w [NB, K, BN], each block giving `per` outputs (BN, or BN / 2);
// Residual's h [.., n] beside it
template <typename Out>
at::Tensor multiply(const at::Tensor& x, const at::Tensor& w, int64_t n, int64_t per, const char* what,
                    const at::Tensor* residual = nullptr) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, what, ": float32 only");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == BN && w.is_contiguous(), what, ": weight must be [NB, K, ", BN, "]");
  const int64_t K = x.size(-1), NB = w.size(0);
  TORCH_CHECK(K > 0 && w.size(1) == K && n <= NB * per && n > (NB - 1) * per, what, ": shapes do not match");
  const auto x2 = x.contiguous();
  const int64_t M = x2.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  at::Tensor h2;
  if (residual) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->sizes() == y.sizes(), what,
                ": the residual must be float32 of the output's shape ", y.sizes(), ", got ", residual->sizes());
    h2 = residual->contiguous();
  }
  const float* hp = residual ? h2.data_ptr<float>() : nullptr;
  const float* xp = x2.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // tasks are (chunk of MC rows, column block), column blocks fastest: at decode's few rows the
  // threads split the column blocks, each streaming its own contiguous part of W; at prefill's many
  // rows a thread runs over the blocks with its rows of x held in cache
  const int64_t MB = (M + MC - 1) / MC;
  at::parallel_for(0, MB * NB, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / NB, nb = t % NB;
      const float* wb = wp + nb * K * BN;
      const int64_t cols = std::min<int64_t>(per, n - nb * per);
      float* yb = yp + nb * per;
      const float* hb = hp ? hp + nb * per : nullptr;
      int64_t m = mb * MC;
      const int64_t m_end = std::min(M, m + MC);
      // the thread's next task's block, an equal share of its lines a pass (NextBlock)
      const char* after = t + 1 < t1 && M <= 4 * MC ? reinterpret_cast<const char*>(wp + (t + 1) % NB * K * BN) : nullptr;
      const int64_t lines = K * BN * int64_t(sizeof(float)) / 64, passes = (m_end - m + R - 1) / R;
      const int64_t share = (lines + passes - 1) / passes;
      int64_t asked = 0;
      auto next = [&] {
        NextBlock a;
        if (after) {
          a.p = after + asked * 64;
          a.lines = std::min(share, lines - asked);
          a.per = (a.lines + K - 1) / K;
          asked += a.lines;
        }
        return a;
      };
      for (; m + R <= m_end; m += R)
        block_rows<R, Out>(xp + m * K, K, wb, yb + m * n, hb ? hb + m * n : nullptr, n, cols, next());
      rest_rows<R - 1, Out>(m_end - m, xp + m * K, K, wb, yb + m * n, hb ? hb + m * n : nullptr, n, cols, next());
    }
  });
  return y;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  return multiply<Plain>(x, w, n, BN, "batchgen gemv");
}

at::Tensor gemv_swiglu(const at::Tensor& x, const at::Tensor& w, int64_t n) {
  return multiply<SwiGLU>(x, w, n, SwiGLU::H, "batchgen gemv_swiglu");
}

at::Tensor gemv_add(const at::Tensor& x, const at::Tensor& w, int64_t n, const at::Tensor& h) {
  return multiply<Residual>(x, w, n, BN, "batchgen gemv_add", &h);
}

int64_t block_width() { return BN; }

TORCH_LIBRARY(batchgen_gemv, m) {
  m.def("gemv(Tensor x, Tensor w, int n) -> Tensor");
  m.def("gemv_swiglu(Tensor x, Tensor w, int n) -> Tensor");
  m.def("gemv_add(Tensor x, Tensor w, int n, Tensor h) -> Tensor");
  m.def("block_width() -> int", &block_width);  // no tensor to dispatch on: one kernel for every backend
}
TORCH_LIBRARY_IMPL(batchgen_gemv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_swiglu", &gemv_swiglu);
  m.impl("gemv_add", &gemv_add);
}
