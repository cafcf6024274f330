// The parts of a decoder layer between its linears, for x86-64 CPUs with AVX2 and FMA, where
// torch's per-call overhead (several small ops per part, each dispatched and allocated on its
// own) costs more than the arithmetic of a decode step's few rows: RMSNorm, rotary embedding,
// SwiGLU's silu(gate) * up, and paged attention. Each takes the dtype the model runs in (float32
// or bfloat16) and rounds where the torch formulation in engine/models/llama.py rounds, so the
// two agree to float32 summation order (tests/unit/test_cpu_layer_kernels.py).
//
// Paged attention for every step: each query token attends to its request's cached context
// straight from the paged KV blocks, each (query token, KV head) pair one task that reads the
// K/V rows it needs where they lie. torch's route gathers every request's K and V into dense
// tensors and runs SDPA, whose per-call set-up outweighs the arithmetic of one query row, and
// whose blocked arithmetic differs with the number of queries; here a token's arithmetic is the
// same in any step (decode, verify, any prompt chunk, beside any other requests): batch
// invariance, which greedy speculation's exactness and reproducible answers rest on.
//
// Per query head: scores s_j = scale * q . k_j over the keys the token may see (its own position
// and everything before it in its request), p_j = exp(s_j - max s) / sum, out = sum_j p_j v_j.
// All arithmetic is float32 whatever the cache dtype (float32 or bfloat16); the result is
// rounded once to the query's dtype. Threads come from torch's pool (at::parallel_for).


#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// exp(x), 8 at a time: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial
// (relative error ~1e-7), times 2^n built in the exponent bits. Below -87 the result is 0 (where
// float32's exp is at most a subnormal), past float32's range infinity, as float32's exp, and in
// between (88 to 88.72) exp(88): silu and softmax, its only callers, cannot tell these apart.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * (high part) is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 finite = _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
  return _mm256_blendv_ps(finite, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
}

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even
}

template <class F>
void dispatch_float(const torch::Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16 expected");
    f(static_cast<at::BFloat16*>(nullptr));
  }
}

template <class T>
inline void to_float(const T* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

struct Layout {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  const int32_t* block_tables;  // [num_reqs, max_blocks]
  const int32_t* seq_lens;      // [num_reqs]: context after this step
  const int32_t* query_start;   // [num_reqs + 1]: first query token of each request
  int64_t num_reqs;
};

// f(std::integral_constant<int, n>()) for 1 <= n <= 7; nothing for n = 0.
template <class F>
inline void with_vectors(int64_t n, F&& f) {
  switch (n) {
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 1: f(std::integral_constant<int, 1>()); break;
    default: break;
  }
}

// The lane sums of a, b, c and d: [sum a, sum b, sum c, sum d], each by one fixed tree,
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), whatever the other three hold.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Keys per tile of the score pass: the group's query heads take each tile in turn while its key
// rows are in cache.
constexpr int64_t kKeyTile = 8;

// scores[h * visible + j] = q_h . k_j for NH query heads (q_h = q + h * D, already scaled) and
// the NK keys j in [j0, j0 + NK) below `visible`: per head and key one 8-lane multiply-add chain
// over d in order, summed by sum4's tree, then the columns past the last multiple of 8 in order.
// Each key row loaded serves every head of the pass (NH x NK chains hide the multiply-adds'
// latency), and the arithmetic of one (head, key) is the same whichever heads and keys share
// its pass. Keys past `visible` repeat the last one, and are not stored.
template <class T, int NH, int NK, class KeyRow>
__attribute__((always_inline)) inline void score_tile(const float* q, int64_t D, int64_t j0,
                                                      int64_t visible, KeyRow&& key_row,
                                                      float* scores) {
  static_assert(NK % 4 == 0, "keys are summed four at a time");
  const T* k[NK];
#pragma GCC unroll 8
  for (int i = 0; i < NK; ++i) k[i] = key_row(std::min<int64_t>(j0 + i, visible - 1));
  __m256 acc[NH * NK];  // flat, loops unrolled: kept in registers (see weigh_values)
#pragma GCC unroll 16
  for (int a = 0; a < NH * NK; ++a) acc[a] = _mm256_setzero_ps();
  const int64_t d8 = D - D % 8;
  for (int64_t d = 0; d < d8; d += 8) {
    __m256 kv[NK];
#pragma GCC unroll 8
    for (int i = 0; i < NK; ++i) kv[i] = load8(k[i] + d);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * D + d);
#pragma GCC unroll 8
      for (int i = 0; i < NK; ++i) acc[h * NK + i] = _mm256_fmadd_ps(qv, kv[i], acc[h * NK + i]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    alignas(16) float sums[NK];
    for (int i = 0; i < NK; i += 4)
      _mm_store_ps(sums + i, sum4(acc[h * NK + i], acc[h * NK + i + 1], acc[h * NK + i + 2],
                                  acc[h * NK + i + 3]));
    const float* qh = q + h * D;
    for (int i = 0; i < NK && j0 + i < visible; ++i) {
      float s = sums[i];
      for (int64_t d = d8; d < D; ++d) s += qh[d] * static_cast<float>(k[i][d]);
      scores[h * visible + j0 + i] = s;
    }
  }
}

