// Paged attention on CPU: every query tile of a step against its own KV blocks, in one call a layer.
//
// The PyTorch path (batchgen.engine.attention) gathers each (query tile, key tile) pair's blocks into
// a new tensor, then runs a dozen small ops for the scores, masks and the split softmax: about 20
// kernels a layer, some 4 ms of a 12 ms batch-1 decode step of SmolLM2-135M on a 2-core Zen 4. Here a
// task is one (query tile, KV head): it walks its pairs' blocks in place, in position order, and for
// each query row (every query head of the group, every token of the tile) folds a block at a time
// into a running max, sum and output (flash-decoding's online softmax), in float32 whatever the
// cache's dtype; a token's query heads are folded side by side (their chains overlap: 1.3-1.6x at
// decode on a Zen 4). vLLM's CPU backend does the same with its own paged kernel.
//
// bfloat16 caches on a CPU with AVX512_BF16 take the pair path (attend_bdot, below): groups of 32
// positions, keys packed so that one `vdpbf16ps` scores a pair of dims for 16 keys, the weights rounded
// to bfloat16 before they multiply the values (as FlashAttention does). A prompt chunk's rows take a
// group in passes over all of them (scores, weights, values), so that one row's latency hides behind
// the others' work: a 4,096-token prefill step's attention 319 -> 250 ms on a 2-core Zen 4. A decode
// tile read its blocks a word a line ahead of its folds (batch-64 decode attention of SmolLM2-135M on
// prompts of 146-498 tokens, 45 -> 29 ms a step on a 2-core Zen 4); it now asks for its next group's
// lines from inside the loops that fold the one before (Ahead, as the AVX2 path): on a 2-core Xeon
// with AMX, 37.6 -> 31.1 ms a step at batch 64 and 141.7 -> 115.4 at 256, the same bits (the Zen 4 not
// measured again).
//
// On a CPU with AMX (Sapphire Rapids and later), the bf16 path's two products run on tiles instead, for
// every row (bdot::amx_scores, amx_values): a 4,096-token prefill step's attention (30 layers) 322.7 ->
// 136.5 ms on a 2-core Xeon (the same groups, packs and softmax). A decode tile's prefetches are spread
// through the tile loops and the merges: in one A/B, decode at batch 64 took 31.0 ms on tiles with the
// prefetches in two bursts, 28.5 spread, 31.0 on VDPBF16PS; at batch 256 118.8, 111.5 and 117.6.
//
// float32 caches on AVX2 and AVX-512 take the same keys-in-lanes plan in 8- or 16-float vectors
// (attend_keys_in_lanes): groups of 32 positions, keys transposed once per task and head, so a score is D
// multiply-adds in dim order with no horizontal sums, values read in place. On a 2-core Zen 3 a
// 4,096-token prefill step's attention went from 857-892 to 483-503 ms, a batch-64 decode step's from
// 66-69 to 56-59 ms (attention_op, 30 layers, alternated). On the 2-core Xeon (AVX-512), against the
// fold below: 4,096 tokens 455.8 -> 353.5 ms (1.29x), batch-64 decode 50.3 -> 53.1 (0.95x), batch 256
// 183.5 -> 189.4; prefill is most of a batch run, so it is kept. Float16 caches, and float32 of shapes
// it does not fit, take the fold; a decode tile there takes every KV head of its tile in one task and
// asks for the next block's lines from inside the folds (Ahead): float32 at batch 64 59.3 -> 49.7 ms.
//
// A query row's result depends only on its own query, position and keys: the blocks are visited in
// position order and each is folded in the same operations, whatever the tile the row sits in, the
// rows beside it, how the blocks are grouped into key tiles, or the threads. So a token's attention
// is the same at batch 1 or 64, in a decode step or a prompt chunk (batch invariance).
//
// Inputs are the step's plan (batchgen.engine.attention_metadata.TileGroup):
//   q [N, Qt, Hkv, G, D] the tiles' queries; k_cache, v_cache [blocks, Hkv, bs, D] ("HND");
//   q_pos [N, Qt] each query's position (a key is visible at positions <= it, and, with a sliding
//   window w, > q_pos - w); a position of 2^40 or more (attention_metadata.FAR) marks a padding row
//   of a part-filled tile: it is skipped and its output is 0, and it does not widen the tile's reach,
//   so a short prompt's tile reads only its own blocks;
//   pair_tile [P], pair_blocks [P, KT], pair_pos0 [P]: each pair's tile, its KT blocks and the
//   position of its first slot. Pairs of a tile are taken in their order in P.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstring>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace batchgen_vec;  // VL, vec, ivec, load, store, splat, vexp (vec.h)

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }

constexpr int64_t PAD_POS = int64_t(1) << 40;  // attention_metadata.FAR: a padding query row
constexpr int64_t MAX_BS = 256;  // block sizes the vector path holds scores for (larger: config allows 1024)

// Where a group's query tiles are in the step: tile n's token t is token tok[n * Qt + t] of q and out,
// both [T, Hkv, G, D]. A padding row (q_pos PAD_POS) is read from the token its index names (any) and,
// where write_pad is false, never written: the engine's op writes every group's rows into one output.
struct Tiles {
  int64_t N, Qt;
  const int64_t* tok;
  bool write_pad;
};

// [x0 + x1, x2 + x3, ..., y0 + y1, y2 + y3, ...]: neighbouring lanes of x, then of y, added
inline vec pairsum(vec x, vec y) {
#if defined(__AVX512F__)
  const ivec even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const ivec odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
#elif defined(__AVX__)
  const ivec even = {0, 2, 4, 6, 8, 10, 12, 14};
  const ivec odd = {1, 3, 5, 7, 9, 11, 13, 15};
#else
  const ivec even = {0, 2, 4, 6};
  const ivec odd = {1, 3, 5, 7};
#endif
  return __builtin_shuffle(x, y, even) + __builtin_shuffle(x, y, odd);
}

// VL vectors a[0..VL) -> one vector whose lane j is the sum of a[j]'s lanes, each by one fixed tree
// (neighbouring lanes first, then neighbouring pairs, ...): VL horizontal sums in VL - 1 pairsums,
// where a horizontal sum per vector took about as many operations. A lane's sum involves only its own vector.
inline vec lane_sums(vec* a) {
  for (int n = VL; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) a[i] = pairsum(a[2 * i], a[2 * i + 1]);
  return a[0];
}

// A decode tile's next key group, asked for (prefetch) a line or two at a time from inside the loops that
// fold this group (every path; the generic fold's group is the next block): the loads stream while the folds compute, where reading a whole group's lines before
// its fold (one burst, then the arithmetic) kept them apart. The runs are the group's K and V rows of
// each block, every head of the task. On a 2-core Zen 3 (attention alone, 30 layers, alternated, the
// same bits): batch-64 decode 63.9 -> 53.6 ms a step, batch 256 234.2 -> 190.1. The next group's lines
// asked for in one burst before each head's pack were slower (0.96-0.99x), and so were those two groups on.
// Spread as here, two groups on were slower too (batch 256 0.93x), into L2 (T1) level, and a task's
// first group asked for by the task before it level (measured; the figures are in git's docs/speed.md).
struct Ahead {
  static constexpr int KG = 32;  // positions a group (both paths)
  const char* run[2 * KG];  // at most KG blocks (block size 1), a K run and a V run each; or 2 a head
  int64_t len[2 * KG];
  int n = 0, r = 0;
  int64_t o = 0;  // bytes of run r asked for
  void add(const void* p, int64_t bytes) {
    if (n == 2 * KG) return;  // more runs than a group of blocks has: a hint, so left out
    run[n] = static_cast<const char*>(p);
    len[n++] = bytes;
  }
  // Into L2 on AVX-512 CPUs: an L1 prefetch holds one of the core's few line-fill buffers until its line
  // arrives, an L2 one does not, so more lines are in flight (faster decode attention on the Xeon, the
  // same bits, in an in-process A/B).
  // Into L1 on AVX2, as measured on the Zen 3 (not measured there again). __builtin_prefetch's
  // locality 3 is x86's T0, 2 its T1; other CPUs take their compiler's nearest.
#if defined(__AVX512F__)
  static constexpr int LOCALITY = 2;
#else
  static constexpr int LOCALITY = 3;
#endif
  __attribute__((always_inline)) inline void step(int lines = 1) {
    for (int i = 0; i < lines && r < n; ++i) {
      __builtin_prefetch(run[r] + o, 0, LOCALITY);
      if ((o += 64) >= len[r]) ++r, o = 0;
    }
  }
  void rest() {  // whatever the loops did not reach (a D or block size their calls do not cover)
    while (r < n) step(64);
  }
};

