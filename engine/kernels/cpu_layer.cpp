// The parts of a decoder layer between its linears, for x86-64 CPUs with AVX2 and FMA, where
// torch's per-call overhead (several small ops per part, each dispatched and allocated on its
// own) costs more than the arithmetic of a decode step's few rows: RMSNorm, rotary embedding,
// SwiGLU's silu(gate) * up, and paged attention. Each takes the dtype the model runs in (float32
// or bfloat16) and rounds where the torch formulation in engine/models/llama.py rounds, so the
// two agree to float32 summation order (tests/unit/test_cpu_layer_kernels.py).
//
// Paged attention for decode and verify steps: a few query
// tokens per request, each attending to its request's cached context straight from the paged KV
// blocks. torch's route for these shapes gathers every request's K and V into dense tensors and
// then runs SDPA, whose per-call set-up outweighs the arithmetic of one query row; here each
// (query token, KV head) pair is one task that reads the K/V rows it needs where they lie.
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

// Query token t, KV head g: every query head of g's group attends over the token's visible keys.
template <class T>
void attend(const Layout& L, const T* query, const T* k_cache, const T* v_cache, float scale,
            T* out, int64_t t, int64_t g, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t D = L.head_dim, group = L.num_heads / L.num_kv_heads;
  // The request t belongs to (query_start is sorted), and t's position among its query tokens.
  const int32_t* it = std::upper_bound(L.query_start, L.query_start + L.num_reqs + 1,
                                       static_cast<int32_t>(t));
  const int64_t r = (it - L.query_start) - 1;
  const int64_t query_len = L.query_start[r + 1] - L.query_start[r];
  const int64_t visible = L.seq_lens[r] - query_len + (t - L.query_start[r]) + 1;
  const int32_t* table = L.block_tables + r * L.max_blocks;
  const int64_t kv_stride = L.num_kv_heads * D;  // between consecutive slots
  scores.resize(visible);
  acc.resize(2 * D);
  float* q = acc.data() + D;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    to_float(query + (t * L.num_heads + h) * D, q, D, scale);
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < visible; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / L.block_size]) * L.block_size + j % L.block_size;
      const T* k = k_cache + slot * kv_stride + g * D;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), s1);
      }
      float s = horizontal_sum(_mm256_add_ps(s0, s1));
      for (; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
      scores[j] = s;
      best = std::max(best, s);
    }
    const __m256 best8 = _mm256_set1_ps(best);
    __m256 total8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= visible; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + j), best8));
      _mm256_storeu_ps(scores.data() + j, p);
      total8 = _mm256_add_ps(total8, p);
    }
    float total = horizontal_sum(total8);
    for (; j < visible; ++j) {
      scores[j] = std::exp(scores[j] - best);
      total += scores[j];
    }
    float* o = acc.data();
    std::fill(o, o + D, 0.0f);
    for (j = 0; j < visible; ++j) {
      const int64_t slot = static_cast<int64_t>(table[j / L.block_size]) * L.block_size + j % L.block_size;
      const T* v = v_cache + slot * kv_stride + g * D;
      const __m256 p = _mm256_set1_ps(scores[j]);
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, load8(v + d), _mm256_loadu_ps(o + d)));
      for (; d < D; ++d) o[d] += scores[j] * static_cast<float>(v[d]);
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    store_row(o, out + (t * L.num_heads + h) * D, D);
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
    at::parallel_for(0, L.num_tokens * L.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t i = begin; i < end; ++i)
        attend<T>(L, qp, kc, vc, s, op, i / L.num_kv_heads, i % L.num_kv_heads, scores, acc);
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

template <class T>
void silu_mul_rows(const T* x, int64_t rows, int64_t n, T* out) {
  at::parallel_for(0, rows * n, 2048, [&](int64_t begin, int64_t end) {
    alignas(32) float g[8];
    for (int64_t i = begin; i < end;) {
      const int64_t r = i / n, k = i % n;
      const int64_t count = std::min<int64_t>({8, n - k, end - i});
      const T* gate = x + r * 2 * n + k;
      const T* up = gate + n;
      for (int64_t j = 0; j < count; ++j) g[j] = static_cast<float>(gate[j]);
      // silu(g) = g / (1 + exp(-g))
      const __m256 gv = _mm256_load_ps(g);
      _mm256_store_ps(g, _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                         exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))));
      for (int64_t j = 0; j < count; ++j)
        out[r * n + k + j] = static_cast<T>(round_to<T>(g[j]) * static_cast<float>(up[j]));
      i += count;
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
