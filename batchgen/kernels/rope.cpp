// Rotary position embedding on CPU in one pass: batchgen's RoPE, rounded where PyTorch's ops round.
//
//   y = x * cos + rotate_half(x) * sin_signed,   rotate_half(x) = roll(x, D/2) = [x2, x1]
//
// as batchgen.model.llama.apply_rope computes it with four ATen ops (a roll, two products, a sum), each
// rounded to the dtype: here each product and the sum are rounded to the dtype at the same points, in
// float32 arithmetic without fused multiply-adds, so the result is the same bits as that function's
// eager ops, in one pass and no temporaries. The eager step and the compiled step both call it (an
// opaque op to Inductor), as they call batchgen's RMSNorm. Built on the machine that runs it
// (batchgen/kernels, -march=native).
#pragma GCC optimize("fp-contract=off")  // a * b + c must round the product first, as ATen's separate ops do

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

template <typename T>
static inline T rot(T x, T c, T xo, T s) {
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(c));
  const T b = static_cast<T>(static_cast<float>(xo) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

// x [T, H, D] (rows of D contiguous, any stride over T and H), cos and sin [T, D] (row stride sc)
template <typename T>
static void rope_rows(const T* x, int64_t st, int64_t sh, const T* cos, const T* sin, int64_t sc, T* y, int64_t n,
                      int64_t heads, int64_t d) {
  const int64_t h2 = d / 2;
  at::parallel_for(0, n, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* __restrict__ c = cos + t * sc;
      const T* __restrict__ s = sin + t * sc;
      for (int64_t h = 0; h < heads; ++h) {
        const T* __restrict__ xr = x + t * st + h * sh;
        T* __restrict__ yr = y + (t * heads + h) * d;
        for (int64_t i = 0; i < h2; ++i) yr[i] = rot(xr[i], c[i], xr[i + h2], s[i]);
        for (int64_t i = h2; i < d; ++i) yr[i] = rot(xr[i], c[i], xr[i - h2], s[i]);
      }
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "batchgen rope: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.size(-1) % 2 == 0 && x.stride(-1) == 1,
              "batchgen rope: x must be [T, H, D] with D even and contiguous, got ", x.sizes());
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == n && cos.size(1) == 1 && cos.size(2) == d,
              "batchgen rope: cos and sin must be [", n, ", 1, ", d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "batchgen rope: x, cos and sin dtypes differ");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty({n, heads, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "batchgen_rope", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                        s.data_ptr<scalar_t>(), d, y.data_ptr<scalar_t>(), n, heads, d);
  });
  return y;
}

TORCH_LIBRARY(batchgen_rope, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }
TORCH_LIBRARY_IMPL(batchgen_rope, CPU, m) { m.impl("rope", &rope); }