// R query rows (one token's query heads of a KV head, rows [R, NV * VL]) against one block's
// visible slots [lo, hi), the same for every row: fold them into each row's running max m, sum l and
// output acc [R, NV * VL]. k and v are the block's rows [bs, NV * VL], float32. The scores are taken
// VL keys at a time: each key's D products in VL lanes (NV vectors added in order), the lanes summed
// by lane_sums; a key's score depends on its own key and query alone (a missing key of a short group
// is a zero vector, which touches no other lane), whatever the group it falls in. Each row runs the
// same operations whatever R: the rows are folded side by side so that their dependency chains (the
// running max and sum, the output's multiply-adds) overlap, and a key's value is loaded once for all
// of them; a row's result does not depend on the rows beside it.
// A decode tile's next block is asked for through `ahead` (nullptr: none), two lines a key and row
// of the scores and a key of the values: the 128 lines of a 16 x 64 float32 block's K and V for 3 rows.
template <int NV, int R>
inline void fold(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, int64_t lo,
                 int64_t hi, float scale, float cap, float* __restrict__ m, float* __restrict__ l,
                 float* __restrict__ acc, Ahead* ahead) {
  constexpr int64_t D = NV * VL;
  alignas(64) float s[R][MAX_BS + VL];
  for (int r = 0; r < R; ++r) {
    vec qv[NV];
    for (int i = 0; i < NV; ++i) qv[i] = load(q + r * D + i * VL);
    for (int64_t j0 = lo - lo % VL; j0 < hi; j0 += VL) {
      const int64_t count = std::min<int64_t>(VL, hi - j0);
      vec a[VL];
      for (int64_t jj = 0; jj < VL; ++jj) {
        if (jj < count) {
          if (ahead) ahead->step(2);
          const float* kj = k + (j0 + jj) * D;
          vec t = qv[0] * load(kj);
          for (int i = 1; i < NV; ++i) t += qv[i] * load(kj + i * VL);
          a[jj] = t;
        } else {
          a[jj] = vec{};
        }
      }
      store(s[r] + j0, lane_sums(a) * scale);
    }
  }
  float mb[R], alpha[R], sum[R];
  for (int r = 0; r < R; ++r) mb[r] = -std::numeric_limits<float>::infinity(), sum[r] = 0.f;
  for (int64_t j = lo; j < hi; ++j)
    for (int r = 0; r < R; ++r) {
      if (cap > 0.f) s[r][j] = std::tanh(s[r][j] / cap) * cap;  // Gemma 2: scores squashed into (-cap, cap)
      mb[r] = std::max(mb[r], s[r][j]);
    }
  vec o[R][NV];
  for (int r = 0; r < R; ++r) {
    const float m_new = std::max(m[r], mb[r]);
    alpha[r] = std::exp(m[r] - m_new);  // 0 on the row's first block (m = -inf)
    m[r] = m_new;
    for (int64_t j = lo - lo % VL; j < hi; j += VL) store(s[r] + j, vexp(load(s[r] + j) - m_new));
    for (int i = 0; i < NV; ++i) o[r][i] = load(acc + r * D + i * VL) * alpha[r];
  }
  for (int64_t j = lo; j < hi; ++j) {
    const float* vj = v + j * D;
    if (ahead) ahead->step(2);
    vec vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load(vj + i * VL);
    for (int r = 0; r < R; ++r) {
      const float e = s[r][j];
      sum[r] += e;
      for (int i = 0; i < NV; ++i) o[r][i] += e * vv[i];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) store(acc + r * D + i * VL, o[r][i]);
    l[r] = l[r] * alpha[r] + sum[r];
  }
}

// the same for any D (not a multiple of the vector width, or too wide), scalar
inline void fold_any(const float* q, const float* k, const float* v, int64_t D, int64_t lo, int64_t hi, float scale,
                     float cap, float& m, float& l, float* acc) {
  std::vector<float> s(hi);
  float mb = -std::numeric_limits<float>::infinity();
  for (int64_t j = lo; j < hi; ++j) {
    float x = 0.f;
    for (int64_t d = 0; d < D; ++d) x += q[d] * k[j * D + d];
    x *= scale;
    if (cap > 0.f) x = std::tanh(x / cap) * cap;
    s[j] = x;
    mb = std::max(mb, x);
  }
  const float m_new = std::max(m, mb);
  const float alpha = std::exp(m - m_new);
  float sum = 0.f;
  for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  for (int64_t j = lo; j < hi; ++j) {
    const float e = std::exp(s[j] - m_new);
    sum += e;
    for (int64_t d = 0; d < D; ++d) acc[d] += e * v[j * D + d];
  }
  l = l * alpha + sum;
  m = m_new;
}

using Fold = void (*)(const float*, const float*, const float*, int64_t, int64_t, float, float, float*, float*, float*, Ahead*);
constexpr int MAX_R = 4;  // query rows folded side by side

template <int NV>
Fold fold_rows(int64_t R) {
  switch (R) {
    case 1: return &fold<NV, 1>;
    case 2: return &fold<NV, 2>;
    case 3: return &fold<NV, 3>;
    default: return &fold<NV, 4>;
  }
}

// the vector fold for R rows of width D, or nullptr (fold_any's scalar path)
Fold fold_for(int64_t D, int64_t bs, int64_t R) {
  if (bs > MAX_BS || D % VL) return nullptr;
  switch (D / VL) {
    case 1: return fold_rows<1>(R);
    case 2: return fold_rows<2>(R);
    case 4: return fold_rows<4>(R);
    case 8: return fold_rows<8>(R);
    case 16: return fold_rows<16>(R);
    case 32: return fold_rows<32>(R);
    default: return nullptr;
  }
}

// The blocks tile n reads, in position order, up to its last query's position `last`: (block, the
// position of its first slot). A tile's pairs are taken in their order in P (start, order: see attend).
inline void tile_blocks(int64_t n, const std::vector<int64_t>& start, const std::vector<int64_t>& order,
                        const int64_t* ppos0, const int64_t* pblocks, int64_t KT, int64_t bs, int64_t last,
                        int64_t num_blocks, std::vector<std::pair<int64_t, int64_t>>& out) {
  out.clear();
  for (int64_t i = start[n]; i < start[n + 1]; ++i) {
    const int64_t p = order[i];
    for (int64_t b = 0; b < KT; ++b) {
      const int64_t pos0 = ppos0[p] + b * bs;
      if (pos0 > last) break;  // this block and the rest of the pair are past every query
      const int64_t blk = pblocks[p * KT + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "pair_blocks out of range");
      out.emplace_back(blk, pos0);
    }
  }
}

// A tile's blocks, in position order, into visits (they must run on without a gap), up to its last
// real query's position: the position of the first block's first slot, and how many positions from
// there the tile may see (a key-group path walks them 32 at a time).
inline std::pair<int64_t, int64_t> tile_keys(int64_t n, int64_t Qt, const int64_t* qpos, const std::vector<int64_t>& start,
                                             const std::vector<int64_t>& order, const int64_t* ppos0,
                                             const int64_t* pblocks, int64_t KT, int64_t bs, int64_t num_blocks,
                                             std::vector<std::pair<int64_t, int64_t>>& visits) {
  int64_t last = std::numeric_limits<int64_t>::min();
  for (int64_t t = 0; t < Qt; ++t)
    if (qpos[n * Qt + t] < PAD_POS) last = std::max(last, qpos[n * Qt + t]);
  tile_blocks(n, start, order, ppos0, pblocks, KT, bs, last, num_blocks, visits);
  const int64_t first = visits.empty() ? 0 : visits[0].second;
  for (size_t i = 0; i < visits.size(); ++i)
    TORCH_CHECK(visits[i].second == first + int64_t(i) * bs, "paged attention: a tile's key tiles must run on without a gap");
  return {first, visits.empty() ? 0 : std::min<int64_t>(visits.size() * bs, last - first + 1)};
}

// The rows that see some of a group of nk positions from gpos: every query head g of each token t
// (positions q_pos[t], Qt of them) that sees one, as row base + t * G + g into act, with the slots it
// sees (causal, and inside a sliding window) as bits into mask. How many.
inline int64_t group_rows(const int64_t* q_pos, int64_t Qt, int64_t G, int64_t base, int64_t gpos, int64_t nk,
                          int64_t window, int64_t* act, uint32_t* mask) {
  int64_t na = 0;
  for (int64_t t = 0; t < Qt; ++t) {
    const int64_t qpos_t = q_pos[t];
    if (qpos_t >= PAD_POS || qpos_t < gpos) continue;
    const int64_t hi = std::min(nk, qpos_t - gpos + 1);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos_t - window + 1 - gpos) : 0;
    if (hi <= lo) continue;
    const uint32_t visible = uint32_t(((uint64_t(1) << hi) - 1) & ~((uint64_t(1) << lo) - 1));
    for (int64_t g = 0; g < G; ++g) act[na] = base + t * G + g, mask[na++] = visible;
  }
  return na;
}

constexpr int64_t AHEAD = 512;  // positions ahead of the fold whose blocks a task reads in advance

// Read a word of each 64-byte line of [k, k + bytes) and [v, v + bytes): the lines are on their way
// while the task folds the blocks before them. Measured on a Zen 4: prefetch instructions did not bring
// them in time, plain loads do (batch-64 decode attention, 42 -> 31 ms a step).
inline void read_ahead(const void* k, const void* v, int64_t bytes, int& sink) {
  for (int64_t byte = 0; byte < bytes; byte += 64) {
    sink += *reinterpret_cast<const volatile int*>(static_cast<const char*>(k) + byte);
    sink += *reinterpret_cast<const volatile int*>(static_cast<const char*>(v) + byte);
  }
}

// A key group of a task's tile (nk positions from slot k0 of its blocks, visits): the lines of every
// head of the task (KV heads h0 .. h0 + width) of the blocks up to slot `upto` read, those not read
// yet (fetched counts them); head h0's rows of the group's keys and values into krow and vrow.
template <typename T>
inline void group_keys(const std::vector<std::pair<int64_t, int64_t>>& visits, size_t& fetched, int64_t upto,
                       const T* kp, const T* vp, int64_t Hkv, int64_t h0, int64_t width, int64_t bs, int64_t D,
                       int64_t k0, int64_t nk, const T** krow, const T** vrow, int& sink) {
  const int64_t head = bs * D;  // elements from one KV head's rows of a block to the next head's
  for (; fetched < visits.size() && int64_t(fetched) * bs < upto; ++fetched) {
    const int64_t off = (visits[fetched].first * Hkv + h0) * head;
    read_ahead(kp + off, vp + off, width * head * int64_t(sizeof(T)), sink);
  }
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = k0 + j;
    const int64_t off = ((visits[slot / bs].first * Hkv + h0) * bs + slot % bs) * D;
    krow[j] = kp + off, vrow[j] = vp + off;
  }
}

// A task's query rows (tile n, KV heads h0 .. h0 + width): row hh * Qt * G + t * G + g is head h0 + hh,
// the tile's token t, query head g, at its query in q; and a fresh online softmax for them (acc 0, max -inf, sum 0).
template <typename T>
inline void start_task(const T* qp, const Tiles& tl, int64_t n, int64_t Hkv, int64_t G, int64_t D, int64_t h0,
                       int64_t width, std::vector<const T*>& rows, std::vector<float>& acc, std::vector<float>& m,
                       std::vector<float>& l) {
  const int64_t Qt = tl.Qt, QG = Qt * G;
  for (int64_t hh = 0; hh < width; ++hh)
    for (int64_t r = 0; r < QG; ++r) rows[hh * QG + r] = qp + ((tl.tok[n * Qt + r / G] * Hkv + h0 + hh) * G + r % G) * D;
  std::fill(acc.begin(), acc.end(), 0.f);
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  std::fill(l.begin(), l.end(), 0.f);
}

