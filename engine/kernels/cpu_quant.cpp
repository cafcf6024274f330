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
// those two layouts are only read at load. Q4_KT (our 1012, gguf_blocks.h), the order of Q4_K's
// weights that the int8-activation product reads (`repack_q4_k_t`), is dequantised here and has
// no float32-activation product.
// On AVX-512 CPUs Q4_K has a form of its own (q4k_dot_row) and the others run batches two rows
// per register (quant_products.h). Threads come from torch's pool (at::parallel_for).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "simd.h"

namespace {

inline __m256i bytes8_u32(const uint8_t* p) {  // 8 bytes zero-extended to 8 int32 lanes
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i bytes8_i32(const uint8_t* p) {  // 8 bytes sign-extended to 8 int32 lanes
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Each format: kWeights per block, kBytes per block and kHasOffset (whether its weights have an
// offset mm: weight = s * q - mm). Their groups of 32 are decoded by `decode` (quant_products.h).

struct Q4_0 {  // weight = d * (q - 8), q in nibbles
  static constexpr int kWeights = 32, kBytes = 18;
  static constexpr bool kHasOffset = false;
};

struct Q4_1 {  // weight = d * q + m
  static constexpr int kWeights = 32, kBytes = 20;
  static constexpr bool kHasOffset = true;
};

// Q5_0 and Q6_K are served re-laid out (repack_q5_0, repack_q6_k below): their own layouts are
// only read at load, so they need no group decoder.
struct Q5_0 {  // 4 low bits in nibbles, the fifth in a 32-bit mask; weight = d * (q - 16)
  static constexpr int kWeights = 32, kBytes = 22;
};

struct Q8_0 {  // weight = d * q, q int8
  static constexpr int kWeights = 32, kBytes = 34;
  static constexpr bool kHasOffset = false;
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
};
constexpr int64_t kQ6_K8 = 1014;  // our own type id: not a GGML type

// Q4_K's weights in Q4_KT's order (gguf_blocks.h): read only by `dequantize` here.
struct Q4_KT {
  static constexpr int kWeights = 256, kBytes = 144;
};

// 128 bytes of Q4_K nibbles (positions 64 c + j low, 64 c + 32 + j high) as 256 values, and back.
inline void unpack_nibbles(const uint8_t* qs, uint8_t* v) {
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 32; ++j) {
      v[64 * c + j] = qs[32 * c + j] & 15;
      v[64 * c + 32 + j] = qs[32 * c + j] >> 4;
    }
}

inline void pack_nibbles(const uint8_t* v, uint8_t* qs) {
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 32; ++j)
      qs[32 * c + j] = static_cast<uint8_t>(v[64 * c + j] | (v[64 * c + 32 + j] << 4));
}

// A Q4_K block as Q4_KT, or a Q4_KT block as Q4_K (the transpose is its own inverse).
inline void transpose_q4_block(const uint8_t* b, uint8_t* o) {
  uint8_t values[256], moved[256];
  std::memcpy(o, b, 16);  // d, dmin, scales and offsets
  unpack_nibbles(b + 16, values);
  transpose_groups(values, moved);
  pack_nibbles(moved, o + 16);
}

// A Q4_K block's eight sub-block scales d * sc and offsets dmin * m (gguf's get_scale_min: 6-bit
// values, q4k_scale_bytes), each rounded after its multiply.
inline void q4k_scales(const uint8_t* b, __m256& scales, __m256& mins) {
  uint32_t sc[2], mn[2];
  q4k_scale_bytes(b, sc, mn);
  scales = _mm256_mul_ps(_mm256_set1_ps(half_to_float(b)), _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(sc))));
  mins = _mm256_mul_ps(_mm256_set1_ps(half_to_float(b + 2)), _mm256_cvtepi32_ps(bytes8_u32(reinterpret_cast<const uint8_t*>(mn))));
}

// One activation row per 8-lane register: the AVX2 form of the products, and the dequantiser's.
struct Y8 {
  using T = __m256;
  using I = __m256i;
  static constexpr int kRows = 1;
  static I u8(const uint8_t* p) { return bytes8_u32(p); }
  static I i8(const uint8_t* p) { return bytes8_i32(p); }
  static I low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
  static I high4(I v) { return _mm256_srli_epi32(v, 4); }
  static T cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T set1(float s) { return _mm256_set1_ps(s); }
  // From memory: a load-port broadcast (set1 of a value just stored may become shuffles).
  static T broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void sums(T v, float* out) { out[0] = horizontal_sum(v); }
};