// o_h[d0, d0 + 8 NV) += sum_j p_h[j] v_j[d0, d0 + 8 NV) over j in [j0, j1) in order for NH heads
// (p_h = p + h * visible, o_h = o + h * D), one multiply-add per term, the sums held in registers
// (from zero where `first`): each value row loaded serves every head of the pass, and blocks of
// keys taken in turn give the sums of one pass over them all, the same operations in the same
// order for any NH and NV.
template <int NH, int NV, class T, class ValueRow>
__attribute__((always_inline)) inline void weigh_values(const float* p, int64_t visible, int64_t D,
                                                        int64_t j0, int64_t j1, int64_t d0,
                                                        bool first, ValueRow&& value_row,
                                                        float* o) {
  // One flat array, its loops unrolled: GCC keeps it in registers (as a 2-D array it stored every
  // sum back to the stack after each multiply-add).
  __m256 acc[NH * NV];
#pragma GCC unroll 16
  for (int a = 0; a < NH * NV; ++a)
    acc[a] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + (a / NV) * D + d0 + 8 * (a % NV));
  for (int64_t j = j0; j < j1; ++j) {
    const T* v = value_row(j) + d0;
    __m256 vv[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) vv[i] = load8(v + 8 * i);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 pj = _mm256_broadcast_ss(p + h * visible + j);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) acc[h * NV + i] = _mm256_fmadd_ps(pj, vv[i], acc[h * NV + i]);
    }
  }
#pragma GCC unroll 16
  for (int a = 0; a < NH * NV; ++a) _mm256_storeu_ps(o + (a / NV) * D + d0 + 8 * (a % NV), acc[a]);
}

// Keys per block of the value pass: a block's value rows stay in cache while every query head of
// the group weighs them.
constexpr int64_t kValueBlock = 64;

// f(std::integral_constant<int, n>()) for 1 <= n <= Max (heads per pass).
template <int Max, class F>
inline void with_heads(int64_t n, F&& f) {
  if constexpr (Max > 1) {
    if (n < Max) return with_heads<Max - 1>(n, f);
  }
  f(std::integral_constant<int, Max>());
}

// Query heads per score pass (3 heads x 4 keys: twelve chains, each key row loaded once for
// three heads) and per value pass (6 heads x 16 columns: each value row loaded once for six).
constexpr int kScoreHeads = 3;
constexpr int kValueHeads = 6;

// What one task keeps between the tokens it attends: per query head of a group its scaled query,
// its scores (then weights), their total and its output sums, and each visible key's row offset.
struct Scratch {
  std::vector<float> q, scores, o, totals;
  std::vector<int64_t> offsets;
};