// The intra-op threads, each taking the next task as it finishes one: a step's tasks differ in cost
// (a long context's tile against a short one's), and a static split of the range left a thread
// waiting at the end (batch-64 decode attention 31.4-33.1 -> 29.6-30.7 ms, 2-core Zen 4). body(next)
// runs once on each thread, with its own state; next() is the next task, or -1. Which thread runs a
// task does not change its result.
template <typename Body>
void run_tasks(int64_t n, Body body) {
  std::atomic<int64_t> counter{0};
  auto next = [&] {
    const int64_t t = counter.fetch_add(1, std::memory_order_relaxed);
    return t < n ? t : int64_t(-1);
  };
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads())), 1,
                   [&](int64_t, int64_t) { body(next); });
}

#if defined(__x86_64__)
// The runs of a decode tile's key group from slot `next` of its blocks (visits) into `ahead`: every
// head of the task (KV heads h0 .. h0 + width), K and V
template <typename T>
inline void plan_ahead(Ahead& ahead, const std::vector<std::pair<int64_t, int64_t>>& visits, int64_t next, const T* kp,
                       const T* vp, int64_t Hkv, int64_t h0, int64_t width, int64_t bs, int64_t D) {
  const int64_t head = bs * D;  // elements from one KV head's rows of a block to the next head's
  if (bs <= Ahead::KG) {  // the group's whole blocks, every head of the task side by side
    for (int64_t b = next / bs; b < std::min<int64_t>(visits.size(), (next + Ahead::KG) / bs); ++b) {
      const int64_t off = (visits[b].first * Hkv + h0) * head;
      ahead.add(kp + off, width * head * int64_t(sizeof(T)));
      ahead.add(vp + off, width * head * int64_t(sizeof(T)));
    }
  } else {  // its KG rows of one block, a head at a time
    for (int64_t hh = 0; hh < width; ++hh) {
      const int64_t off = ((visits[next / bs].first * Hkv + h0 + hh) * bs + next % bs) * D;
      ahead.add(kp + off, Ahead::KG * D * int64_t(sizeof(T)));
      ahead.add(vp + off, Ahead::KG * D * int64_t(sizeof(T)));
    }
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// ---- bfloat16 caches on AVX512_BF16: the dot products in bf16 pairs, keys in lanes -------------------
//
// Each aligned group of 32 positions (from one block, or from consecutive blocks of 8 or 16 slots) is
// folded as one step of the online softmax. The group's keys are packed once per task (32 keys x D/2
// pairs, transposed so that a vector holds one pair of 16 keys), its values in pairs of keys (each d
// as one pair: key 2j's value, key 2j+1's). A query row's 32 scores are then D/2 `vdpbf16ps` into
// each of two vectors; its weights are rounded to bfloat16, as FlashAttention rounds P before its
// second matmul, and summed per lane (the lanes added once, at the end); the output takes 16
// pair-products per 16 dims. Every row runs the same operations whatever the rows beside it, the
// tile, the task's heads or the threads; a slot past the tile's last position is packed as zero and
// masked, so it is never read.
namespace bdot {

constexpr int64_t KG = 32;  // keys per group: two vectors of scores
constexpr int64_t LANES = 16;

// r[0..16) rows of 16 dwords -> r[i] = the i-th dword of every row (a 16 x 16 transpose)
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 -> their dwords 0, 1, 2, 3 of each 128-bit lane
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // lanes 0, 2 and lanes 1, 3 of row quads 0 and 1, then 2 and 3
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// one group's key rows k[j] and value rows v[j] (j < n; the rest packed as zero), plus `head` elements
// -> kp [D/2][32] (pair i of key j at kp[i * 32 + j]) and vp [16][D] (keys 2j, 2j+1 at d: vp[j * D + d])
inline void pack(const c10::BFloat16* const* k, const c10::BFloat16* const* v, int64_t head, int64_t D, int64_t n,
                 uint32_t* kp, uint32_t* vp, Ahead& ahead) {
  for (int64_t half = 0; half < KG / LANES; ++half)
    for (int64_t c = 0; c < D / 32; ++c) {
      ahead.step(8);
      __m512i r[16];
      for (int64_t j = 0; j < LANES; ++j) {
        const int64_t key = half * LANES + j;
        r[j] = key < n ? _mm512_loadu_si512(k[key] + head + c * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kp + (c * 16 + i) * KG + half * LANES, r[i]);
    }
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t j = 0; j < KG / 2; ++j)
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i a = 2 * j < n ? _mm512_loadu_si512(v[2 * j] + head + c * 32) : _mm512_setzero_si512();
      const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(v[2 * j + 1] + head + c * 32) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);  // d 0-3, 8-11, ... | 4-7, ...
      _mm512_storeu_si512(vp + j * D + c * 32, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_storeu_si512(vp + j * D + c * 32 + 16, _mm512_permutex2var_epi64(lo, second, hi));
    }
}

// A group is folded into a KV head's rows in three passes, each over all its rows (every token of the
// tile that sees the group, every query head of the KV head), so that a row's long dependency chains (its scores' 32-wide
// max, the exponentials, the weights' rounding) overlap other rows' work instead of waiting in line:
//   scores: R rows of one KV head (bf16 [D] at q[r]) against the packed keys -> s [R][32] (float32);
//   weigh:  each row's scaled, masked scores -> its new running max, alpha = e^(m_old - m_new), its
//           32 weights rounded to bf16 (pairs, p [16] dwords), and its per-lane sum l [16];
//   values: R rows' weights times the packed values, into acc (rescaled by alpha), CB vectors of 16
//           dims at a time.
// Every row runs the same operations whatever the rows beside it (R only shares loads), whether its
// group is taken in passes or, for a decode tile's few rows, in one fold of the same steps.
constexpr int MAX_RB = 6;  // rows a pass takes side by side

template <typename U>
U* aligned64(U* p) {  // the first 64-byte boundary at or after p (its buffer has 64 bytes to spare)
  return reinterpret_cast<U*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}  // rows a pass takes side by side

template <int R>
inline void scores(const c10::BFloat16* const* q, const uint32_t* kp, int64_t D, float* s, Ahead* ahead = nullptr) {
  __m512 s0[R], s1[R];  // keys 0-15 and 16-31
  for (int r = 0; r < R; ++r) s0[r] = _mm512_setzero_ps(), s1[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    if (ahead) ahead->step(2);
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + i * KG), k1 = (__m512bh)_mm512_loadu_si512(kp + i * KG + LANES);
    for (int r = 0; r < R; ++r) {
      const __m512bh qi = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const uint32_t*>(q[r])[i]);
      s0[r] = _mm512_dpbf16_ps(s0[r], qi, k0);
      s1[r] = _mm512_dpbf16_ps(s1[r], qi, k1);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_store_ps(s + r * KG, s0[r]), _mm512_store_ps(s + r * KG + LANES, s1[r]);
}

// one row's scores s [32] (scaled, squashed, masked in place) -> its new max in m, m_old - m_new in delta
inline void row_max(float* s, __mmask32 mask, float scale, float cap, float& m, float& delta) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  __m512 x0 = _mm512_mul_ps(_mm512_load_ps(s), sc), x1 = _mm512_mul_ps(_mm512_load_ps(s + LANES), sc);
  if (cap > 0.f) {  // Gemma 2: scores squashed into (-cap, cap)
    alignas(64) float t[KG];
    _mm512_store_ps(t, x0);
    _mm512_store_ps(t + LANES, x1);
    for (int j = 0; j < KG; ++j) t[j] = std::tanh(t[j] / cap) * cap;
    x0 = _mm512_load_ps(t);
    x1 = _mm512_load_ps(t + LANES);
  }
  x0 = _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(mask), x0);
  x1 = _mm512_mask_mov_ps(ninf, static_cast<__mmask16>(mask >> 16), x1);
  _mm512_store_ps(s, x0);
  _mm512_store_ps(s + LANES, x1);
  const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
  delta = m - m_new;  // -inf on the row's first group (m = -inf): alpha 0
  m = m_new;
}

// e^x for weights that are rounded to bf16 next (x = a score less its row's max, <= 0; -inf where
// masked): 2^n (scalef) times 2^f, f = x log2(e) - n in [-0.5, 0.5], by its degree-5 Taylor polynomial
// (relative error under 4e-6, against bf16's 2^-9 rounding); 0 at x <= -87, as vexp. Half of vexp's
// operations: the weights' exponentials were the largest share of prefill attention (perf).
inline __m512 exp_weight(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ), p, n);
}

// one row's masked scores s [32], max m, alpha -> weights p [16] (bf16 pairs), per-lane sum l [16]
inline void row_weights(const float* s, float m, float alpha, uint32_t* p, float* l) {
  const __m512 mv = _mm512_set1_ps(m);
  const __m512 e0 = exp_weight(_mm512_sub_ps(_mm512_load_ps(s), mv)), e1 = exp_weight(_mm512_sub_ps(_mm512_load_ps(s + LANES), mv));
  const __m512i pb = _mm512_castps_si512((__m512)_mm512_cvtne2ps_pbh(e1, e0));  // masked -> 0
  _mm512_store_si512(p, pb);
  const __m512i bits = _mm512_set1_epi32(0xffff0000);  // each pair's two weights, back to float32
  const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(pb, 16)), w_odd = _mm512_castsi512_ps(_mm512_and_si512(pb, bits));
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), _mm512_set1_ps(alpha), _mm512_add_ps(w_even, w_odd)));
}

