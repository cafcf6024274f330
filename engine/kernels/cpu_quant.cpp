// Linear layers over GGUF block-quantised weights (the formats llama.cpp writes), for x86-64 CPUs
// with AVX2, FMA and F16C: the weights stay in the file's blocks in memory, so a decode step reads
// ~0.56 bytes per weight (Q4_K) instead of bfloat16's 2.
//
// Every format stores groups of 32 weights as small integers q with a float scale s (per 16 for
// Q6_K) and, for some, an offset: the weight is s * q - mm. `dequantize` computes exactly that,
// in float32 with the same operations and order as the reference dequantiser of the gguf package
// (built with -ffp-contract=off so no multiply-add is fused), so its output equals the file's
// dequantised tensor bit for bit. `quant_linear` multiplies activations by those same weights
// without materialising them: per group it sums q * x in float32 and scales the sum once,
// sum_k (s q_k - mm) x_k = s * sum_k q_k x_k - mm * sum_k x_k, with sum_k x_k computed once per
// activation row and group. Activations stay float32 (no activation quantisation), so the result
// differs from x @ dequantize(W).T only by float32 summation order.
//
// Formats multiplied by (ggml's type ids): Q4_0 (2), Q4_1 (3), Q8_0 (8): blocks of 32 weights;
// Q4_K (12): super-blocks of 256; and Q6_K8 (our 1014), Q6_K's values one byte per weight, which
// `repack_q6_k` makes at load from Q6_K (14). `repack_q5_0` likewise turns Q5_0 (6) into Q8_0:
// those two layouts are only read at load.
// Threads come from torch's pool (at::parallel_for).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

inline __m256i bytes8_u32(const uint8_t* p) {  // 8 bytes zero-extended to 8 int32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bytes8_i32(const uint8_t* p) {  // 8 bytes sign-extended to 8 int32 lanes
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// One group of 32 weights: q[0..3] hold q for weights 0-7, 8-15, 16-23, 24-31 (integer-valued
// floats, the format's zero point already subtracted), weights 0-15 scale by s0 and 16-31 by s1,
// and mm is subtracted from every weight (0 where the format has no offset).
struct Group {
  __m256 q[4];
  float s0, s1, mm;
};

// Each format: kWeights per block, kBytes per block, kHasOffset (whether mm can be nonzero), and
// group(block, g, out) for g in [0, kWeights / 32).

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18;
  static constexpr bool kHasOffset = false;
  static inline void group(const uint8_t* b, int, Group& out) {
    const float d = f16(b);
    const __m256i lo = bytes8_u32(b + 2), hi = bytes8_u32(b + 10), mask = _mm256_set1_epi32(15);
    const __m256i eight = _mm256_set1_epi32(8);
    out.q[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(lo, mask), eight));
    out.q[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(hi, mask), eight));
    out.q[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(lo, 4), eight));
    out.q[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(hi, 4), eight));
    out.s0 = out.s1 = d;
    out.mm = 0.0f;
  }
};

struct Q4_1 {  // weight = d * q + m
  static constexpr int kWeights = 32, kBytes = 20;
  static constexpr bool kHasOffset = true;
  static inline void group(const uint8_t* b, int, Group& out) {
    const __m256i lo = bytes8_u32(b + 4), hi = bytes8_u32(b + 12), mask = _mm256_set1_epi32(15);
    out.q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
    out.q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
    out.q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    out.q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
    out.s0 = out.s1 = f16(b);
    out.mm = -f16(b + 2);
  }
};

// Q5_0 and Q6_K are served re-laid out (repack_q5_0, repack_q6_k below): their own layouts are
// only read at load, so they need no group decoder.
struct Q5_0 {  // 4 low bits in nibbles, the fifth in a 32-bit mask; weight = d * (q - 16)
  static constexpr int kWeights = 32, kBytes = 22;
};

struct Q8_0 {  // weight = d * q, q int8
  static constexpr int kWeights = 32, kBytes = 34;
  static constexpr bool kHasOffset = false;
  static inline void group(const uint8_t* b, int, Group& out) {
    for (int i = 0; i < 4; ++i) out.q[i] = _mm256_cvtepi32_ps(bytes8_i32(b + 2 + 8 * i));
    out.s0 = out.s1 = f16(b);
    out.mm = 0.0f;
  }
};

struct Q4_K {  // super-block: d, dmin, 8 six-bit (scale, min) pairs, 256 nibbles
  static constexpr int kWeights = 256, kBytes = 144;
  static constexpr bool kHasOffset = true;
};

