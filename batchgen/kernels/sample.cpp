// Token choice for a batch of logits rows on CPU, in one call: batchgen's fused sampler.
//
// batchgen/engine/sampler.py draws each token as the inverse CDF of one uniform number from a
// counter hash of (seed, token index), over the smallest prefix of the sorted vocabulary reaching
// top_p (and at most top_k), using the top candidates of each row. In torch that is about 40 small
// ops per step. On CPU each one walks a 49k-entry row that the step's matmuls have just pushed out
// of cache, and each forks the thread pool. In the engine that took 0.8 ms of a 19 ms batch-1
// step, against 0.1 ms for argmax. Here one call does the same work, with two passes over each row:
//   1. the maximum of each block of 64 ids (the argmax, for a greedy row). The k-th largest of
//      those bounds the top-k candidates from below, so only the few blocks that reach it are read
//      again to rank the candidates;
//   2. the row's weights exp((l - max) / T), summed in blocks of 256 ids (float64 sums). These give
//      the softmax's denominator, and the temperature-only path's two-level inverse CDF.
// Then the candidates are sorted, and the token is drawn among the kept ones. The rule is the one
// in sampler.py. Rows are split over the threads. A row whose kept set would reach past the
// candidates (a flat distribution) is redone here over the entries a histogram of the row says the
// kept set can reach, where sampler.py flags it for its exact torch path (`exact`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "vec.h"

using batchgen_vec::ivec;  // the machine's float vectors (vec.h); this file's e^x is its own (below)
using batchgen_vec::load;
using batchgen_vec::splat;
using batchgen_vec::vec;
using batchgen_vec::VL;

constexpr int64_t BLOCK = 256;  // ids per block of the temperature-only inverse CDF (as sampler.py)
constexpr int64_t MBLOCK = 64;  // ids per block maximum, which bounds the candidates' search

// e^x for x <= 0, lane-wise: x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite), e^r by Cephes' expf
// polynomial, 2^n into the exponent bits. Below -87 (and -inf: a masked token) the result is 0.
static inline vec vexp(vec x) {
  const ivec dead = x < -87.0f;
  x = dead ? splat(-87.0f) : x;
  const vec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const vec r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vec y = p * r * r + r + 1.0f;
  const ivec bits = (ivec)y + (__builtin_convertvector(n, ivec) << 23);
  return dead ? splat(0.0f) : (vec)bits;
}

static float exp1(float x) {  // one lane of vexp, for the ids past the last full vector
  float a[VL] = {x};
  const vec y = vexp(load(a));
  return y[0];
}

// splitmix64 over (seed, counter): sampler.hash_uniform's number, bit for bit
static double hash_uniform(int64_t seed, int64_t counter) {
  uint64_t x = (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)counter * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return ((double)((x >> 40) & 0xFFFFFF) + 0.5) * (1.0 / (1 << 24));
}

static inline double below(double x, double total) {  // u x total can round up to it
  return std::min(x, std::nextafter(total, 0.0));
}