template <int R, int CB>
inline void values(const uint32_t* p, const float* alpha, const uint32_t* vp, int64_t D, float* const* acc,
                   Ahead* ahead = nullptr) {
  for (int64_t c = 0; c < D; c += CB * LANES) {
    __m512 o[R][CB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) o[r][b] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c + b * LANES), _mm512_set1_ps(alpha[r]));
    for (int64_t j = 0; j < KG / 2; ++j) {
      if (ahead) ahead->step(2);
      __m512bh vv[CB];
      for (int b = 0; b < CB; ++b) vv[b] = (__m512bh)_mm512_loadu_si512(vp + j * D + c + b * LANES);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p[r * (KG / 2) + j]);
        for (int b = 0; b < CB; ++b) o[r][b] = _mm512_dpbf16_ps(o[r][b], w, vv[b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) _mm512_storeu_ps(acc[r] + c + b * LANES, o[r][b]);
  }
}

// the four steps for R rows (indices act[0..R) into q rows, m, l [16] and acc [D]) in one go: a decode
// tile's few rows, whose passes would otherwise cost more in loops than they overlap (measured)
template <int R, int CB>
inline void fold(const int64_t* act, const __mmask32* mask, const c10::BFloat16* const* rows, const uint32_t* kp,
                 const uint32_t* vp, int64_t D, float scale, float cap, float* m, float* l, float* acc, Ahead* ahead) {
  alignas(64) float s[R * KG], delta[LANES] = {}, alpha[LANES];
  alignas(64) uint32_t p[R * KG / 2];
  const c10::BFloat16* q[R];
  float* a[R];
  for (int r = 0; r < R; ++r) q[r] = rows[act[r]], a[r] = acc + act[r] * D;
  scores<R>(q, kp, D, s, ahead);
  for (int r = 0; r < R; ++r) row_max(s + r * KG, mask[r], scale, cap, m[act[r]], delta[r]);
  store(alpha, vexp(load(delta)));
  for (int r = 0; r < R; ++r) row_weights(s + r * KG, m[act[r]], alpha[r], p + r * (KG / 2), l + act[r] * LANES);
  values<R, CB>(p, alpha, vp, D, a, ahead);
}

using Scores = void (*)(const c10::BFloat16* const*, const uint32_t*, int64_t, float*, Ahead*);
using Values = void (*)(const uint32_t*, const float*, const uint32_t*, int64_t, float* const*, Ahead*);
constexpr Scores SCORES[] = {nullptr, &scores<1>, &scores<2>, &scores<3>, &scores<4>, &scores<5>, &scores<6>};
// [CB / 2 - 1][R]: D a multiple of 64 takes four vectors of output at a time, else two
constexpr Values VALUES[2][7] = {
    {nullptr, &values<1, 2>, &values<2, 2>, &values<3, 2>, &values<4, 2>, &values<5, 2>, &values<6, 2>},
    {nullptr, &values<1, 4>, &values<2, 4>, &values<3, 4>, &values<4, 4>, &values<5, 4>, &values<6, 4>}};
using Fold = void (*)(const int64_t*, const __mmask32*, const c10::BFloat16* const*, const uint32_t*, const uint32_t*,
                      int64_t, float, float, float*, float*, float*, Ahead*);
constexpr Fold FOLDS[2][7] = {
    {nullptr, &fold<1, 2>, &fold<2, 2>, &fold<3, 2>, &fold<4, 2>, &fold<5, 2>, &fold<6, 2>},
    {nullptr, &fold<1, 4>, &fold<2, 4>, &fold<3, 4>, &fold<4, 4>, &fold<5, 4>, &fold<6, 4>}};


#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// ---- AMX tiles (Sapphire Rapids and later): the same groups, the same pack, the two products on tiles ----
//
// A task's query rows are copied once into one buffer, so that 16 rows of a KV head are one tile (a
// group's active rows are consecutive rows of it: tokens in position order, then query heads). The
// scores of 16 rows x 16 keys are one float32 tile, D / 32 TDPBF16PS over the packed keys (pairs of
// dims in VNNI order: the pack above); the weights, rounded to bf16 as above, times the packed values
// (pairs of keys) are one TDPBF16PS per 16 dims into a fresh tile, then acc = acc * alpha + that, in
// one rounding. A row's result depends only on its own query, keys and values (a tile's rows do not
// meet), and every row, a decode tile's few or a prompt chunk's many, runs the same instructions; AMX
// does not round as VDPBF16PS does, so a machine takes one path for every row (`attention_isa`).
// Tiles: 0, 1 scores (keys 0-15, 16-31) or the values' output; 4 the queries or weights; 6, 7 keys or values.
inline bool amx_usable() {  // Linux hands a process the AMX state only when asked (XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return ok;
}

inline void amx_configure() {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } c;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  _tile_loadconfig(&c);
}

// 16 query rows (bf16, row stride ldq elements) against the packed keys kp [D/2][32] -> s [16][32]
inline void amx_scores(const c10::BFloat16* q, int64_t ldq, const uint32_t* kp, int64_t D, float* s, Ahead& ahead) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < D / 32; ++kb) {
    ahead.step(16);
    _tile_loadd(4, q + kb * 32, ldq * 2);
    _tile_loadd(6, kp + kb * 16 * KG, KG * 4);
    _tile_loadd(7, kp + kb * 16 * KG + LANES, KG * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, s, KG * 4);
  _tile_stored(1, s + LANES, KG * 4);
}

// 16 rows' weights p [16][16] (bf16 pairs) times the packed values vp [16][D] -> pv [16][D]
inline void amx_values(const uint32_t* p, const uint32_t* vp, int64_t D, float* pv, Ahead& ahead) {
  _tile_loadd(4, p, 64);
  for (int64_t c = 0; c < D; c += LANES) {
    ahead.step(16);
    _tile_zero(0);
    _tile_loadd(6, vp + c, D * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, pv + c, D * 4);
  }
}

// a row's output: acc = acc * alpha + pv
inline void amx_merge(float* acc, float alpha, const float* pv, int64_t D) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < D; d += LANES) _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), a, _mm512_loadu_ps(pv + d)));
}
#endif
}  // namespace bdot

// the bf16-pair path applies: bfloat16, groups of 32 positions made of whole blocks or within one
// block, D a multiple of 32 (a plan's key tiles must then span whole groups: checked per call)
inline bool bdot_fits(int64_t bs, int64_t D) { return (bs % bdot::KG == 0 || bdot::KG % bs == 0) && D % 32 == 0 && D <= 512; }

