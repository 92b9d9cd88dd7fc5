// Float vectors of the machine's width, e^x and SiLU on them, shared by batchgen's C++ kernels (included
// by attention.cpp, silumul.cpp, gemv.cpp, bgemm.cpp and sample.cpp, which keeps its own e^x;
// batchgen.kernels hashes this file into each includer's build key). Built with -march=native: VL is this machine's width.
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace batchgen_vec {

#if defined(__AVX512F__)
constexpr int VL = 16;  // floats per vector register
#elif defined(__AVX__)
constexpr int VL = 8;
#else
constexpr int VL = 4;
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(VL * sizeof(int32_t))));

inline vec load(const float* p) { vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }
inline vec splat(float x) { return vec{} + x; }

// e^x on a vector, float32: x = n ln2 + r (|r| <= ln2 / 2), e^r by its degree-6 Taylor polynomial
// (relative error ~2e-7, float32's own rounding), times 2^n set in the exponent bits. x below -87
// gives 0 (its true value is under float32's normal range), so a softmax weight never overflows.
// Written for any float vector V (and its int32 vector I): every operation is lane by lane, so a
// value's bits do not depend on the width; qgemv.cpp, built once per instruction set, runs it on its
// own vectors (where the caller's instructions have FMA, the compiler fuses p * r + c alike).
template <typename V, typename I>
__attribute__((always_inline)) inline V vexp_of(V x) {
  const V lo = V{} - 87.f, hi = V{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  V n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n >= 0 ? V{} + 0.5f : V{} - 0.5f), I), V);
  V r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  V p = V{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x <= lo ? V{} : p * scale;
}

__attribute__((always_inline)) inline vec vexp(vec x) { return vexp_of<vec, ivec>(x); }

// SiLU, g / (1 + e^-g), float32: the one formula of silumul.cpp, of gemv.cpp's and bgemm.cpp's SwiGLU
// tiles and of qgemv.cpp's, so a fused matmul has the activation kernel's bits
template <typename V, typename I>
__attribute__((always_inline)) inline V silu_of(V g) { return g / (V{} + 1.f + vexp_of<V, I>(-g)); }

inline vec silu(vec g) { return silu_of<vec, ivec>(g); }

// bfloat16 <-> float32 on VL values, as c10::BFloat16 converts (to nearest even; NaN -> 0x7FC0), so a
// kernel that rounds through them has the bits of ATen's ops that round through c10's
typedef uint16_t hvec __attribute__((vector_size(VL * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(VL * sizeof(uint32_t))));

#if defined(__AVX512F__)
// AVX-512: one widening move each way (GCC's generic conversions take the 256-bit halves apart)
inline vec from_bf16(const void* p) {
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vec>(u);
}
#else
inline vec from_bf16(const void* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const uvec u = __builtin_convertvector(h, uvec) << 16;
  vec v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
#endif

inline uvec bf16_bits(vec v) {  // the rounded value's 16 bits, in the low half of each lane
  uvec u;
  std::memcpy(&u, &v, sizeof u);
  const uvec r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uvec nan = uvec{} + 0x7FC0u;
  return (v != v) ? nan : r;
}

inline void store_bf16(void* p, vec v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(bf16_bits(v))));
#else
  const hvec h = __builtin_convertvector(bf16_bits(v), hvec);
  std::memcpy(p, &h, sizeof h);
#endif
}

inline vec round_bf16(vec v) {  // v rounded to bfloat16, as a float32
  const uvec u = bf16_bits(v) << 16;
  vec r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

}  // namespace batchgen_vec