namespace avx2 {
using V = Y8;
#include "quant_products.h"
}  // namespace avx2

// ---------------------------------------------------------------------------- dequantize

// Q4_K's 256 weights of block b into o, as `Group` would give them but with the block's scales
// and offsets unpacked once: s * q - m, rounded after the multiply and after the subtraction.
inline void q4k_dequantize(const uint8_t* b, float* o) {
  alignas(32) float scale[8], offset[8];
  __m256 scales, mins;
  q4k_scales(b, scales, mins);
  _mm256_store_ps(scale, scales);
  _mm256_store_ps(offset, mins);
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
        } else if constexpr (std::is_same_v<Q, Q4_KT>) {
          uint8_t q4_k[144];  // back in Q4_K's order: the same values, by the same operations
          transpose_q4_block(b, q4_k);
          q4k_dequantize(q4_k, out + r * K + bi * Q::kWeights);
        } else {
          for (int g = 0; g < Q::kWeights / 32; ++g) {
            avx2::Group grp;
            avx2::decode(Q{}, b, g, grp);
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

// Whether the CPU has AVX-512 F and DQ and SPECSERVE_CPU_ISA does not say avx2: then Q4_K takes
// its 16-lane form and the other formats' batches of kPairRows rows or more the two-rows-per-
// register form. Decided once per process.
bool quant_avx512_from_environment() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && !told_avx2();
}
const bool g_quant_avx512 = quant_avx512_from_environment();

// From this many activation rows on, the AVX-512 form is faster: below it a block's decoding,
// not the multiply-adds, bounds the product, and AVX2 has three vector ports to AVX-512's two.
// Row pairs per pass over a weight row in the AVX-512 form: past 4, registers spill. Both chosen
// on an AVX-512 Xeon (GB/s of weights at 1-16 rows, Q4_K, Q6_K8 and Q8_0): 2 rows were slower
// as a pair than as AVX2 rows; 6 and 8 pairs per pass slower than 3 + 3 and 4 + 4.
constexpr int64_t kPairRows = 4;
constexpr int64_t kMaxPairs = 4;

// Rows [0, 2 * pairs) of x [M, K] as pairs, 8 columns of one row then the same 8 of the next.
void interleave_pairs(const float* x, int64_t pairs, int64_t K, float* out) {
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t k = 0; k < K; k += 8)
      for (int r = 0; r < 2; ++r)
        std::memcpy(out + 2 * p * K + 2 * k + 8 * r, x + (2 * p + r) * K + k, 8 * sizeof(float));
}

// Weight rows a thread takes at a time: each tile of activation rows runs over all of them, so
// they are read from memory once and from cache by the other tiles.
constexpr int64_t kRowChunk = 16;

// Columns a pass takes at a time over the kRowChunk weight rows, where a tile's activations are
// bigger than kOnePassBytes: the tile's activations for one chunk (at most 8 rows of 1024
// floats, 32 KiB) stay in L1 across the weight rows, where a whole row of a wide product (the
// MLP's down projection: 8960 columns, 215 KiB for 6 rows) would be read from L2 again for
// every weight row (`python -m bench.kernels --gguf` times that projection as its Q6_K8 table).
constexpr int64_t kColumnChunk = 1024;
// A tile whose activations are no bigger than this (bytes) is taken in one pass: they stay in
// L1 and L2 anyway, and one pass prefetches each weight row straight through.
constexpr int64_t kOnePassBytes = 64 << 10;

// Output columns [n0, n1) (at most kRowChunk) for one tile of activation rows, K columns of
// num_blocks blocks: each weight row's Sums started, advanced over a chunk of blocks for all the
// weight rows in turn, then over the next chunk, and finished. add(sums, n, b0, b1) takes blocks
// [b0, b1) of weight row n; the sums wait unchanged between chunks, so the result equals one
// pass over all the blocks (which small tiles take).
template <class Sums, class Add, class Finish>
inline void by_column_chunks(int64_t n0, int64_t n1, int64_t K, int64_t num_blocks, int64_t chunk_blocks,
                             Add&& add, Finish&& finish) {
  if (Sums::kRows * K * static_cast<int64_t>(sizeof(float)) <= kOnePassBytes) {
    for (int64_t n = n0; n < n1; ++n) {
      Sums sums;
      sums.start();
      add(sums, n, 0, num_blocks);
      finish(sums, n);
    }
    return;
  }
  Sums sums[kRowChunk];
  for (int64_t n = n0; n < n1; ++n) sums[n - n0].start();
  for (int64_t b0 = 0; b0 < num_blocks; b0 += chunk_blocks)
    for (int64_t n = n0; n < n1; ++n) add(sums[n - n0], n, b0, std::min(num_blocks, b0 + chunk_blocks));
  for (int64_t n = n0; n < n1; ++n) finish(sums[n - n0], n);
}