// Query token t, KV head g: every query head of g's group attends over the token's visible keys.
// A token's arithmetic depends only on its own query, its position and its request's cache: not
// on the other tokens of the step, the other requests, or how the step's work is split among
// threads, so its result is the same in a decode step, a verify step or any prompt chunk. The
// group's heads take each tile of keys and each block of values in turn while those rows are in
// cache (each head's operations are those of a pass of its own: only their interleaving differs).
template <class T>
void attend(const Layout& L, const T* query, const T* k_cache, const T* v_cache, float scale,
            T* out, int64_t t, int64_t g, Scratch& scratch) {
  const int64_t D = L.head_dim, group = L.num_heads / L.num_kv_heads;
  // The request t belongs to (query_start is sorted), and t's position among its query tokens.
  const int32_t* it = std::upper_bound(L.query_start, L.query_start + L.num_reqs + 1,
                                       static_cast<int32_t>(t));
  const int64_t r = (it - L.query_start) - 1;
  const int64_t query_len = L.query_start[r + 1] - L.query_start[r];
  const int64_t visible = L.seq_lens[r] - query_len + (t - L.query_start[r]) + 1;
  const int32_t* table = L.block_tables + r * L.max_blocks;
  const int64_t kv_stride = L.num_kv_heads * D;  // between consecutive slots
  // Where key j's row lies, worked out once for every head of the group and both passes (a
  // division per key and read, as it was, cost more than the key's multiply-adds).
  std::vector<int64_t>& offsets = scratch.offsets;
  offsets.resize(visible);
  for (int64_t j0 = 0, b = 0; j0 < visible; j0 += L.block_size, ++b) {  // block by block
    const int64_t first = static_cast<int64_t>(table[b]) * L.block_size * kv_stride + g * D;
    const int64_t j1 = std::min(visible, j0 + L.block_size);
    for (int64_t j = j0; j < j1; ++j) offsets[j] = first + (j - j0) * kv_stride;
  }
  const auto key_row = [&](int64_t j) { return k_cache + offsets[j]; };
  const auto value_row = [&](int64_t j) { return v_cache + offsets[j]; };
  scratch.q.resize(group * D);
  scratch.scores.resize(group * visible);
  scratch.o.resize(group * D);
  const auto q_of = [&](int64_t h) { return scratch.q.data() + h * D; };
  const auto scores_of = [&](int64_t h) { return scratch.scores.data() + h * visible; };
  const auto o_of = [&](int64_t h) { return scratch.o.data() + h * D; };
  for (int64_t h = 0; h < group; ++h)
    to_float(query + (t * L.num_heads + g * group + h) * D, q_of(h), D, scale);
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t j = 0; j < visible; j += kKeyTile) {
    // The key and value rows two tiles on, toward L2 while this one is scored: at each layer a
    // token's context comes from memory, a slot apart and a block wherever the pool had one,
    // and the value pass, which reads a line of each row at a time, then finds them in L2 (to
    // L1, or keys alone, was slower: bench/attention.py).
    for (int64_t i = j + 2 * kKeyTile; i < std::min(visible, j + 3 * kKeyTile); ++i)
      for (int64_t line = 0; line < row_bytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(key_row(i)) + line, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(value_row(i)) + line, _MM_HINT_T1);
      }
    for (int64_t h = 0; h < group; h += kScoreHeads)
      with_heads<kScoreHeads>(std::min<int64_t>(kScoreHeads, group - h), [&](auto nh) {
        constexpr int NH = decltype(nh)::value;
        if constexpr (NH == 1) {  // one head: eight keys keep eight chains in flight
          score_tile<T, 1, 8>(q_of(h), D, j, visible, key_row, scores_of(h));
        } else {
          score_tile<T, NH, 4>(q_of(h), D, j, visible, key_row, scores_of(h));
          score_tile<T, NH, 4>(q_of(h), D, j + 4, visible, key_row, scores_of(h));
        }
      });
  }
  std::vector<float>& totals = scratch.totals;
  totals.resize(group);
  for (int64_t h = 0; h < group; ++h) {
    float* scores = scores_of(h);
    // The largest score, eight lanes at a time (a maximum is the same in any order).
    __m256 most8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t jm = 0;
    for (; jm + 8 <= visible; jm += 8) most8 = _mm256_max_ps(most8, _mm256_loadu_ps(scores + jm));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, most8);
    float best = lanes[0];
    for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
    for (; jm < visible; ++jm) best = std::max(best, scores[jm]);
    const __m256 best8 = _mm256_set1_ps(best);
    __m256 total8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= visible; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), best8));
      _mm256_storeu_ps(scores + j, p);
      total8 = _mm256_add_ps(total8, p);
    }
    float total = horizontal_sum(total8);
    for (; j < visible; ++j) {
      scores[j] = std::exp(scores[j] - best);
      total += scores[j];
    }
    totals[h] = total;
  }
  const int64_t d_vec = D / 8 * 8;  // columns the 8-lane passes take; the rest one at a time
  for (int64_t j0 = 0; j0 < visible; j0 += kValueBlock) {
    const int64_t j1 = std::min(visible, j0 + kValueBlock);
    for (int64_t h = 0; h < group; h += kValueHeads)
      with_heads<kValueHeads>(std::min<int64_t>(kValueHeads, group - h), [&](auto nh) {
        constexpr int NH = decltype(nh)::value;
        // Columns per pass: eight multiply-add chains at least, the value row shared by NH heads.
        constexpr int NV = NH == 1 ? 8 : NH == 2 ? 4 : 2;
        int64_t d0 = 0;
        for (; d0 + 8 * NV <= D; d0 += 8 * NV)
          weigh_values<NH, NV, T>(scores_of(h), visible, D, j0, j1, d0, j0 == 0, value_row,
                                  o_of(h));
        with_vectors((D - d0) / 8, [&](auto nv) {
          weigh_values<NH, decltype(nv)::value, T>(scores_of(h), visible, D, j0, j1, d0, j0 == 0,
                                                   value_row, o_of(h));
        });
      });
  }
  for (int64_t h = 0; h < group; ++h) {
    const float* scores = scores_of(h);
    float* o = o_of(h);
    for (int64_t d = d_vec; d < D; ++d) {
      float sum = 0.0f;
      for (int64_t j = 0; j < visible; ++j) sum += scores[j] * static_cast<float>(value_row(j)[d]);
      o[d] = sum;
    }
    const float inv = 1.0f / totals[h];
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    store_row(o, out + (t * L.num_heads + g * group + h) * D, D);
  }
}