void attend_bdot(const at::Tensor& q, const Tiles& tl, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_pos,
                 const at::Tensor& pair_tile, const at::Tensor& pair_blocks, const at::Tensor& pair_pos0,
                 const std::vector<int64_t>& start, const std::vector<int64_t>& order, double scale, int64_t window,
                 double softcap, at::Tensor& out, bool use_amx) {
  using T = c10::BFloat16;
  constexpr int64_t KG = bdot::KG, LANES = bdot::LANES;
  const int64_t N = tl.N, Qt = tl.Qt, Hkv = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = k_cache.size(2), KT = pair_blocks.size(1), QG = Qt * G, num_blocks = k_cache.size(0);
  TORCH_CHECK((KT * bs) % KG == 0, "paged attention: key tiles of ", KT, " blocks of ", bs,
              " slots do not span whole groups of ", KG, " positions");
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* qpos = q_pos.data_ptr<int64_t>();
  const int64_t* pblocks = pair_blocks.data_ptr<int64_t>();
  const int64_t* ppos0 = pair_pos0.data_ptr<int64_t>();
  for (int64_t p = 0; p < pair_pos0.size(0); ++p)
    TORCH_CHECK(ppos0[p] % KG == 0, "paged attention: a key tile starts at position ", ppos0[p], ", not a multiple of ", KG);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // A task is a tile and one KV head; or, for one-token tiles where there are tiles enough for the
  // threads, a tile with all its KV heads (a block's heads lie side by side: one stream of memory).
  const int64_t split = Qt == 1 && N >= 4 * at::get_num_threads() ? 1 : Hkv, width = Hkv / split;
  const int64_t head = bs * D;  // elements from one KV head's rows of a block to the next head's
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  const bool amx = use_amx && bdot::amx_usable();
#else
  const bool amx = false;
#endif
  run_tasks(N * split, [&](auto next) {
    const int64_t rows_n = width * QG, packed = KG * D / 2;
    std::vector<float> acc(rows_n * D), m(rows_n), l(rows_n * LANES);
    std::vector<uint32_t> kpack(packed), vpack(packed);
    std::vector<const T*> rows(rows_n), krow(KG), vrow(KG), qrun(bdot::MAX_RB);
    // the group's active rows: their index, mask, scores, max change, alpha (padded for vector exps) and weights
    std::vector<int64_t> act(rows_n);
    std::vector<uint32_t> amask(rows_n);  // a __mmask32 each
    std::vector<float> sc_buf((rows_n + 16) * KG + LANES), delta(rows_n + LANES), alpha_buf(rows_n + 2 * LANES);
    std::vector<uint32_t> wts_buf((rows_n + 16) * KG / 2 + LANES);  // 16 spare rows: a tile reads 16
    float* const sc = bdot::aligned64(sc_buf.data());  // the passes' vectors, on whole lines
    float* const alpha = bdot::aligned64(alpha_buf.data());
    uint32_t* const wts = bdot::aligned64(wts_buf.data());
    std::vector<float*> arun(bdot::MAX_RB);
    std::vector<std::pair<int64_t, int64_t>> visits;  // the blocks the tile reads, in position order
    int sink = 0;  // the read-ahead words, unused
    const int cb = D % 64 == 0;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    // the AMX route's buffers: the task's query rows (16 spare), the values' tile output
    std::vector<T> qbuf(amx ? (rows_n + 16) * D : 0), qstage(amx ? (rows_n + 16) * D : 0);
    std::vector<float> pv(amx ? 16 * D : 0);
    if (amx) bdot::amx_configure();
#endif
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t n = task / split, h0 = task % split * width;
      start_task(qp, tl, n, Hkv, G, D, h0, width, rows, acc, m, l);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
      if (amx)
        for (int64_t r = 0; r < rows_n; ++r) std::memcpy(qbuf.data() + r * D, rows[r], D * sizeof(T));
#endif
      const auto [first, nkeys] = tile_keys(n, Qt, qpos, start, order, ppos0, pblocks, KT, bs, num_blocks, visits);
      // A prompt chunk reads its blocks AHEAD positions before their fold. A decode tile reads its first
      // group so, then asks for each next group's lines from inside the loops that fold the one before
      // (Ahead, as the AVX2 path below).
      size_t fetched = 0;  // visits whose lines have been read ahead
      for (int64_t k0 = 0; k0 < nkeys; k0 += KG) {
        const int64_t gpos = first + k0, nk = std::min(KG, nkeys - k0);
        if (Qt == 1 && k0 > 0) fetched = visits.size();  // asked for while the group before was folded
        group_keys(visits, fetched, k0 + KG + (Qt == 1 ? 0 : AHEAD), kp, vp, Hkv, h0, width, bs, D, k0, nk, krow.data(),
                   vrow.data(), sink);
        Ahead ahead;
        if (Qt == 1 && k0 + KG < nkeys) plan_ahead(ahead, visits, k0 + KG, kp, vp, Hkv, h0, width, bs, D);
        for (int64_t hh = 0; hh < width; ++hh) {  // a head at a time: its pack, then its rows' passes
          bdot::pack(krow.data(), vrow.data(), hh * head, D, nk, kpack.data(), vpack.data(), ahead);
          const int64_t na = group_rows(qpos + n * Qt, Qt, G, hh * QG, gpos, nk, window, act.data(), amask.data());
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
          if (amx) {
            if (!na) continue;
            const T* qa = qbuf.data() + act[0] * D;  // the rows, consecutive (else gathered: the same values)
            if (act[na - 1] - act[0] != na - 1) {
              for (int64_t i = 0; i < na; ++i) std::memcpy(qstage.data() + i * D, qbuf.data() + act[i] * D, D * sizeof(T));
              qa = qstage.data();
            }
            for (int64_t i = 0; i < na; i += 16) bdot::amx_scores(qa + i * D, D, kpack.data(), D, sc + i * KG, ahead);
            for (int64_t i = 0; i < na; ++i) bdot::row_max(sc + i * KG, amask[i], fscale, cap, m[act[i]], delta[i]);
            for (int64_t i = 0; i < na; i += LANES) store(alpha + i, vexp(load(delta.data() + i)));
            for (int64_t i = 0; i < na; ++i)
              bdot::row_weights(sc + i * KG, m[act[i]], alpha[i], wts + i * (KG / 2), &l[act[i] * LANES]);
            for (int64_t i = 0; i < na; i += 16) {
              bdot::amx_values(wts + i * (KG / 2), vpack.data(), D, pv.data(), ahead);
              for (int64_t r = 0; r < std::min<int64_t>(16, na - i); ++r) {
                ahead.step(8);
                bdot::amx_merge(acc.data() + act[i + r] * D, alpha[i + r], pv.data() + r * D, D);
              }
            }
            continue;
          }
#endif
          if (na <= bdot::MAX_RB) {  // a decode tile's rows: one fold
            if (na)
              bdot::FOLDS[cb][na](act.data(), amask.data(), rows.data(), kpack.data(), vpack.data(), D, fscale, cap, m.data(),
                                  l.data(), acc.data(), &ahead);
            continue;
          }
          for (int64_t i = 0; i < na; i += bdot::MAX_RB) {
            const int64_t R = std::min<int64_t>(bdot::MAX_RB, na - i);
            for (int64_t r = 0; r < R; ++r) qrun[r] = rows[act[i + r]];
            bdot::SCORES[R](qrun.data(), kpack.data(), D, sc + i * KG, nullptr);
          }
          for (int64_t i = 0; i < na; ++i) bdot::row_max(sc + i * KG, amask[i], fscale, cap, m[act[i]], delta[i]);
          for (int64_t i = 0; i < na; i += LANES) store(alpha + i, vexp(load(delta.data() + i)));
          for (int64_t i = 0; i < na; ++i)
            bdot::row_weights(sc + i * KG, m[act[i]], alpha[i], wts + i * (KG / 2), &l[act[i] * LANES]);
          for (int64_t i = 0; i < na; i += bdot::MAX_RB) {
            const int64_t R = std::min<int64_t>(bdot::MAX_RB, na - i);
            for (int64_t r = 0; r < R; ++r) arun[r] = acc.data() + act[i + r] * D;
            bdot::VALUES[cb][R](wts + i * (KG / 2), alpha + i, vpack.data(), D, arun.data(), nullptr);
          }
        }
        ahead.rest();
      }
      for (int64_t r = 0; r < width * QG; ++r) {
        if (!tl.write_pad && qpos[n * Qt + r % QG / G] >= PAD_POS) continue;
        const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(&l[r * LANES]));
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        T* dst = op + (rows[r] - qp);  // the output sits where the row's query does
        for (int64_t d = 0; d < D; d += LANES) {  // rounded to nearest even, as c10::BFloat16 rounds
          const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(&acc[r * D + d]), _mm512_set1_ps(inv)));
          std::memcpy(dst + d, &h, sizeof h);
        }
      }
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) _tile_release();
#endif
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// ---- float32 caches on AVX2 and AVX-512: keys in lanes -------------------------------------------------
//
// The fold above sums each key's D products across a vector's lanes; a prompt chunk's row (every token
// of a 64-token tile, every query head) then reads each key again, and the output's accumulators (R rows
// of D / 8 vectors) outgrow AVX2's 16 registers. Here, as in the bf16 pair path, each aligned group of
// 32 positions is one step of the online softmax: the group's keys are packed once per task and KV
// head, transposed (dim i of key j at kp[i * 32 + j]), so a query row's 32 scores are D multiply-adds
// into four vectors (two on AVX-512), with no horizontal sums; the values are read in place, a key at a
// time, 8 or 16 dims to a vector. The AVX2 code is the intrinsics it was measured with; AVX-512 takes
// vec.h's vectors in the same operations (the AVX2 build of both gives the same bits and speed). A group is folded into a KV head's rows in three passes, each over all its rows (scores;
// max, exponentials, per-lane sums; values), so that one row's dependency chains overlap the others'.
// A decode tile's few rows take the same steps in one go (fold). Every row runs the same operations
// whatever the rows beside it (R only shares loads), the tile, the task's heads or the threads; a slot
// past the tile's last position is packed as zero and masked, and its value is never read.
namespace keys_in_lanes {

constexpr int64_t KG = 32;  // keys per group: four vectors of scores (AVX2), two (AVX-512)
constexpr int64_t W = VL;   // floats a vector
constexpr int64_t NG = KG / W;  // vectors of a row's group scores
constexpr int MAX_RB = 6;   // rows a pass takes side by side
constexpr int CB = W == 8 ? 2 : 4;  // vectors of dims a values pass keeps per row (16 dims on AVX2, 64 on AVX-512)
// lines of the next group a decode tile asks for (Ahead) at each 8 x 8 block of the pack, dim of the
// scores and key of the values. AVX-512 at AVX2's 2, 1, 1: batch-64 decode attention 0.85x of 2, 2, 2
constexpr int S_PACK = 2, S_SC = W == 8 ? 1 : 2, S_VAL = W == 8 ? 1 : 2;
template <int R>
constexpr int NK = NG < (R <= 3 ? 4 : 2) ? NG : (R <= 3 ? 4 : 2);  // score vectors a pass of R rows keeps

// the sum of W lanes t[0..W), neighbours first (the same tree at any width)
template <int N>
__attribute__((always_inline)) inline float lane_total(const float* t) {
  if constexpr (N == 1) {
    return t[0];
  } else {
    return lane_total<N / 2>(t) + lane_total<N / 2>(t + N / 2);
  }
}


// one group's key rows k[j] + head (j < n; the rest zero, read from `zeros`) -> kp [D][32], transposed
// 8 x 8 at a time (the 128-bit halves' swap done by the loads)
inline void pack_keys(const float* const* k, int64_t head, int64_t D, int64_t n, const float* zeros, float* kp,
                      Ahead& ahead) {
  constexpr int64_t E = 8;  // floats of a 256-bit vector: the transpose is 8 x 8 on either instruction set
  for (int64_t g = 0; g < KG / E; ++g) {
    const float* row[E];
    for (int64_t j = 0; j < E; ++j) row[j] = g * E + j < n ? k[g * E + j] + head : zeros;
    for (int64_t c = 0; c < D; c += E) {
      ahead.step(S_PACK);
      __m256 t[8];  // t[j], t[4 + j]: dims c..c+3, c+4..c+7 of keys j (low half) and j + 4 (high half)
      for (int j = 0; j < 4; ++j) {
        t[j] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(row[j] + c)), _mm_loadu_ps(row[j + 4] + c), 1);
        t[4 + j] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(row[j] + c + 4)),
                                        _mm_loadu_ps(row[j + 4] + c + 4), 1);
      }
      for (int h = 0; h < 2; ++h) {  // a 4 x 4 transpose in each half
        const __m256* u = t + 4 * h;
        const __m256 a = _mm256_unpacklo_ps(u[0], u[1]), b = _mm256_unpackhi_ps(u[0], u[1]);
        const __m256 x = _mm256_unpacklo_ps(u[2], u[3]), y = _mm256_unpackhi_ps(u[2], u[3]);
        float* o = kp + (c + 4 * h) * KG + g * E;
        _mm256_storeu_ps(o, _mm256_shuffle_ps(a, x, 0x44));
        _mm256_storeu_ps(o + KG, _mm256_shuffle_ps(a, x, 0xee));
        _mm256_storeu_ps(o + 2 * KG, _mm256_shuffle_ps(b, y, 0x44));
        _mm256_storeu_ps(o + 3 * KG, _mm256_shuffle_ps(b, y, 0xee));
      }
    }
  }
}

