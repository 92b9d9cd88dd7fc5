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

#include <cstring>
#include <type_traits>

#include "vec.h"

template <typename T>
static inline T rot(T x, T c, T xo, T s) {
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(c));
  const T b = static_cast<T>(static_cast<float>(xo) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

// one head's D values: xr -> yr (cos c, signed sin s); bf16 runs VL lanes at a time through vec.h's
// conversions (c10's rounding), the same operations as rot's
template <typename T>
static inline void rope_head(const T* __restrict__ xr, const T* __restrict__ c, const T* __restrict__ s,
                             T* __restrict__ yr, int64_t d) {
  const int64_t h2 = d / 2;
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    using namespace batchgen_vec;
    for (; i + VL <= h2; i += VL) {
      const vec x1 = from_bf16(xr + i), x2 = from_bf16(xr + i + h2);
      const vec y1 = round_bf16(x1 * from_bf16(c + i)) + round_bf16(x2 * from_bf16(s + i));
      const vec y2 = round_bf16(x2 * from_bf16(c + i + h2)) + round_bf16(x1 * from_bf16(s + i + h2));
      store_bf16(yr + i, y1);
      store_bf16(yr + i + h2, y2);
    }
  }
  for (; i < h2; ++i) {
    yr[i] = rot(xr[i], c[i], xr[i + h2], s[i]);
    yr[i + h2] = rot(xr[i + h2], c[i + h2], xr[i], s[i + h2]);
  }
}

// x [T, H, D] (rows of D contiguous, any stride over T and H), cos and sin [T, D] (row stride sc);
// token t's head h goes to out(t, h)
template <typename T, typename Out>
static void rope_rows(const T* x, int64_t st, int64_t sh, const T* cos, const T* sin, int64_t sc, int64_t n,
                      int64_t heads, int64_t d, Out out) {
  at::parallel_for(0, n, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) rope_head(x + t * st + h * sh, cos + t * sc, sin + t * sc, out(t, h), d);
  });
}

static void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "batchgen rope: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.size(-1) % 2 == 0 && x.stride(-1) == 1,
              "batchgen rope: x must be [T, H, D] with D even and contiguous, got ", x.sizes());
  const int64_t n = x.size(0), d = x.size(2);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == n && cos.size(1) == 1 && cos.size(2) == d,
              "batchgen rope: cos and sin must be [", n, ", 1, ", d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
              "batchgen rope: x, cos and sin dtypes differ");
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_rope(x, cos, sin);
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor y = at::empty({n, heads, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "batchgen_rope", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), c.data_ptr<scalar_t>(),
                        s.data_ptr<scalar_t>(), d, n, heads, d,
                        [&](int64_t t, int64_t h) { return yp + (t * heads + h) * d; });
  });
  return y;
}

// A prompt chunk's RoPE and its K/V write in one pass: returns q rotated ([T, H, D], as `rope`), and
// writes k rotated and v into the paged cache, token t at slot offset[t] of block block_idx[t]. The
// caches are each layer's pool seen as [blocks, Hkv, block_size, D] (any strides, D contiguous: the
// NHD layout is passed transposed). The bits of `rope` on q and k, then the cache's index_put.
at::Tensor rope_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& block_idx,
                   const at::Tensor& offset) {
  check_rope(q, cos, sin);
  check_rope(k, cos, sin);
  const int64_t n = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  TORCH_CHECK(v.dim() == 3 && v.sizes() == k.sizes() && v.stride(-1) == 1 && v.scalar_type() == q.scalar_type(),
              "batchgen rope_kv: v must be k's shape and dtype, D contiguous");
  for (const at::Tensor* cache : {&k_cache, &v_cache})
    TORCH_CHECK(cache->device().is_cpu() && cache->dim() == 4 && cache->size(1) == kv_heads && cache->size(3) == d &&
                    cache->stride(3) == 1 && cache->scalar_type() == q.scalar_type() && cache->sizes() == k_cache.sizes(),
                "batchgen rope_kv: caches must be [blocks, ", kv_heads, ", block_size, ", d, "] of q's dtype, D contiguous");
  TORCH_CHECK(block_idx.scalar_type() == at::kLong && offset.scalar_type() == at::kLong && block_idx.numel() == n &&
                  offset.numel() == n, "batchgen rope_kv: block_idx and offset must be int64 [", n, "]");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), bi = block_idx.contiguous(), off = offset.contiguous();
  const int64_t* bp = bi.data_ptr<int64_t>();
  const int64_t* op = off.data_ptr<int64_t>();
  const int64_t nb = k_cache.size(0), bs = k_cache.size(2);
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(bp[t] >= 0 && bp[t] < nb && op[t] >= 0 && op[t] < bs, "batchgen rope_kv: token ", t, "'s slot (",
                bp[t], ", ", op[t], ") is outside the cache's ", nb, " blocks of ", bs);
  at::Tensor y = at::empty({n, heads, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "batchgen_rope_kv", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    const scalar_t* sp = s.data_ptr<scalar_t>();
    rope_rows<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), cp, sp, d, n, heads, d,
                        [&](int64_t t, int64_t h) { return yp + (t * heads + h) * d; });
    struct Pool { scalar_t* p; int64_t s0, s1, s2; };
    const Pool kc{k_cache.data_ptr<scalar_t>(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
    const Pool vc{v_cache.data_ptr<scalar_t>(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)};
    auto slot = [&](const Pool& c, int64_t t, int64_t h) { return c.p + bp[t] * c.s0 + h * c.s1 + op[t] * c.s2; };
    rope_rows<scalar_t>(k.data_ptr<scalar_t>(), k.stride(0), k.stride(1), cp, sp, d, n, kv_heads, d,
                        [&](int64_t t, int64_t h) { return slot(kc, t, h); });
    const scalar_t* vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < kv_heads; ++h)
          std::memcpy(slot(vc, t, h), vp + t * v.stride(0) + h * v.stride(1), d * sizeof(scalar_t));
    });
  });
  return y;
}

TORCH_LIBRARY(batchgen_rope, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor block_idx, Tensor offset) -> Tensor");
}
TORCH_LIBRARY_IMPL(batchgen_rope, CPU, m) {
  m.impl("rope", &rope);
  m.impl("rope_kv", &rope_kv);
}