struct Q6_K {  // super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
  static constexpr int kWeights = 256, kBytes = 210;
};

// Q6_K re-laid out at load for a cheaper decode (repack_q6_k): per super-block the 256 values
// q - 32 as int8, then the 16 int8 scales, then d. The weight is (d * scale) * (q - 32), exactly
// as from the Q6_K block; the decode is a widening load where Q6_K needs five bit operations.
struct Q6_K8 {
  static constexpr int kWeights = 256, kBytes = 274;
  static constexpr bool kHasOffset = false;
  static inline void group(const uint8_t* b, int g, Group& out) {
    const auto* scales = reinterpret_cast<const int8_t*>(b + 256);
    const float d = f16(b + 272);
    for (int i = 0; i < 4; ++i) out.q[i] = _mm256_cvtepi32_ps(bytes8_i32(b + 32 * g + 8 * i));
    out.s0 = d * static_cast<float>(scales[2 * g]);
    out.s1 = d * static_cast<float>(scales[2 * g + 1]);
    out.mm = 0.0f;
  }
};
constexpr int64_t kQ6_K8 = 1014;  // our own type id: not a GGML type

// ---------------------------------------------------------------------------- dequantize

// Q4_K's 256 weights of block b into o, as `Group` would give them but with the block's scales
// and offsets unpacked once: s * q - m, rounded after the multiply and after the subtraction.
inline void q4k_dequantize(const uint8_t* b, float* o) {
  uint32_t u[3];
  std::memcpy(u, b + 4, sizeof(u));
  const uint32_t sc[2] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)};
  const uint32_t mn[2] = {u[1] & 0x3f3f3f3fu,
                          ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)};
  alignas(32) float scale[8], offset[8];
  const __m256 d = _mm256_set1_ps(f16(b)), dmin = _mm256_set1_ps(f16(b + 2));
  _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(sc)))));
  _mm256_store_ps(offset, _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(mn)))));
  const __m256i mask = _mm256_set1_epi32(15);
  for (int c = 0; c < 4; ++c) {
    const __m256 s_lo = _mm256_set1_ps(scale[2 * c]), s_hi = _mm256_set1_ps(scale[2 * c + 1]);
    const __m256 m_lo = _mm256_set1_ps(offset[2 * c]), m_hi = _mm256_set1_ps(offset[2 * c + 1]);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = bytes8_u32(b + 16 + 32 * c + 8 * i);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      _mm256_storeu_ps(o + 64 * c + 8 * i, _mm256_sub_ps(_mm256_mul_ps(s_lo, lo), m_lo));
      _mm256_storeu_ps(o + 64 * c + 32 + 8 * i, _mm256_sub_ps(_mm256_mul_ps(s_hi, hi), m_hi));
    }
  }
}

template <class Q>
void dequantize_rows(const uint8_t* blocks, int64_t row_bytes, int64_t rows, int64_t K, float* out) {
  const int64_t num_blocks = K / Q::kWeights;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t bi = 0; bi < num_blocks; ++bi) {
        const uint8_t* b = blocks + r * row_bytes + bi * Q::kBytes;
        if constexpr (std::is_same_v<Q, Q4_K>) {
          q4k_dequantize(b, out + r * K + bi * Q::kWeights);
        } else {
          for (int g = 0; g < Q::kWeights / 32; ++g) {
            Group grp;
            Q::group(b, g, grp);
            float* dst = out + r * K + bi * Q::kWeights + 32 * g;
            const __m256 mm = _mm256_set1_ps(grp.mm);
            for (int i = 0; i < 4; ++i) {
              const __m256 s = _mm256_set1_ps(i < 2 ? grp.s0 : grp.s1);
              __m256 w = _mm256_mul_ps(s, grp.q[i]);
              if (Q::kHasOffset) w = _mm256_sub_ps(w, mm);
              _mm256_storeu_ps(dst + 8 * i, w);
            }
          }
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------- linear

// The products below keep the group decoding of `Group` but work a block at a time, so the
// per-block values (scales, offsets) are unpacked once, with vector operations, and the
// accumulators are split (acc[j][0], acc[j][1]) so consecutive multiply-adds do not wait on each
// other. x points at the block's first column of activation row 0 (rows K floats apart); xs at the
// block's first group sum of row 0 (rows G floats apart).

inline __m256 dot4(const __m256* q, const float* x) {  // sum over 32 weights, 8 lanes
  __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
  t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), t);
  t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), t);
  return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), t);
}