// a candidate: larger logit first, then lower id (the order a scan in id order keeps)
struct Cand {
  float v;
  int64_t i;
};
static inline bool before(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

struct Scratch {  // a thread's buffers, reused across its rows
  std::vector<Cand> cand;
  std::vector<double> sums;
  std::vector<float> bmax, floats;
  std::vector<int64_t> counts;
};

// the exact path's histogram: bins of 1/16 in the scaled logit below the row's maximum, the last
// one open-ended
constexpr int NBIN = 1024;
constexpr float BINS_PER_UNIT = 16.0f;
static inline int bin_of(float x, float inv_t, float ms) {
  const float d = (ms - x * inv_t) * BINS_PER_UNIT;  // >= 0; -inf (masked) and NaN land in the last bin
  return d < NBIN - 1 ? (int)d : NBIN - 1;
}

// every entry that a kept set reaching top_p (or holding top_k) can include, sorted best first: for
// rows whose kept set reaches past the k candidates (a flat distribution). A histogram of the row
// by scaled logit bounds each bin's mass from below (count x the bin's lowest weight); the bins from
// the top whose bounds reach top_p x z, and one more, hold the kept set, since the bin is monotone
// in the logit.
static void exact_candidates(const float* l, int64_t V, float inv_t, float ms, double z, float top_p,
                             int64_t top_k, Scratch& w) {
  w.counts.assign(NBIN, 0);
  for (int64_t i = 0; i < V; ++i) ++w.counts[bin_of(l[i], inv_t, ms)];
  const int64_t limit = top_k > 0 ? top_k : V;
  double lower = 0.0;
  int64_t n = 0;
  int b = 0;
  for (; b < NBIN - 1; ++b) {
    n += w.counts[b];
    lower += (double)w.counts[b] * std::exp(-(b + 1) / (double)BINS_PER_UNIT);
    if (n >= limit || lower >= (double)top_p * z) break;
  }
  const int last = std::min(b + 1, NBIN - 1);
  w.cand.clear();
  for (int64_t i = 0; i < V; ++i)
    if (bin_of(l[i], inv_t, ms) <= last) w.cand.push_back({l[i], i});
  std::sort(w.cand.begin(), w.cand.end(), before);
}

// the kept prefix of `cand` (sorted best first): each candidate while the mass before it is short
// of top_p, at most `limit` of them; then the inverse CDF of u over it. *reached: false where every
// candidate was kept and their mass is still short of top_p (the kept set may reach past them).
static int64_t draw(std::vector<Cand>& cand, int64_t limit, float inv_t, float ms, double z, float top_p,
                    double u, bool* reached) {
  double mass = 0.0, total = 0.0;
  int64_t kept = 0;
  for (; kept < limit; ++kept) {  // the first candidate always stays
    if (mass >= top_p) break;
    const double p = std::exp((double)(cand[kept].v * inv_t) - ms) / z;
    cand[kept].v = (float)p;  // the candidate's probability, from here on
    mass += p;
  }
  *reached = !(mass < top_p && kept == (int64_t)cand.size());
  for (int64_t j = 0; j < kept; ++j) total += cand[j].v;
  const double x = below(u * total, total);
  double c = 0.0;
  for (int64_t j = 0; j < kept; ++j) {
    c += cand[j].v;
    if (c > x) return cand[j].i;
  }
  return cand[kept - 1].i;
}

// the k largest of l[0, V), sorted best first. The k-th largest of the blocks' maxima is a lower
// bound for the k-th largest value (those maxima are k distinct entries), so only the blocks whose
// maximum reaches it are read again, and only their entries at or above it are ranked.
static void top_candidates(const float* l, int64_t V, int64_t k, const std::vector<float>& bmax,
                           std::vector<float>& scratch, std::vector<Cand>& cand) {
  const int64_t nb = (int64_t)bmax.size();
  float thr = -std::numeric_limits<float>::infinity();
  if (nb >= k) {
    scratch.assign(bmax.begin(), bmax.end());
    std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
    thr = scratch[k - 1];
  }
  cand.clear();
  for (int64_t b = 0; b < nb; ++b) {
    if (bmax[b] < thr) continue;
    const int64_t lo = b * MBLOCK, hi = std::min(V, lo + MBLOCK);
    for (int64_t i = lo; i < hi; ++i)
      if (l[i] >= thr) cand.push_back({l[i], i});
  }
  k = std::min<int64_t>(k, (int64_t)cand.size());
  std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), before);
  cand.resize(k);
}

// the row's token
static int64_t sample_row(const float* l, int64_t V, float temperature, float top_p, int64_t top_k, double u,
                          int64_t k, Scratch& w) {
  std::vector<double>& sums = w.sums;
  std::vector<float>& bmax = w.bmax;
  // pass 1: the maximum of each block of MBLOCK ids, and of the row
  const int64_t nmb = (V + MBLOCK - 1) / MBLOCK;
  bmax.resize(nmb);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nmb; ++b) {
    const int64_t lo = b * MBLOCK, hi = std::min(V, lo + MBLOCK);
    vec vm = splat(-std::numeric_limits<float>::infinity());
    int64_t i = lo;
    for (; i + VL <= hi; i += VL) {
      const vec x = load(l + i);
      vm = vm > x ? vm : x;
    }
    float bm = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < VL; ++j) bm = std::max(bm, vm[j]);
    for (; i < hi; ++i) bm = std::max(bm, l[i]);
    bmax[b] = bm;
    m = std::max(m, bm);
  }
  if (!(temperature > 0.0f) || !(m > -std::numeric_limits<float>::infinity())) {
    int64_t b = 0;  // greedy: the first id holding the maximum (a row with every token masked has
    while (b < nmb - 1 && bmax[b] != m) ++b;  // nothing to draw from, and gets its first id)
    int64_t a = b * MBLOCK;
    while (a < V - 1 && l[a] != m) ++a;
    return a;
  }
  const float inv_t = 1.0f / std::max(temperature, 1e-5f);
  const float ms = m * inv_t;  // the largest scaled logit: rounding is monotone, so the max maps to it
  const bool plain = top_p >= 1.0f && top_k <= 0;
  // pass 2: the weights exp(l / T - ms), summed per block of BLOCK ids
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  sums.assign(nb, 0.0);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    vec acc{};
    int64_t j = lo;
    for (; j + VL <= hi; j += VL) acc += vexp(load(l + j) * inv_t - ms);
    double s = 0.0;
    for (int q = 0; q < VL; ++q) s += acc[q];
    for (; j < hi; ++j) s += exp1(l[j] * inv_t - ms);
    sums[b] = s;
  }
  double z = 0.0;
  for (int64_t b = 0; b < nb; ++b) z += sums[b];
  if (plain) {  // temperature only: the inverse CDF over the whole vocabulary in id order, two levels
    double x = below(u * z, z), before_b = 0.0;
    int64_t b = 0;
    for (; b < nb - 1 && before_b + sums[b] <= x; ++b) before_b += sums[b];
    const int64_t lo = b * BLOCK, hi = std::min(V, lo + BLOCK);
    float w[BLOCK];
    for (int64_t j = lo; j < hi; ++j) w[j - lo] = exp1(l[j] * inv_t - ms);
    double inner = 0.0;
    for (int64_t j = lo; j < hi; ++j) inner += w[j - lo];
    x = below(x - before_b, inner);
    double c = 0.0;
    for (int64_t j = lo; j < hi; ++j) {
      c += w[j - lo];
      if (c > x) return j;
    }
    return hi - 1;
  }
  // top-k / top-p over the candidates, sorted best first
  top_candidates(l, V, k, bmax, w.floats, w.cand);
  const int64_t kc = (int64_t)w.cand.size();  // k, unless NaN logits fell out
  bool reached;
  const int64_t token = draw(w.cand, top_k > 0 ? std::min(top_k, kc) : kc, inv_t, ms, z, top_p, u, &reached);
  if (reached || k >= V || (top_k > 0 && top_k <= k)) return token;
  exact_candidates(l, V, inv_t, ms, z, top_p, top_k, w);  // the kept set reaches past the candidates
  const int64_t n = (int64_t)w.cand.size();
  return draw(w.cand, top_k > 0 ? std::min(top_k, n) : n, inv_t, ms, z, top_p, u, &reached);
}