template <class T>
void write_kv(const T* key, const T* value, const int64_t* slots, int64_t num_tokens,
              int64_t row, T* k_cache, T* v_cache) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * row, key + t * row, row * sizeof(T));
    std::memcpy(v_cache + slots[t] * row, value + t * row, row * sizeof(T));
  }
}

}  // namespace

// query [T, H, D]; key/value [T, KVH, D] (this step's, written to their slots first);
// k_cache/v_cache [num_blocks, block_size, KVH, D]; slot_mapping [T] int64; block_tables
// [R, max_blocks], seq_lens [R], query_start [R + 1] int32. -> [T, H, D] in the query's dtype.
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start, double scale) {
  const auto dtype = query.scalar_type();  // float32 or bfloat16: dispatch_float checks
  for (const auto* t : {&key, &value, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == dtype && t->device().is_cpu(),
                "paged_attention: CPU tensors of the query's dtype expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4,
              "paged_attention: contiguous caches [blocks, block_size, kv_heads, head_dim] expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start.scalar_type() == at::kInt && slot_mapping.scalar_type() == at::kLong,
              "paged_attention: int32 tables and int64 slots expected");
  const auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const auto tables = block_tables.contiguous(), lens = seq_lens.contiguous(),
             starts = query_start.contiguous(), slots = slot_mapping.contiguous();
  Layout L{q.size(0), q.size(1), k_cache.size(2), k_cache.size(3), k_cache.size(1),
           tables.size(1), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
           starts.data_ptr<int32_t>(), tables.size(0)};
  // Rows are copied and read by these sizes: a mismatch would read or write past a tensor.
  TORCH_CHECK(q.dim() == 3 && q.size(2) == L.head_dim && L.num_heads % L.num_kv_heads == 0 &&
                  k.dim() == 3 && k.size(0) == L.num_tokens && k.size(1) == L.num_kv_heads &&
                  k.size(2) == L.head_dim && v.sizes() == k.sizes() &&
                  v_cache.sizes() == k_cache.sizes() && slots.numel() == L.num_tokens &&
                  starts.numel() == L.num_reqs + 1 && lens.numel() == L.num_reqs,
              "paged_attention: shapes disagree");
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale);
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const T* kc = reinterpret_cast<const T*>(k_cache.data_ptr());
    const T* vc = reinterpret_cast<const T*>(v_cache.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    write_kv(reinterpret_cast<const T*>(k.data_ptr()), reinterpret_cast<const T*>(v.data_ptr()),
             slots.data_ptr<int64_t>(), L.num_tokens, L.num_kv_heads * L.head_dim,
             reinterpret_cast<T*>(k_cache.data_ptr()), reinterpret_cast<T*>(v_cache.data_ptr()));
    // Tasks by KV head, then token: a thread's run of tokens of one request (a verify chunk, a
    // prompt chunk) reads one head's keys and values, which then stay in its L2 from one token
    // to the next, where alternating heads evicted them.
    at::parallel_for(0, L.num_tokens * L.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t i = begin; i < end; ++i)
        attend<T>(L, qp, kc, vc, s, op, i % L.num_tokens, i / L.num_tokens, scratch);
    });
  };
  dispatch_float(q, "paged_attention", run);
  return out;
}