// scores: R rows q[r] [D] against the packed keys -> s [R][32], NK vectors of keys a pass; each score is
// one chain of D multiply-adds in dim order, whatever R and NK; a line of `ahead` asked for a dim
template <int R, int NK>
inline void scores(const float* const* q, const float* kp, int64_t D, float* s, Ahead* ahead = nullptr) {
#if defined(__AVX512F__)
  for (int64_t h = 0; h < KG; h += NK * W) {
    vec a[R][NK];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NK; ++b) a[r][b] = vec{};
    for (int64_t i = 0; i < D; ++i) {
      if (ahead) ahead->step(S_SC);
      vec kv[NK];
      for (int b = 0; b < NK; ++b) kv[b] = load(kp + i * KG + h + b * W);
      for (int r = 0; r < R; ++r) {
        const vec qi = splat(q[r][i]);
        for (int b = 0; b < NK; ++b) a[r][b] += qi * kv[b];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NK; ++b) store(s + r * KG + h + b * W, a[r][b]);
  }
#else
  for (int64_t h = 0; h < KG; h += NK * W) {
    __m256 a[R][NK];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NK; ++b) a[r][b] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; ++i) {
      if (ahead) ahead->step();
      __m256 kv[NK];
      for (int b = 0; b < NK; ++b) kv[b] = _mm256_loadu_ps(kp + i * KG + h + b * W);
      for (int r = 0; r < R; ++r) {
        const __m256 qi = _mm256_broadcast_ss(q[r] + i);
        for (int b = 0; b < NK; ++b) a[r][b] = _mm256_fmadd_ps(qi, kv[b], a[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NK; ++b) _mm256_storeu_ps(s + r * KG + h + b * W, a[r][b]);
  }
#endif
}

// one row's scores s [32] (scaled, squashed, masked in place: bit j of `mask` keeps key j) -> its new
// max in m, m_old - m_new in delta. This and row_weights are inlined into the passes' loops, and the
// lanes' max is a shuffle tree, not a loop through memory, so one row's chains overlap the next row's:
// a 4,096-token prefill step's attention 2.6-4.3% faster, decode 1.9-2.3% (Zen 3, in-process A/B, same bits)
__attribute__((always_inline)) inline void row_max(float* s, uint32_t mask, float scale, float cap, float& m, float& delta) {
#if defined(__AVX512F__)
  const vec ninf = splat(-std::numeric_limits<float>::infinity());
  ivec bit;
  for (int j = 0; j < W; ++j) bit[j] = 1 << j;
  if (cap > 0.f)  // Gemma 2: scores squashed into (-cap, cap)
    for (int64_t j = 0; j < KG; ++j) s[j] = std::tanh(s[j] * scale / cap) * cap;
  vec mx = ninf;
  for (int64_t b = 0; b < NG; ++b) {
    vec x = load(s + b * W);
    if (!(cap > 0.f)) x = x * scale;
    const ivec sel = (ivec{} + int(mask >> (b * W))) & bit;
    x = sel == bit ? x : ninf;
    store(s + b * W, x);
    mx = mx > x ? mx : x;  // vmaxps
  }
  const float best = std::max(m, _mm512_reduce_max_ps(reinterpret_cast<__m512>(mx)));
#else
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm256_set1_ps(scale);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  if (cap > 0.f)  // Gemma 2: scores squashed into (-cap, cap)
    for (int64_t j = 0; j < KG; ++j) s[j] = std::tanh(s[j] * scale / cap) * cap;
  __m256 mx = ninf;
  for (int64_t b = 0; b < KG / W; ++b) {
    __m256 x = _mm256_loadu_ps(s + b * W);
    if (!(cap > 0.f)) x = _mm256_mul_ps(x, sc);
    const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(int(mask >> (b * W))), bit);
    x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, bit)));
    _mm256_storeu_ps(s + b * W, x);
    mx = _mm256_max_ps(mx, x);
  }
  __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
  h4 = _mm_max_ss(h4, _mm_movehdup_ps(h4));
  const float best = std::max(m, _mm_cvtss_f32(h4));
#endif
  delta = m - best;  // -inf on the row's first group (m = -inf): alpha 0
  m = best;
}

// one row's masked scores s [32], max m, alpha -> its weights p [32] (in place of s), per-lane sum l [8]
__attribute__((always_inline)) inline void row_weights(float* s, float m, float alpha, float* l) {
  const vec mv = splat(m);
  vec e[NG];
  for (int64_t b = 0; b < NG; ++b) store(s + b * W, e[b] = vexp(load(s + b * W) - mv));  // masked -> 0
  vec sum;
  if constexpr (NG == 4) {
    sum = (e[0] + e[1]) + (e[2] + e[3]);
  } else {
    sum = e[0] + e[1];
  }
  store(l, load(l) * alpha + sum);
}

// values: R rows' weights p [R][32] times the group's value rows v[j] + head (j < n), into acc[r]
// rescaled by alpha[r], CB vectors of dims at a time; a line of `ahead` asked for a key
template <int R, int CB>
inline void values(const float* p, const float* alpha, const float* const* v, int64_t head, int64_t n, int64_t D,
                   float* const* acc, Ahead* ahead = nullptr) {
#if defined(__AVX512F__)
  for (int64_t c = 0; c < D; c += CB * W) {
    vec o[R][CB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) o[r][b] = load(acc[r] + c + b * W) * alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      if (ahead) ahead->step(S_VAL);
      vec vv[CB];
      for (int b = 0; b < CB; ++b) vv[b] = load(v[j] + head + c + b * W);
      for (int r = 0; r < R; ++r) {
        const vec w = splat(p[r * KG + j]);
        for (int b = 0; b < CB; ++b) o[r][b] += w * vv[b];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) store(acc[r] + c + b * W, o[r][b]);
  }
#else
  for (int64_t c = 0; c < D; c += CB * W) {
    __m256 o[R][CB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) o[r][b] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + c + b * W), _mm256_set1_ps(alpha[r]));
    for (int64_t j = 0; j < n; ++j) {
      if (ahead) ahead->step();
      __m256 vv[CB];
      for (int b = 0; b < CB; ++b) vv[b] = _mm256_loadu_ps(v[j] + head + c + b * W);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * KG + j);
        for (int b = 0; b < CB; ++b) o[r][b] = _mm256_fmadd_ps(w, vv[b], o[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < CB; ++b) _mm256_storeu_ps(acc[r] + c + b * W, o[r][b]);
  }
#endif
}

// R (1 to MAX_RB) as a compile-time constant for f
template <typename F>
inline void with_rows(int64_t R, F&& f) {
  switch (R) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// the steps for R rows (indices act[0..R) into q rows, m, l [8] and acc [D]) in one go: a decode tile's
// few rows, whose passes would otherwise cost more in loops than they overlap
template <int R>
inline void fold(const int64_t* act, const uint32_t* mask, const float* const* rows, const float* kp,
                 const float* const* v, int64_t head, int64_t n, int64_t D, float scale, float cap, float* m, float* l,
                 float* acc, Ahead& ahead) {
  alignas(64) float s[R * KG], delta[W] = {}, alpha[W];
  const float* q[R];
  float* a[R];
  for (int r = 0; r < R; ++r) q[r] = rows[act[r]], a[r] = acc + act[r] * D;
  scores<R, NK<R>>(q, kp, D, s, &ahead);
  for (int r = 0; r < R; ++r) row_max(s + r * KG, mask[r], scale, cap, m[act[r]], delta[r]);
  store(alpha, vexp(load(delta)));
  for (int r = 0; r < R; ++r) row_weights(s + r * KG, m[act[r]], alpha[r], l + act[r] * W);
  values<R, CB>(s, alpha, v, head, n, D, a, &ahead);
}

}  // namespace keys_in_lanes

// the keys-in-lanes path applies: groups of 32 positions made of whole blocks or within one block, key
// tiles that span whole groups, D a multiple of 16
inline bool keys_in_lanes_fits(int64_t bs, int64_t D, int64_t KT, const at::Tensor& pair_pos0) {
  if (!((bs % keys_in_lanes::KG == 0 || keys_in_lanes::KG % bs == 0) && (KT * bs) % keys_in_lanes::KG == 0 && D % (keys_in_lanes::CB * keys_in_lanes::W) == 0 &&
        D <= 512))
    return false;
  const int64_t* p0 = pair_pos0.data_ptr<int64_t>();
  for (int64_t p = 0; p < pair_pos0.size(0); ++p)
    if (p0[p] % keys_in_lanes::KG) return false;
  return true;
}