// logits [R, V] float32; temperature, top_p [R] float32; top_k, seed, counter [R] int64; k: the
// candidates per row (sampler.Sampler.num_candidates). Returns the tokens [R] int64.
at::Tensor sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_p,
                  const at::Tensor& top_k, const at::Tensor& seed, const at::Tensor& counter, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "batchgen sample: logits [R, V] float32");
  const auto l = logits.contiguous();
  const int64_t R = l.size(0), V = l.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "batchgen sample: k must be in [1, V]");
  const auto t = temperature.to(at::kFloat).contiguous(), p = top_p.to(at::kFloat).contiguous();
  const auto tk = top_k.to(at::kLong).contiguous(), sd = seed.to(at::kLong).contiguous(),
             ct = counter.to(at::kLong).contiguous();
  for (const auto* x : {&t, &p, &tk, &sd, &ct}) TORCH_CHECK(x->numel() == R, "batchgen sample: one value per row");
  auto out = at::empty({R}, l.options().dtype(at::kLong));
  const float* lp = l.data_ptr<float>();
  const float *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>();
  const int64_t *kp = tk.data_ptr<int64_t>(), *sp = sd.data_ptr<int64_t>(), *cp = ct.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    Scratch w;
    for (int64_t r = r0; r < r1; ++r)
      op[r] = sample_row(lp + r * V, V, tp[r], pp[r], kp[r], hash_uniform(sp[r], cp[r]), k, w);
  });
  return out;
}

// Greedy rows: each row's argmax, as torch.argmax picks it (the first id of the largest value; a NaN
// counts as the largest, the first one wins), rows split over the threads. ATen's argmax over a
// [256, 49152] float32 batch took about 6% of a decode step: its
// reduction keeps an index beside every lane's value. Here a row is read twice from cache: its
// maximum (and whether it holds a NaN), then the first id that equals it.
static int64_t row_argmax(const float* x, int64_t n) {
  constexpr int64_t U = 4 * VL;
  vec m0 = splat(-std::numeric_limits<float>::infinity()), m1 = m0, m2 = m0, m3 = m0;
  ivec nan{};
  int64_t i = 0;
  for (; i + U <= n; i += U) {
    const vec a = load(x + i), b = load(x + i + VL), c = load(x + i + 2 * VL), d = load(x + i + 3 * VL);
    nan |= (a != a) | (b != b) | (c != c) | (d != d);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
    m2 = c > m2 ? c : m2;
    m3 = d > m3 ? d : m3;
  }
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  for (int j = 0; j < VL; ++j) {
    best = std::max({best, m0[j], m1[j], m2[j], m3[j]});
    any_nan |= nan[j] != 0;
  }
  for (int64_t k = i; k < n; ++k) {
    any_nan |= std::isnan(x[k]);
    best = x[k] > best ? x[k] : best;
  }
  for (int64_t k = 0; k < n; ++k)
    if (any_nan ? std::isnan(x[k]) : x[k] == best) return k;
  return 0;  // every value -inf
}

at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "batchgen argmax: float32 CPU logits [R, V] with V > 0 expected, got ", logits.sizes());
  const at::Tensor x = logits.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_argmax(xp + r * V, V);
  });
  return out;
}

TORCH_LIBRARY(batchgen_sample, m) {
  m.def("sample(Tensor logits, Tensor temperature, Tensor top_p, Tensor top_k, Tensor seed, Tensor counter, int k) -> Tensor");
  m.def("argmax(Tensor logits) -> Tensor");
}
TORCH_LIBRARY_IMPL(batchgen_sample, CPU, m) {
  m.impl("sample", &sample);
  m.impl("argmax", &argmax);
}