namespace {

// Rounds a float32 to T and back: where the torch formulation stores an intermediate in T.
template <class T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <class T>
void rms_norm_rows(const T* x, const T* weight, float eps, int64_t rows, int64_t n, T* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      __m256 ss8 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(xr + i);
        _mm256_storeu_ps(xf.data() + i, v);
        ss8 = _mm256_fmadd_ps(v, v, ss8);
      }
      float ss = horizontal_sum(ss8);
      for (; i < n; ++i) {
        xf[i] = static_cast<float>(xr[i]);
        ss += xf[i] * xf[i];
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
      for (i = 0; i < n; ++i)
        out[r * n + i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(xf[i] * inv));
    }
  });
}

template <class T>
void rope_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, int64_t tokens,
               int64_t heads, int64_t d, T* out) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* xr = x + t * row_stride + h * d;
      const T *c = cos + t * d, *s = sin + t * d;
      T* o = out + i * d;
      for (int64_t k = 0; k < d; ++k) {
        const float rotated = k < half ? -static_cast<float>(xr[k + half]) : static_cast<float>(xr[k - half]);
        const float a = round_to<T>(static_cast<float>(xr[k]) * static_cast<float>(c[k]));
        const float b = round_to<T>(rotated * static_cast<float>(s[k]));
        o[k] = static_cast<T>(a + b);
      }
    }
  });
}

// silu(g) = g / (1 + exp(-g)) of 8 lanes.
inline __m256 silu8(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

template <class T>
void silu_mul_rows(const T* x, int64_t rows, int64_t n, T* out) {
  at::parallel_for(0, rows * n, 2048, [&](int64_t begin, int64_t end) {
    alignas(32) float g[8];
    int64_t r = begin / n, k = begin % n;  // element i = r * n + k, stepped along with i
    for (int64_t i = begin; i < end;) {
      const int64_t count = std::min<int64_t>({8, n - k, end - i});
      const T* gate = x + r * 2 * n + k;
      const T* up = gate + n;
      if (std::is_same_v<T, float> && count == 8) {  // the same operations, lane by lane
        const float* gf = reinterpret_cast<const float*>(gate);
        const float* uf = reinterpret_cast<const float*>(up);
        _mm256_storeu_ps(reinterpret_cast<float*>(out + r * n + k),
                         _mm256_mul_ps(silu8(_mm256_loadu_ps(gf)), _mm256_loadu_ps(uf)));
      } else {
        for (int64_t j = 0; j < count; ++j) g[j] = static_cast<float>(gate[j]);
        _mm256_store_ps(g, silu8(_mm256_load_ps(g)));
        for (int64_t j = 0; j < count; ++j)
          out[r * n + k + j] = static_cast<T>(round_to<T>(g[j]) * static_cast<float>(up[j]));
      }
      i += count, k += count;
      if (k == n) k = 0, ++r;
    }
  });
}

}  // namespace

// weight * to_dtype(x * rsqrt(mean(x^2, -1) + eps)) over the last dimension, x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(x.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.numel() == n,
              "rms_norm: a CPU tensor and a weight of its last dimension, same dtype, expected");
  const auto xc = x.contiguous(), w = weight.contiguous();
  auto out = torch::empty_like(xc);
  dispatch_float(xc, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(reinterpret_cast<const T*>(xc.data_ptr()), reinterpret_cast<const T*>(w.data_ptr()),
                     static_cast<float>(eps), xc.numel() / n, n, reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}

// x [T, heads, D] (rows may be strided, each row's heads contiguous), cos/sin [T, D] in x's dtype
// -> x * cos + rotate_half(x) * sin, contiguous.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope: x [tokens, heads, head_dim] and cos/sin of its dtype expected");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  const auto xc = (x.stride(2) == 1 && x.stride(1) == d) ? x : x.contiguous();
  const auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.size(0) == tokens && c.size(1) == d && s.sizes() == c.sizes() && d % 2 == 0,
              "rope: cos/sin [tokens, head_dim] expected");
  auto out = torch::empty({tokens, heads, d}, xc.options());
  dispatch_float(xc, "rope", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_rows<T>(reinterpret_cast<const T*>(xc.data_ptr()), xc.stride(0),
                 reinterpret_cast<const T*>(c.data_ptr()), reinterpret_cast<const T*>(s.data_ptr()),
                 tokens, heads, d, reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}

// x [T, 2n] = [gate | up] -> silu(gate) * up [T, n], x's dtype.
torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) % 2 == 0,
              "silu_mul: x [tokens, 2 * n] expected");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1) / 2;
  auto out = torch::empty({rows, n}, xc.options());
  dispatch_float(xc, "silu_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<T>(reinterpret_cast<const T*>(xc.data_ptr()), rows, n, reinterpret_cast<T*>(out.data_ptr()));
  });
  return out;
}
