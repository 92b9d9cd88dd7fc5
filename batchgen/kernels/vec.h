// Float vectors of the machine's width, e^x and SiLU on them, shared by batchgen's C++ kernels (included
// by attention.cpp, silumul.cpp, gemv.cpp and sample.cpp, which keeps its own e^x; batchgen.kernels
// hashes this file into each includer's build key). Built with -march=native: VL is this machine's width.
#pragma once

#include <cstdint>
#include <cstring>

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
__attribute__((always_inline)) inline vec vexp(vec x) {
  const vec lo = splat(-87.f), hi = splat(88.f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  vec n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (n >= 0 ? splat(0.5f) : splat(-0.5f)), ivec), vec);
  vec r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  vec p = splat(1.f / 720);
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x <= lo ? splat(0.f) : p * scale;
}

// SiLU, g / (1 + e^-g), float32: the one formula of silumul.cpp and of gemv.cpp's SwiGLU tiles, so the
// fused matmul has the activation kernel's bits
inline vec silu(vec g) { return g / (splat(1.f) + vexp(-g)); }

}  // namespace batchgen_vec
