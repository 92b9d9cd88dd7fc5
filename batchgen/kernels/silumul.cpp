// SwiGLU's gated activation on CPU in one pass: y = silu(gate) * up, gate_up = [gate | up] on the last dim.
//
// The eager step ran it as three ops (the chunk's views, silu, mul): two passes over the [T, 2I]
// activations and an [T, I] intermediate, about 6% of a 300-token prefill step in bf16 (2-core Zen 4).
// Here each element is read once and written once, rounded where ATen rounds (silu's result to the
// dtype, then the product to it), in float32 inside:
//
//   s = round(g / (1 + e^-g)),  y = round(s * u)
//
// e^x is batchgen's own (vec.h: a degree-6 polynomial after x = n ln2 + r, relative error ~2e-7, as in
// the attention kernel), so its bits are not ATen's Sleef exp's: the eager and the compiled step both
// call this op (the compiled step sees it as opaque), so a row's bits do not depend on which step it
// ran in. Each element depends on its own gate and up alone, whatever the rows, threads or step.
// Built on the machine that runs it (batchgen/kernels, -march=native).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using namespace batchgen_vec;  // VL, vec, splat, vexp, silu (vec.h)

// VL elements: gate g, up u (float32) -> y (the dtype), rounding as ATen's silu then mul do
template <typename T>
inline void gate(const T* g, const T* u, T* y) {
  alignas(64) float gf[VL], uf[VL], sf[VL];
  for (int i = 0; i < VL; ++i) gf[i] = static_cast<float>(g[i]), uf[i] = static_cast<float>(u[i]);
  vec gv, uv;
  std::memcpy(&gv, gf, sizeof gv);
  std::memcpy(&uv, uf, sizeof uv);
  const vec s = silu(gv);
  std::memcpy(sf, &s, sizeof s);
  for (int i = 0; i < VL; ++i) y[i] = static_cast<T>(static_cast<float>(static_cast<T>(sf[i])) * uf[i]);
}

#if defined(__AVX512BW__)
// bfloat16 -> float32 is exact (the bits moved up); float32 -> bfloat16 rounds as c10::BFloat16 does
// (to nearest even; NaN -> 0x7FC0), in integer ops, so the bits are those of the scalar path above
inline __m512 bf16_to_f32(__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); }
inline __m512i round_bf16(__m512 x) {  // the bf16 in each dword's low half
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// the same for 16 bfloat16 elements, the conversions in vector registers too (a 4,096 x 1,536
// activation on a 2-core Zen 4: 4.1 -> 3.6 ms; what is left is e^x and the division: a reciprocal
// with a Newton step instead was no faster, measured)
template <>
inline void gate<c10::BFloat16>(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* y) {
  const __m512 gv = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
  const __m512 uv = bf16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u)));
  const vec e = vexp(-(vec)gv);
  const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), (__m512)e));
  const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(sv), 16));  // s rounded to bf16, as float32
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(round_bf16(_mm512_mul_ps(sr, uv))));
}
#endif

template <typename T>
void rows(const T* x, T* y, int64_t n_rows, int64_t I) {
  at::parallel_for(0, n_rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* yr = y + r * I;
      int64_t i = 0;
      for (; i + VL <= I; i += VL) gate(g + i, u + i, yr + i);
      if (i < I) {  // the tail through the same code, on a zero-padded copy: the same bits as a full vector
        T gp[VL] = {}, up[VL] = {}, yp[VL];
        std::memcpy(gp, g + i, (I - i) * sizeof(T));
        std::memcpy(up, u + i, (I - i) * sizeof(T));
        gate(gp, up, yp);
        std::memcpy(yr + i, yp, (I - i) * sizeof(T));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "batchgen silu_mul: a CPU tensor only");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "batchgen silu_mul: the last dim must be even, got ",
              gate_up.sizes());
  const at::Tensor x = gate_up.contiguous();
  const int64_t I = x.size(-1) / 2, n_rows = I ? x.numel() / (2 * I) : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  at::Tensor y = at::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "batchgen_silu_mul", [&] {
    rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n_rows, I);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(batchgen_act, m) { m.def("silu_mul(Tensor gate_up) -> Tensor"); }
TORCH_LIBRARY_IMPL(batchgen_act, CPU, m) { m.impl("silu_mul", &silu_mul); }