// Compiled for AVX-512 here only, and only called where g_quant_avx512: the rest of the file
// stays AVX2, so the extension still loads on CPUs without AVX-512.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")

// Two activation rows per 16-lane register, the weights repeated in both halves: 8 bytes are
// loaded into both 64-bit halves of a 128-bit register (a load, no shuffle) and widened to 16
// lanes.
struct Z16 {
  using T = __m512;
  using I = __m512i;
  static constexpr int kRows = 2;
  static __m128i twice(const uint8_t* p) {
    return _mm_castpd_si128(_mm_loaddup_pd(reinterpret_cast<const double*>(p)));
  }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(twice(p)); }
  static I i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(twice(p)); }
  static I low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
  static I high4(I v) { return _mm512_srli_epi32(v, 4); }
  static T cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T set1(float s) { return _mm512_set1_ps(s); }
  static T broadcast(const float* p) { return _mm512_broadcastss_ps(_mm_load_ss(p)); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void sums(T v, float* out) {
    out[0] = horizontal_sum(_mm512_castps512_ps256(v));
    out[1] = horizontal_sum(_mm512_extractf32x8_ps(v, 1));
  }
};

namespace avx512 {
using V = Z16;
#include "quant_products.h"
}  // namespace avx512

// Output columns [n0, n1) for activation rows [0, 2 * pairs), xi their interleave_pairs.
template <class Q>
void dot_rows_pairs(const uint8_t* w, int64_t row_bytes, const float* xi, const float* xsum,
                    int64_t K, int64_t ld, int64_t n0, int64_t n1, int64_t pairs, float* out) {
  for_tiles<kMaxPairs>(pairs, [&](int64_t first, auto size) {
    using Sums = avx512::RowSums<Q, decltype(size)::value>;
    by_column_chunks<Sums>(
        n0, n1, K, K / Q::kWeights, std::max<int64_t>(1, kColumnChunk / Q::kWeights),
        [&](Sums& sums, int64_t n, int64_t b0, int64_t b1) {
          sums.add(w + n * row_bytes, xi, xsum, K, 2 * first, b0, b1);
        },
        [&](const Sums& sums, int64_t n) { sums.finish(ld, n, 2 * first, out); });
  });
}

// Q4_K with one activation row per 16-lane register, at any number of rows. Its weights are
// nibbles 0..15, and a 16-lane permute (vpermps) reads only the low 4 bits of each index lane, so
// permuting the table 0, 1, ..., 15 turns the nibble at the bottom of each 32-bit lane into its
// float: a 64-byte load of quants shifted right by 0, 4, ..., 28 bits gives 8 vectors of 16
// weights with a shift and a permute each, on the two AVX-512 ports without competing (the AVX2
// form spends a widening load, a mask or shift and a conversion per 8 weights). Lane i of the
// load holding bytes 64h + 4i ... 64h + 4i + 3 of the block's quants, vector p takes byte
// 64h + 4i + p / 2, its low nibble for even p: weight 64 (2h + i / 8) + 32 (p % 2) + 4 (i % 8) +
// p / 2, of sub-block 4h + 2 (i / 8) + p % 2. So the activations are permuted once per product
// to that order (q4k_permute); per row the vectors of even p are summed into t0 and of odd p into
// t1, each then scaled by a register holding its lanes' two sub-block scales; the offsets take
// the group sums as in the AVX2 form. The 8 weight vectors of a half block are made once for all
// the rows of a pass, and a row gets the same operations in the same order however many rows
// share it; on AVX-512 CPUs every Q4_K product takes this form, so single rows and batches agree.
// On an AVX-512 Xeon (`python -m bench.kernels --gguf`, the Q4_K table) it reads 1.24x as fast
// as the AVX2 form at 1 row and 1.36-1.49x at 2-16. Rows per pass: 6 (8 measured no faster).
constexpr int64_t kMaxQ4KTile = 6;