// Formats of one group per block (Q4_0, Q4_1, Q5_0, Q8_0): parity alternates the accumulator.
template <class Q, int MT>
inline void small_block(const uint8_t* b, const float* x, const float* xs, int64_t K, int64_t G,
                        int parity, __m256 (*acc)[2], float* off) {
  Group grp;
  Q::group(b, 0, grp);
  const __m256 s = _mm256_set1_ps(grp.s0);
  for (int j = 0; j < MT; ++j) {
    acc[j][parity] = _mm256_fmadd_ps(s, dot4(grp.q, x + j * K), acc[j][parity]);
    if (Q::kHasOffset) off[j] += grp.mm * xs[j * G];
  }
}

template <int MT>
inline void q4k_block(const uint8_t* b, const float* x, const float* xs, int64_t K, int64_t G,
                      __m256 (*acc)[2], __m256* off) {
  uint32_t u[3];
  std::memcpy(u, b + 4, sizeof(u));
  // The eight 6-bit scales and mins (gguf's get_scale_min), four bytes at a time.
  const uint32_t sc[2] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)};
  const uint32_t mn[2] = {u[1] & 0x3f3f3f3fu,
                          ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)};
  alignas(32) float scale[8];
  const __m256 d = _mm256_set1_ps(f16(b)), dmin = _mm256_set1_ps(f16(b + 2));
  _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(sc)))));
  const __m256 mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(mn))));
  for (int j = 0; j < MT; ++j) off[j] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs + j * G), off[j]);
  const uint8_t* qs = b + 16;
  const __m256i mask = _mm256_set1_epi32(15);
  for (int c = 0; c < 4; ++c) {  // 32 bytes: group 2c in the low nibbles, 2c + 1 in the high
    __m256 lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256i v = bytes8_u32(qs + 32 * c + 8 * i);
      lo[i] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
      hi[i] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
    }
    const __m256 s_lo = _mm256_broadcast_ss(scale + 2 * c), s_hi = _mm256_broadcast_ss(scale + 2 * c + 1);
    for (int j = 0; j < MT; ++j) {
      const float* xj = x + j * K + 64 * c;
      acc[j][0] = _mm256_fmadd_ps(s_lo, dot4(lo, xj), acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(s_hi, dot4(hi, xj + 32), acc[j][1]);
    }
  }
}

template <int MT>
inline void q6k8_block(const uint8_t* b, const float* x, int64_t K, __m256 (*acc)[2]) {
  alignas(32) float scale[16];
  const __m256 d = _mm256_set1_ps(f16(b + 272));
  _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_i32(b + 256))));
  _mm256_store_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_i32(b + 264))));
  for (int g = 0; g < 8; ++g) {
    __m256 q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi32_ps(bytes8_i32(b + 32 * g + 8 * i));
    const __m256 s0 = _mm256_broadcast_ss(scale + 2 * g), s1 = _mm256_broadcast_ss(scale + 2 * g + 1);
    for (int j = 0; j < MT; ++j) {
      const float* xj = x + j * K + 32 * g;
      __m256 t0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(xj));
      t0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xj + 8), t0);
      __m256 t1 = _mm256_mul_ps(q[2], _mm256_loadu_ps(xj + 16));
      t1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xj + 24), t1);
      acc[j][g & 1] = _mm256_fmadd_ps(s0, t0, acc[j][g & 1]);
      acc[j][g & 1] = _mm256_fmadd_ps(s1, t1, acc[j][g & 1]);
    }
  }
}

// How far ahead of the block being multiplied its row is prefetched, in bytes: enough to cover
// memory's latency at one core's rate whatever the block size. (8 blocks ahead, as this was,
// is 272 bytes of Q8_0, and a single row's product waited on memory: bench/decode.py timed the
// 0.5B draft, Q8_0 blocks mostly, 1.18x faster at 4 KiB.)
constexpr int64_t kPrefetchAhead = 4096;

