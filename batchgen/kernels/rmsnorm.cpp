// RMSNorm on CPU with each row's sum of squares added in one fixed order: batchgen's batch-invariant norm.
//
//   y = w * round_to_dtype(x * rsqrt(mean(x^2) + eps)), computed in float32 (as the HF reference does)
//
// A batch-invariant run's decode rows go through a compiled step in a decode-only step and through the
// eager one beside a prompt chunk. ATen's `mean` and Inductor's fused reduction add a row's squares in
// different orders, so the same row could come out of the norm in different bits in the two steps, and
// its greedy tokens then depended on its batch (measured in bf16). Here every row, whatever its batch,
// its neighbours or the threads, is summed the same way: 16 running sums, element i into sum i % 16, in
// order, then the 16 folded pairwise. Both the eager and the compiled step call this op (the compiled
// step sees it as opaque, as it sees the matmuls). Plain C++ the compiler vectorises (lane j of the sums
// is its own chain, so vectorising does not reorder anything); built on the machine that runs it
// (batchgen/kernels, -march=native).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "vec.h"

constexpr int64_t L = 16;  // running sums per row

template <typename T>
static void norm_rows(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t rows,
                      int64_t n, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* __restrict__ xr = x + r * n;
      T* __restrict__ yr = y + r * n;
      float acc[L] = {};
      int64_t i = 0;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the same sums, VL lanes at a time (vec.h)
        using namespace batchgen_vec;
        static_assert(L % VL == 0);
        vec a[L / VL] = {};
        for (; i + L <= n; i += L)
          for (int j = 0; j < L / VL; ++j) {
            const vec v = from_bf16(xr + i + j * VL);
            a[j] += v * v;
          }
        for (int j = 0; j < L / VL; ++j) std::memcpy(acc + j * VL, &a[j], sizeof a[j]);
      }
      for (; i + L <= n; i += L)
        for (int64_t j = 0; j < L; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          acc[j] += v * v;
        }
      for (int64_t j = 0; i + j < n; ++j) {
        const float v = static_cast<float>(xr[i + j]);
        acc[j] += v * v;
      }
      for (int64_t s = L / 2; s > 0; s /= 2)
        for (int64_t j = 0; j < s; ++j) acc[j] += acc[j + s];
      const float scale = 1.0f / std::sqrt(acc[0] / static_cast<float>(n) + eps);
      int64_t k = 0;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        using namespace batchgen_vec;
        for (; k + VL <= n; k += VL) store_bf16(yr + k, from_bf16(w + k) * round_bf16(from_bf16(xr + k) * scale));
      }
      for (; k < n; ++k)  // normalised, rounded to the dtype, then times the weight in it
        yr[k] = static_cast<T>(static_cast<float>(w[k]) *
                               static_cast<float>(static_cast<T>(static_cast<float>(xr[k]) * scale)));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "batchgen rms_norm: CPU tensors only");
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "batchgen rms_norm: weight [", x.size(-1), "] expected, got ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "batchgen rms_norm: x and weight dtypes differ (",
              x.scalar_type(), ", ", w.scalar_type(), ")");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n ? xc.numel() / n : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "batchgen_rms_norm", [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, n,
                        static_cast<float>(eps));
  });
  return y;
}

TORCH_LIBRARY(batchgen_rmsnorm, m) { m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor"); }
TORCH_LIBRARY_IMPL(batchgen_rmsnorm, CPU, m) { m.impl("rms_norm", &rms_norm); }