// Each row of x [M, K] in the order above, block by block.
void q4k_permute(const float* x, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K; b += 256)
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < 8; ++p)
          for (int i = 0; i < 16; ++i)
            out[m * K + b + 128 * h + 16 * p + i] =
                x[m * K + b + 64 * (2 * h + i / 8) + 32 * (p % 2) + 4 * (i % 8) + p / 2];
}

// The sums of output column n for rows [m, m + MT) of the permuted activations xp, over any run
// of blocks at a time (as RowSums).
template <int MT>
struct Q4KSums {
  static constexpr int kRows = MT;
  __m512 acc[MT];
  __m256 off[MT];

  void start() {
    for (int j = 0; j < MT; ++j) {
      acc[j] = _mm512_setzero_ps();
      off[j] = _mm256_setzero_ps();
    }
  }

  void add(const uint8_t* w, const float* xp, const float* xsum, int64_t K, int64_t m, int64_t b0,
           int64_t b1) {
    const int64_t G = K / 32;
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Lanes 0-7 from sub-block 4h + nib, lanes 8-15 from 4h + 2 + nib: index [2h + nib].
    const __m512i pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
        _mm512_setr_epi32(5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7)};
    __m512 a[MT];
    __m256 o[MT];
    std::memcpy(a, acc, sizeof(a));
    std::memcpy(o, off, sizeof(o));
    const float* xm = xp + m * K;
    const float* xsm = xsum + m * G;
    for (int64_t bi = b0; bi < b1; ++bi) {
      const uint8_t* b = w + bi * Q4_K::kBytes;
      prefetch_ahead(b, Q4_K::kBytes);
      __m256 scales, mins;
      q4k_scales(b, scales, mins);
      const __m512 scale = _mm512_castps256_ps512(scales);
      for (int j = 0; j < MT; ++j) o[j] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xsm + j * G + bi * 8), o[j]);
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(b + 16 + 64 * h);
        __m512 wv[8];
        wv[0] = _mm512_permutexvar_ps(v, table);
        for (int p = 1; p < 8; ++p) wv[p] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * p), table);
        const __m512 s0 = _mm512_permutexvar_ps(pick[2 * h], scale);
        const __m512 s1 = _mm512_permutexvar_ps(pick[2 * h + 1], scale);
        for (int j = 0; j < MT; ++j) {
          const float* xh = xm + j * K + bi * 256 + 128 * h;
          __m512 t0 = _mm512_mul_ps(wv[0], _mm512_loadu_ps(xh));
          __m512 t1 = _mm512_mul_ps(wv[1], _mm512_loadu_ps(xh + 16));
          for (int p = 2; p < 8; p += 2) {
            t0 = _mm512_fmadd_ps(wv[p], _mm512_loadu_ps(xh + 16 * p), t0);
            t1 = _mm512_fmadd_ps(wv[p + 1], _mm512_loadu_ps(xh + 16 * p + 16), t1);
          }
          a[j] = _mm512_fmadd_ps(s0, t0, a[j]);
          a[j] = _mm512_fmadd_ps(s1, t1, a[j]);
        }
      }
    }
    std::memcpy(acc, a, sizeof(a));
    std::memcpy(off, o, sizeof(o));
  }

  void finish(int64_t ld, int64_t n, int64_t m, float* out) const {
    for (int j = 0; j < MT; ++j) {
      const __m256 total = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
      out[(m + j) * ld + n] = horizontal_sum(total) - horizontal_sum(off[j]);
    }
  }
};

// Output columns [n0, n1) for all M rows of the permuted activations.
void q4k_dot_rows(const uint8_t* w, int64_t row_bytes, const float* xp, const float* xsum,
                  int64_t M, int64_t K, int64_t ld, int64_t n0, int64_t n1, float* out) {
  for_tiles<kMaxQ4KTile>(M, [&](int64_t first, auto size) {
    using Sums = Q4KSums<decltype(size)::value>;
    by_column_chunks<Sums>(
        n0, n1, K, K / 256, std::max<int64_t>(1, kColumnChunk / 256),
        [&](Sums& sums, int64_t n, int64_t b0, int64_t b1) {
          sums.add(w + n * row_bytes, xp, xsum, K, first, b0, b1);
        },
        [&](const Sums& sums, int64_t n) { sums.finish(ld, n, first, out); });
  });
}

#pragma GCC pop_options

// Activation rows per pass over a weight row in the AVX2 form: one decode of each block feeds up
// to 8 rows.
constexpr int64_t kMaxTile = 8;