// Output row n (one weight row) for activation rows [m, m + MT): each block is decoded once and
// used by all MT rows. xsum[m][g] = sum of x[m] over group g.
template <class Q, int MT>
inline void dot_row(const uint8_t* w, const float* x, const float* xsum, int64_t K, int64_t ld,
                    int64_t n, int64_t m, float* out) {
  const int64_t num_blocks = K / Q::kWeights, G = K / 32;
  __m256 acc[MT][2], off_v[MT];
  float off[MT];
  for (int j = 0; j < MT; ++j) {
    acc[j][0] = acc[j][1] = off_v[j] = _mm256_setzero_ps();
    off[j] = 0.0f;
  }
  const float* xm = x + m * K;
  const float* xsm = xsum + m * G;
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const uint8_t* b = w + bi * Q::kBytes;
    const int64_t k = bi * Q::kWeights;
    for (int line = 0; line < Q::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchAhead + line), _MM_HINT_T0);
    if constexpr (std::is_same_v<Q, Q4_K>) {
      q4k_block<MT>(b, xm + k, xsm + k / 32, K, G, acc, off_v);
    } else if constexpr (std::is_same_v<Q, Q6_K8>) {
      q6k8_block<MT>(b, xm + k, K, acc);
    } else {
      small_block<Q, MT>(b, xm + k, xsm + k / 32, K, G, static_cast<int>(bi & 1), acc, off);
    }
  }
  for (int j = 0; j < MT; ++j) {
    const float total = horizontal_sum(_mm256_add_ps(acc[j][0], acc[j][1]));
    out[(m + j) * ld + n] = total - off[j] - horizontal_sum(off_v[j]);
  }
}

// Activation rows per pass over a weight row: one decode of each block feeds up to 8 rows.
constexpr int64_t kMaxTile = 8;

// out[m, n] (rows ld floats apart) for the N weight rows of w.
template <class Q>
void linear_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* xsum,
                 int64_t M, int64_t K, int64_t N, int64_t ld, float* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const int64_t tiles = (left + kMaxTile - 1) / kMaxTile;
        const int64_t mt = (left + tiles - 1) / tiles;  // as even as possible
        switch (mt) {
          case 8: dot_row<Q, 8>(row, x, xsum, K, ld, n, m, out); break;
          case 7: dot_row<Q, 7>(row, x, xsum, K, ld, n, m, out); break;
          case 6: dot_row<Q, 6>(row, x, xsum, K, ld, n, m, out); break;
          case 5: dot_row<Q, 5>(row, x, xsum, K, ld, n, m, out); break;
          case 4: dot_row<Q, 4>(row, x, xsum, K, ld, n, m, out); break;
          case 3: dot_row<Q, 3>(row, x, xsum, K, ld, n, m, out); break;
          case 2: dot_row<Q, 2>(row, x, xsum, K, ld, n, m, out); break;
          default: dot_row<Q, 1>(row, x, xsum, K, ld, n, m, out); break;
        }
        m += mt;
      }
    }
  });
}

template <class F>
void dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case 2: f(Q4_0{}); break;
    case 3: f(Q4_1{}); break;
    case 8: f(Q8_0{}); break;
    case 12: f(Q4_K{}); break;
    case kQ6_K8: f(Q6_K8{}); break;
    default: TORCH_CHECK(false, "quantised linear: unsupported GGML type ", qtype);
  }
}

template <class Q>
void check_blocks(const torch::Tensor& blocks, int64_t K) {
  TORCH_CHECK(K % Q::kWeights == 0, "quantised weight: ", K, " columns are not a multiple of ",
              Q::kWeights);
  TORCH_CHECK(blocks.size(1) == K / Q::kWeights * Q::kBytes, "quantised weight: rows of ",
              blocks.size(1), " bytes, expected ", K / Q::kWeights * Q::kBytes, " for ", K,
              " columns");
}

void check_tensor(const torch::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu(),
              "quantised weight: a CPU uint8 tensor [rows, bytes per row] expected");
  TORCH_CHECK(blocks.stride(1) == 1, "quantised weight: rows must be contiguous");
}

}  // namespace

// blocks [N, bytes per row] uint8 of GGML type qtype, K columns -> float32 [N, K].
torch::Tensor dequantize(torch::Tensor blocks, int64_t qtype, int64_t K) {
  check_tensor(blocks);
  auto out = torch::empty({blocks.size(0), K}, torch::dtype(torch::kFloat32));
  dispatch(qtype, [&](auto q) {
    using Q = decltype(q);
    check_blocks<Q>(blocks, K);
    dequantize_rows<Q>(blocks.data_ptr<uint8_t>(), blocks.stride(0), blocks.size(0), K,
                       out.data_ptr<float>());
  });
  return out;
}