void attend_keys_in_lanes(const at::Tensor& q, const Tiles& tl, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_pos,
                   const at::Tensor& pair_blocks, const at::Tensor& pair_pos0, const std::vector<int64_t>& start,
                   const std::vector<int64_t>& order, double scale, int64_t window, double softcap, at::Tensor& out) {
  using namespace keys_in_lanes;
  const int64_t N = tl.N, Qt = tl.Qt, Hkv = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = k_cache.size(2), KT = pair_blocks.size(1), QG = Qt * G, num_blocks = k_cache.size(0);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* qpos = q_pos.data_ptr<int64_t>();
  const int64_t* pblocks = pair_blocks.data_ptr<int64_t>();
  const int64_t* ppos0 = pair_pos0.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // A task is a tile and one KV head; or, for one-token tiles where there are tiles enough for the
  // threads, a tile with all its KV heads (a block's heads lie side by side: one stream of memory).
  const int64_t split = Qt == 1 && N >= 4 * at::get_num_threads() ? 1 : Hkv, width = Hkv / split;
  const int64_t head = bs * D;  // elements from one KV head's rows of a block to the next head's
  run_tasks(N * split, [&](auto next) {
    const int64_t rows_n = width * QG;
    std::vector<float> acc(rows_n * D), m(rows_n), l(rows_n * W), zeros(D, 0.f), kpack(KG * D);
    std::vector<const float*> rows(rows_n), krow(KG), vrow(KG), qrun(MAX_RB);
    // the group's active rows: their index, mask, scores (then weights), max change and alpha
    std::vector<int64_t> act(rows_n);
    std::vector<uint32_t> amask(rows_n);
    std::vector<float> sc(rows_n * KG), delta(rows_n + W), alpha(rows_n + W);
    std::vector<float*> arun(MAX_RB);
    std::vector<std::pair<int64_t, int64_t>> visits;  // the blocks the tile reads, in position order
    int sink = 0;  // the read-ahead words, unused
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t n = task / split, h0 = task % split * width;
      start_task(qp, tl, n, Hkv, G, D, h0, width, rows, acc, m, l);
      const auto [first, nkeys] = tile_keys(n, Qt, qpos, start, order, ppos0, pblocks, KT, bs, num_blocks, visits);
      // A prompt chunk's group lines, every head of the task, are read just before its fold: on a 2-core
      // Zen 3, reading AHEAD positions in advance (as the paths above do) took batch-64 decode attention
      // from 55-60 to 60-66 ms a step, and reading none to 80 ms (the loads' misses overlap each other).
      // A decode tile reads its first group so, then asks for each next group's lines from inside the
      // loops that fold the one before (Ahead).
      size_t fetched = 0;  // visits whose lines have been read
      for (int64_t k0 = 0; k0 < nkeys; k0 += KG) {
        const int64_t gpos = first + k0, nk = std::min(KG, nkeys - k0);
        if (Qt == 1 && k0 > 0) fetched = visits.size();  // asked for while the group before was folded
        group_keys(visits, fetched, k0 + KG, kp, vp, Hkv, h0, width, bs, D, k0, nk, krow.data(), vrow.data(), sink);
        Ahead ahead;
        if (Qt == 1 && k0 + KG < nkeys) plan_ahead(ahead, visits, k0 + KG, kp, vp, Hkv, h0, width, bs, D);
        for (int64_t hh = 0; hh < width; ++hh) {  // a head at a time: its pack, then its rows' passes
          pack_keys(krow.data(), hh * head, D, nk, zeros.data(), kpack.data(), ahead);
          const int64_t na = group_rows(qpos + n * Qt, Qt, G, hh * QG, gpos, nk, window, act.data(), amask.data());
          if (na <= MAX_RB) {  // a decode tile's rows: one fold
            if (na)
              with_rows(na, [&](auto R) {
                fold<R>(act.data(), amask.data(), rows.data(), kpack.data(), vrow.data(), hh * head, nk, D, fscale, cap,
                        m.data(), l.data(), acc.data(), ahead);
              });
            continue;
          }
          for (int64_t i = 0; i < na; i += MAX_RB) {
            const int64_t R = std::min<int64_t>(MAX_RB, na - i);
            for (int64_t r = 0; r < R; ++r) qrun[r] = rows[act[i + r]];
            with_rows(R, [&](auto RR) { scores<RR, NK<RR>>(qrun.data(), kpack.data(), D, sc.data() + i * KG); });
          }
          for (int64_t i = 0; i < na; ++i) row_max(sc.data() + i * KG, amask[i], fscale, cap, m[act[i]], delta[i]);
          for (int64_t i = 0; i < na; i += W) store(alpha.data() + i, vexp(load(delta.data() + i)));
          for (int64_t i = 0; i < na; ++i) row_weights(sc.data() + i * KG, m[act[i]], alpha[i], &l[act[i] * W]);
          for (int64_t i = 0; i < na; i += MAX_RB) {
            const int64_t R = std::min<int64_t>(MAX_RB, na - i);
            for (int64_t r = 0; r < R; ++r) arun[r] = acc.data() + act[i + r] * D;
            with_rows(R, [&](auto RR) { values<RR, CB>(sc.data() + i * KG, alpha.data() + i, vrow.data(), hh * head, nk, D, arun.data()); });
          }
        }
        ahead.rest();
      }
      for (int64_t r = 0; r < rows_n; ++r) {
        if (!tl.write_pad && qpos[n * Qt + r % QG / G] >= PAD_POS) continue;
        const float sum = lane_total<W>(&l[r * W]);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        float* dst = op + (rows[r] - qp);  // the output sits where the row's query does
        for (int64_t d = 0; d < D; d += W) store(dst + d, load(&acc[r * D + d]) * inv);
      }
    }
  });
}
#endif

template <typename T>
void attend(const at::Tensor& q, const Tiles& tl, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& q_pos,
            const at::Tensor& pair_tile, const at::Tensor& pair_blocks, const at::Tensor& pair_pos0, double scale,
            int64_t window, double softcap, at::Tensor& out, bool use_amx) {
  const int64_t N = tl.N, Qt = tl.Qt, Hkv = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = k_cache.size(2), P = pair_tile.size(0), KT = pair_blocks.size(1);
  const int64_t QG = Qt * G;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* qpos = q_pos.data_ptr<int64_t>();
  const int64_t* ptile = pair_tile.data_ptr<int64_t>();
  const int64_t* pblocks = pair_blocks.data_ptr<int64_t>();
  const int64_t* ppos0 = pair_pos0.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  Fold vfold[MAX_R + 1];
  for (int64_t R = 1; R <= MAX_R; ++R) vfold[R] = fold_for(D, bs, R);

  // each tile's pairs, in their order in P (a counting sort: the plan may append padding pairs last)
  std::vector<int64_t> start(N + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ptile[p] >= 0 && ptile[p] < N, "pair_tile out of range");
    ++start[ptile[p] + 1];
  }
  for (int64_t n = 0; n < N; ++n) start[n + 1] += start[n];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < P; ++p) order[fill[ptile[p]]++] = p;
  }
  const int64_t num_blocks = k_cache.size(0);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bdot_fits(bs, D)) {
      attend_bdot(q, tl, k_cache, v_cache, q_pos, pair_tile, pair_blocks, pair_pos0, start, order, scale, window,
                  softcap, out, use_amx);
      return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (keys_in_lanes_fits(bs, D, KT, pair_pos0)) {
      attend_keys_in_lanes(q, tl, k_cache, v_cache, q_pos, pair_blocks, pair_pos0, start, order, scale, window, softcap, out);
      return;
    }
  }
#endif

  // A task is a tile and one KV head; or, for one-token tiles where there are tiles enough for the
  // threads, a tile with all its KV heads (a block's heads lie side by side: one stream of memory, as the
  // paths above). A prompt chunk reads its blocks AHEAD positions before their fold, in bursts; a decode
  // tile reads its first block so, then asks for each next block's lines from inside the folds of the one
  // before (Ahead). float32 decode attention alone on the 2-core Xeon (AVX-512, 30 layers, in-process
  // A/B, median of 7, the same bits; float32 there has since moved to the keys-in-lanes path): batch 64
  // 59.3 -> 49.7 ms a step; all heads a task with bursts
  // 54.5, a burst of prefetches a block or two ahead 55-57; spread at one line a key 55.0, at four 53.9.
  // Prompt chunks on Ahead were slower (4,096 tokens 0.955x), so they keep their bursts.
  const int64_t split = Qt == 1 && N >= 4 * at::get_num_threads() ? 1 : Hkv, width = Hkv / split;
  const int64_t head = bs * D;  // elements from one KV head's rows of a block to the next head's
  run_tasks(N * split, [&](auto next) {
    const int64_t rows_n = width * QG;
    std::vector<float> qf(rows_n * D), acc(rows_n * D), m(rows_n), l(rows_n);
    std::vector<float> kf(std::is_same_v<T, float> ? 0 : bs * D), vf(std::is_same_v<T, float> ? 0 : bs * D);
    std::vector<std::pair<int64_t, int64_t>> visits;
    int sink = 0;  // the read-ahead words, unused
    for (int64_t task; (task = next()) >= 0;) {
      const int64_t n = task / split, h0 = task % split * width;
      // the tile's queries of the task's KV heads, as float32 rows hh * QG + t * G + g
      for (int64_t hh = 0; hh < width; ++hh)
        for (int64_t t = 0; t < Qt; ++t)
          for (int64_t g = 0; g < G; ++g) {
            const T* src = qp + ((tl.tok[n * Qt + t] * Hkv + h0 + hh) * G + g) * D;
            float* dst = qf.data() + (hh * QG + t * G + g) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = to_f(src[d]);
          }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      int64_t last = std::numeric_limits<int64_t>::min();
      for (int64_t t = 0; t < Qt; ++t)  // the furthest real row: padding rows see nothing
        if (qpos[n * Qt + t] < PAD_POS) last = std::max(last, qpos[n * Qt + t]);
      tile_blocks(n, start, order, ppos0, pblocks, KT, bs, last, num_blocks, visits);
      size_t fetched = 0;  // visits read ahead
      for (size_t vi = 0; vi < visits.size(); ++vi) {
        const auto [blk, pos0] = visits[vi];
        for (const int64_t upto = Qt == 1 ? pos0 + bs : pos0 + bs + AHEAD;
             fetched < visits.size() && visits[fetched].second < upto; ++fetched) {
          const int64_t off = (visits[fetched].first * Hkv + h0) * head;
          read_ahead(kp + off, vp + off, width * head * int64_t(sizeof(T)), sink);
        }
        Ahead ahead;
        if (Qt == 1 && vi + 1 < visits.size()) {
          const int64_t off = (visits[vi + 1].first * Hkv + h0) * head;
          ahead.add(kp + off, width * head * int64_t(sizeof(T)));
          ahead.add(vp + off, width * head * int64_t(sizeof(T)));
          fetched = vi + 2;  // asked for now: not read again
        }
        const int64_t nk = std::min(bs, last - pos0 + 1);  // slots any query may see
        for (int64_t hh = 0; hh < width; ++hh) {
          const float* kb;
          const float* vb;
          if constexpr (std::is_same_v<T, float>) {
            kb = kp + (blk * Hkv + h0 + hh) * head;
            vb = vp + (blk * Hkv + h0 + hh) * head;
          } else {
            const T* ks = kp + (blk * Hkv + h0 + hh) * head;
            const T* vs = vp + (blk * Hkv + h0 + hh) * head;
            for (int64_t j = 0; j < nk * D; ++j) kf[j] = to_f(ks[j]), vf[j] = to_f(vs[j]);
            kb = kf.data();
            vb = vf.data();
          }
          for (int64_t t = 0; t < Qt; ++t) {  // a token's G rows (its query heads) see the same slots
            const int64_t qpos_t = qpos[n * Qt + t];
            if (qpos_t >= PAD_POS) continue;
            const int64_t hi = std::min(nk, qpos_t - pos0 + 1);  // slots [lo, hi) visible to the token
            const int64_t lo = window > 0 ? std::max<int64_t>(0, qpos_t - window + 1 - pos0) : 0;
            if (hi <= lo) continue;
            for (int64_t r = hh * QG + t * G, end = r + G; r < end;) {
              const int64_t R = std::min<int64_t>(MAX_R, end - r);
              if (vfold[R]) {
                vfold[R](qf.data() + r * D, kb, vb, lo, hi, fscale, cap, &m[r], &l[r], acc.data() + r * D,
                         Qt == 1 ? &ahead : nullptr);
                r += R;
              } else {
                fold_any(qf.data() + r * D, kb, vb, D, lo, hi, fscale, cap, m[r], l[r], acc.data() + r * D);
                r += 1;
              }
            }
          }
        }
        ahead.rest();
      }
      for (int64_t hh = 0; hh < width; ++hh)
        for (int64_t t = 0; t < Qt; ++t) {
          if (!tl.write_pad && qpos[n * Qt + t] >= PAD_POS) continue;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = hh * QG + t * G + g;
            T* dst = op + ((tl.tok[n * Qt + t] * Hkv + h0 + hh) * G + g) * D;
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;  // a row with no visible key (none planned) gives 0
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[r * D + d] * inv);
          }
        }
    }
  });
}