// out[m, n] (rows ld floats apart) for the N weight rows of w. xi: rows [0, M / 2 * 2) of x as
// interleave_pairs made them, for the AVX-512 form, or null for AVX2 throughout.
// xq: x as q4k_permute made it where Q is Q4_K on an AVX-512 CPU (then every row takes that
// form), else null.
template <class Q>
void linear_rows(const uint8_t* w, int64_t row_bytes, const float* x, const float* xi,
                 const float* xq, const float* xsum, int64_t M, int64_t K, int64_t N, int64_t ld,
                 float* out) {
  const int64_t pairs = xi != nullptr ? M / 2 : 0;
  at::parallel_for(0, N, kRowChunk, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowChunk) {
      const int64_t n1 = std::min(end, n0 + kRowChunk);
      if (std::is_same_v<Q, Q4_K> && xq != nullptr) {  // K % 256 == 0 where xq is made
        q4k_dot_rows(w, row_bytes, xq, xsum, M, K, ld, n0, n1, out);
        continue;
      }
      if (pairs > 0) dot_rows_pairs<Q>(w, row_bytes, xi, xsum, K, ld, n0, n1, pairs, out);
      for_tiles<kMaxTile>(M - 2 * pairs, [&](int64_t first, auto size) {
        using Sums = avx2::RowSums<Q, decltype(size)::value>;
        const int64_t m = 2 * pairs + first;
        by_column_chunks<Sums>(
            n0, n1, K, K / Q::kWeights, std::max<int64_t>(1, kColumnChunk / Q::kWeights),
            [&](Sums& sums, int64_t n, int64_t b0, int64_t b1) {
              sums.add(w + n * row_bytes, x, xsum, K, m, b0, b1);
            },
            [&](const Sums& sums, int64_t n) { sums.finish(ld, n, m, out); });
      });
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
    case kQ4_KT:
      TORCH_CHECK(false, "quantised linear: Q4_KT blocks (Q4_K in the int8-activation product's "
                  "order) have no float32-activation product");
      break;
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
  if (qtype == kQ4_KT) {
    check_blocks<Q4_KT>(blocks, K);
    dequantize_rows<Q4_KT>(blocks.data_ptr<uint8_t>(), blocks.stride(0), blocks.size(0), K,
                           out.data_ptr<float>());
    return out;
  }
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
  // torch's allocator aligns to 64 bytes: each 16-lane load then reads one cache line, not two.
  // On AVX-512 CPUs the Q4_K parts take their own form, from activations permuted for it, and
  // the other parts' batches pairs, from interleaved ones: each is made only if a part reads it.
  const auto own_form = [&](int64_t qtype) { return g_quant_avx512 && qtype == 12 && K % 256 == 0; };
  torch::Tensor interleaved;
  if (g_quant_avx512 && M >= kPairRows && !std::all_of(qtypes.begin(), qtypes.end(), own_form)) {
    interleaved = torch::empty({M / 2 * 2 * K}, xf.options());
    interleave_pairs(xp, M / 2, K, interleaved.data_ptr<float>());
  }
  const float* xi = interleaved.defined() ? interleaved.data_ptr<float>() : nullptr;
  torch::Tensor permuted;
  if (std::any_of(qtypes.begin(), qtypes.end(), own_form)) {
    permuted = torch::empty({M * K}, xf.options());
    q4k_permute(xp, M, K, permuted.data_ptr<float>());
  }
  const float* xq = permuted.defined() ? permuted.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  int64_t column = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& blocks = parts[p];
    dispatch(qtypes[p], [&](auto q) {
      using Q = decltype(q);
      check_blocks<Q>(blocks, K);
      linear_rows<Q>(blocks.data_ptr<uint8_t>(), blocks.stride(0), xp, xi, xq, xsum.data(), M,
                     K, blocks.size(0), N, op + column);
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

// The instruction set of the GGUF products: "avx512" (Q4_K's 16-lane form at every size, the
// other formats' pairs from kPairRows rows) or "avx2".
std::string quant_isa() { return g_quant_avx512 ? "avx512" : "avx2"; }

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

// Q4_K blocks [N, K / 256 * 144] -> the same weights in Q4_KT's order, as many bytes.
torch::Tensor repack_q4_k_t(torch::Tensor blocks, int64_t K) {
  return repack<Q4_K, Q4_KT>(blocks, K, transpose_q4_block);
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