// x [M, K] (any float dtype) @ W.T (+ bias) -> float32 [M, N], W the rows of parts[0], then of
// parts[1], ... (a fused projection whose runs of rows are in different formats, qtypes[i]).
// x is converted and its group sums taken once for all parts, and each part writes its columns
// of the one output.
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> parts,
                                 std::vector<int64_t> qtypes, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear: x [M, K] on the CPU expected");
  TORCH_CHECK(!parts.empty() && parts.size() == qtypes.size(),
              "quant_linear: one GGML type per part expected");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), G = K / 32;
  TORCH_CHECK(K % 32 == 0, "quant_linear: K must be a multiple of 32");
  int64_t N = 0;
  for (const auto& blocks : parts) {
    check_tensor(blocks);
    N += blocks.size(0);
  }
  auto out = torch::empty({M, N}, xf.options());
  // Per activation row, the sum of each group of 32: what the formats' offsets multiply.
  std::vector<float> xsum(M * G);
  const float* xp = xf.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xp + 32 * i), _mm256_loadu_ps(xp + 32 * i + 8)),
                             _mm256_add_ps(_mm256_loadu_ps(xp + 32 * i + 16), _mm256_loadu_ps(xp + 32 * i + 24)));
    xsum[i] = horizontal_sum(s);
  }
  float* op = out.data_ptr<float>();
  int64_t column = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& blocks = parts[p];
    dispatch(qtypes[p], [&](auto q) {
      using Q = decltype(q);
      check_blocks<Q>(blocks, K);
      linear_rows<Q>(blocks.data_ptr<uint8_t>(), blocks.stride(0), xp, xsum.data(), M, K,
                     blocks.size(0), N, op + column);
    });
    column += blocks.size(0);
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: a bias of ", N, " values expected");
    const auto b = bias->to(at::kFloat).contiguous();
    const float* bp = b.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) op[m * N + n] += bp[n];
  }
  return out;
}

// x [M, K] (any float dtype) @ dequantize(blocks).T -> float32 [M, N].
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype) {
  return quant_linear_parts(x, {blocks}, {qtype}, c10::nullopt);
}

namespace {

// Every block of `blocks` (format From, K columns) rewritten as a block of format To by
// convert(from_block, to_block).
template <class From, class To, class F>
torch::Tensor repack(const torch::Tensor& blocks, int64_t K, F&& convert) {
  check_tensor(blocks);
  check_blocks<From>(blocks, K);
  const int64_t N = blocks.size(0), num_blocks = K / From::kWeights;
  torch::Tensor out = torch::empty({N, num_blocks * To::kBytes}, torch::dtype(torch::kUInt8));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t src_stride = blocks.stride(0);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t bi = 0; bi < num_blocks; ++bi)
        convert(src + r * src_stride + bi * From::kBytes, dst + (r * num_blocks + bi) * To::kBytes);
  });
  return out;
}

}  // namespace

// Q6_K blocks [N, K / 256 * 210] -> the same weights as Q6_K8 blocks [N, K / 256 * 274].
torch::Tensor repack_q6_k(torch::Tensor blocks, int64_t K) {
  return repack<Q6_K, Q6_K8>(blocks, K, [](const uint8_t* b, uint8_t* o) {
    for (int g = 0; g < 8; ++g) {  // group g: half g / 4, bit pair t = g % 4 of that half
      const int half = g / 4, t = g % 4;
      const uint8_t* ql = b + 64 * half + 32 * (t & 1);
      const uint8_t* qh = b + 128 + 32 * half;
      for (int l = 0; l < 32; ++l) {
        const int low = (t >> 1) ? (ql[l] >> 4) : (ql[l] & 15);
        const int high = (qh[l] >> (2 * t)) & 3;
        o[32 * g + l] = static_cast<uint8_t>(static_cast<int8_t>((low | (high << 4)) - 32));
      }
    }
    std::memcpy(o + 256, b + 192, 16);  // scales
    std::memcpy(o + 272, b + 208, 2);   // d
  });
}

// Q5_0 blocks [N, K / 32 * 22] -> the same weights as Q8_0 blocks [N, K / 32 * 34]: the value
// d * (q - 16) is d times the int8 q - 16, which is what Q8_0 stores.
torch::Tensor repack_q5_0(torch::Tensor blocks, int64_t K) {
  return repack<Q5_0, Q8_0>(blocks, K, [](const uint8_t* b, uint8_t* o) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof(qh));
    std::memcpy(o, b, 2);  // d
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 15) | (((qh >> j) & 1) << 4);
      const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      o[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(lo - 16));
      o[2 + 16 + j] = static_cast<uint8_t>(static_cast<int8_t>(hi - 16));
    }
  });
}