void check(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tok,
           const at::Tensor& q_pos, const at::Tensor& pair_tile, const at::Tensor& pair_blocks,
           const at::Tensor& pair_pos0) {
  TORCH_CHECK(q.dim() == 4, "q must be [T, Hkv, G, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [blocks, Hkv, bs, D], alike");
  TORCH_CHECK(k_cache.size(1) == q.size(1) && k_cache.size(3) == q.size(3), "q and the caches disagree on Hkv or D");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(tok.dim() == 2 && q_pos.dim() == 2 && q_pos.sizes() == tok.sizes(), "q_pos must be [N, Qt], as token_idx");
  TORCH_CHECK(pair_tile.dim() == 1 && pair_blocks.dim() == 2 && pair_pos0.dim() == 1 &&
                  pair_blocks.size(0) == pair_tile.size(0) && pair_pos0.size(0) == pair_tile.size(0),
              "pairs must be pair_tile [P], pair_blocks [P, KT], pair_pos0 [P]");
  for (const auto* t : {&tok, &q_pos, &pair_tile, &pair_blocks, &pair_pos0})
    TORCH_CHECK(t->scalar_type() == at::kLong, "token indices, positions and pairs must be int64");
  const int64_t T = q.size(0);
  const int64_t* tp = tok.data_ptr<int64_t>();
  for (int64_t i = 0; i < tok.numel(); ++i) TORCH_CHECK(tp[i] >= 0 && tp[i] < T, "token_idx out of range");
}

// one group's tiles (tok [N, Qt] into q's tokens) into out, both [T, Hkv, G, D] and contiguous
void attend_group(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tok,
                  const at::Tensor& q_pos, const at::Tensor& pair_tile, const at::Tensor& pair_blocks,
                  const at::Tensor& pair_pos0, double scale, int64_t window, double softcap, bool write_pad,
                  at::Tensor& out, bool use_amx) {
  check(q, k_cache, v_cache, tok, q_pos, pair_tile, pair_blocks, pair_pos0);
  auto kc = k_cache.contiguous(), vc = v_cache.contiguous();
  auto tk = tok.contiguous(), pos = q_pos.contiguous(), pt = pair_tile.contiguous(), pb = pair_blocks.contiguous(),
       p0 = pair_pos0.contiguous();
  const Tiles tl{tk.size(0), tk.size(1), tk.data_ptr<int64_t>(), write_pad};
  switch (q.scalar_type()) {
    case at::kFloat: attend<float>(q, tl, kc, vc, pos, pt, pb, p0, scale, window, softcap, out, use_amx); break;
    case at::kBFloat16: attend<c10::BFloat16>(q, tl, kc, vc, pos, pt, pb, p0, scale, window, softcap, out, use_amx); break;
    case at::kHalf: attend<c10::Half>(q, tl, kc, vc, pos, pt, pb, p0, scale, window, softcap, out, use_amx); break;
    default: TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16, got ", q.scalar_type());
  }
}

// q [N, Qt, Hkv, G, D], its tiles' queries in place -> [N, Qt, Hkv, G, D] (padding rows: 0)
at::Tensor paged_attention_on(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& q_pos, const at::Tensor& pair_tile, const at::Tensor& pair_blocks,
                              const at::Tensor& pair_pos0, double scale, int64_t window, double softcap, int64_t amx) {
  TORCH_CHECK(q.dim() == 5, "q must be [N, Qt, Hkv, G, D]");
  TORCH_CHECK(q_pos.dim() == 2 && q_pos.size(0) == q.size(0) && q_pos.size(1) == q.size(1), "q_pos must be [N, Qt]");
  auto qc = q.contiguous();
  auto q4 = qc.view({q.size(0) * q.size(1), q.size(2), q.size(3), q.size(4)});
  auto out = at::empty_like(q4);
  const auto tok = at::arange(q4.size(0), q_pos.options().dtype(at::kLong)).view({q.size(0), q.size(1)});
  attend_group(q4, k_cache, v_cache, tok, q_pos, pair_tile, pair_blocks, pair_pos0, scale, window, softcap, true, out,
               amx != 0);
  return out.view(q.sizes());
}

// AMX where usable (paged_on with amx 0 keeps VDPBF16PS on such a CPU, for tests; the engine's ops keep
// their schemas, which a compiled step cached on disk calls by)
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& q_pos, const at::Tensor& pair_tile, const at::Tensor& pair_blocks,
                           const at::Tensor& pair_pos0, double scale, int64_t window, double softcap) {
  return paged_attention_on(q, k_cache, v_cache, q_pos, pair_tile, pair_blocks, pair_pos0, scale, window, softcap, 1);
}

// The engine's step: q [T, Hkv, G, D] for every token of the step, and its tile groups (decode, prompt
// chunks, verify: each a token_idx [N, Qt] into the T tokens, with its positions and pairs) ->
// [T, Hkv, G, D], each token's output where its query is. No gathered copy of the queries, no scatter
// of the outputs (a 4,096-token prefill step's two were ~3 ms a layer on a 2-core Zen 3). A token in
// none of the groups (none the planner makes) gives 0.
at::Tensor paged_step(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      at::TensorList token_idx, at::TensorList q_pos, at::TensorList pair_tile,
                      at::TensorList pair_blocks, at::TensorList pair_pos0, double scale, int64_t window,
                      double softcap) {
  const size_t n = token_idx.size();
  TORCH_CHECK(q_pos.size() == n && pair_tile.size() == n && pair_blocks.size() == n && pair_pos0.size() == n,
              "one token_idx, q_pos, pair_tile, pair_blocks and pair_pos0 per group");
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  int64_t written = 0;  // real rows; the planner gives each of the step's tokens one
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(q_pos[i].scalar_type() == at::kLong, "token indices, positions and pairs must be int64");
    const auto pos = q_pos[i].contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    for (int64_t j = 0; j < pos.numel(); ++j) written += pp[j] < PAD_POS;
  }
  if (written != qc.size(0)) out.zero_();
  for (size_t i = 0; i < n; ++i)
    attend_group(qc, k_cache, v_cache, token_idx[i], q_pos[i], pair_tile[i], pair_blocks[i], pair_pos0[i], scale, window,
                 softcap, false, out, true);
  return out;
}

// what bfloat16 caches run on here: "amx" (tiles), "avx512-bf16" (VDPBF16PS) or "vector" (float32
// folds); AMX and VDPBF16PS round apart, so a run's conditions name it
std::string bf16_isa() {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (bdot::amx_usable()) return "amx";
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return "avx512-bf16";
#else
  return "vector";
#endif
}

// the shapes only, for tracing (torch.compile's fake tensors run the Meta kernel)
at::Tensor paged_attention_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& q_pos, const at::Tensor& pair_tile, const at::Tensor& pair_blocks,
                                const at::Tensor& pair_pos0, double scale, int64_t window, double softcap) {
  return at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
}

at::Tensor paged_step_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           at::TensorList token_idx, at::TensorList q_pos, at::TensorList pair_tile,
                           at::TensorList pair_blocks, at::TensorList pair_pos0, double scale, int64_t window,
                           double softcap) {
  return at::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
}

}  // namespace

TORCH_LIBRARY(batchgen_attention, m) {
  m.def("paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_pos, Tensor pair_tile, Tensor pair_blocks, "
        "Tensor pair_pos0, float scale, int window, float softcap) -> Tensor");
  m.def("paged_on(Tensor q, Tensor k_cache, Tensor v_cache, Tensor q_pos, Tensor pair_tile, Tensor pair_blocks, "
        "Tensor pair_pos0, float scale, int window, float softcap, int amx) -> Tensor");
  m.def("paged_step(Tensor q, Tensor k_cache, Tensor v_cache, Tensor[] token_idx, Tensor[] q_pos, "
        "Tensor[] pair_tile, Tensor[] pair_blocks, Tensor[] pair_pos0, float scale, int window, float softcap) -> Tensor");
  m.def("bf16_isa() -> str", &bf16_isa);  // no tensor to dispatch on: one kernel for every backend
}
TORCH_LIBRARY_IMPL(batchgen_attention, CPU, m) {
  m.impl("paged", &paged_attention);
  m.impl("paged_on", &paged_attention_on);
  m.impl("paged_step", &paged_step);
}
TORCH_LIBRARY_IMPL(batchgen_attention, Meta, m) {
  m.impl("paged", &paged_attention_meta);
  m.impl("paged_step", &paged_step_meta);
}
