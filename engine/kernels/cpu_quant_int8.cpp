// GGUF linears with int8 activations: the weights' K-quant blocks (Q4_K as our Q4_KT, Q6_K as
// our Q6_K8) multiplied by activations quantised to int8 per row and per 256 columns, in integer
// dot products. This is the scheme llama.cpp's CPU backend uses for these formats (its Q8_K): each
// block of 256 activations x is stored as d * q with d = max|x| / 127 and q = round(x / d) in
// [-127, 127]. A weight block is s * qw - m per sub-block (Q4_K: 8 of 32 weights with 6-bit
// integer scales sc and offsets mn, times the block's d and dmin; Q6_K8: 16 of 16 weights with
// int8 scales, times d), so a block's product is
//   d_w * d_x * sum_s sc_s * (sum_{k in s} qw_k q_k) - dmin * d_x * sum_s mn_s * (sum_{k in s} q_k),
// the first sum exact in int32, then one float multiply-add per block and row. Q6_K8: vpmaddubsw
// makes pairs of u8 weight x s8 activation products, vpmaddwd or VNNI's vpdpwssd multiplies them
// by the sub-block scale and adds pairs. Q4_KT, whose order puts every sub-block in a lane of its
// own (gguf_blocks.h): VNNI's vpdpbusd adds four products a lane, AVX2's vpmaddubsw pairs summed
// in 16 bits (8 x 2 x 15 x 127 fits), and one multiply by the 8 scales ends the block. A float32
// multiply-add per weight and row (cpu_quant.cpp) becomes a quarter to a half of an integer
// instruction, so a step of several rows (a verify step, a batch) costs far less than that many
// single-row steps.
//
// The result is that of the dequantised weights times the quantised activations, which differs
// from the float32-activation product (x @ dequantize(W).T) by the activations' rounding: as
// llama.cpp's does. What speculation needs still holds exactly: a row's result is the same
// whatever else is in the batch (the integer sums are exact, and every float operation of a row
// is the same, in the same order, for any number of rows and on either instruction set).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "simd.h"

namespace {

constexpr int64_t kQ6_K8 = 1014;  // our id for Q6_K8 (cpu_quant.cpp); kQ4_KT is in gguf_blocks.h
constexpr int64_t kBlock = 256;   // weights per block, activations per scale

// Activations [M, K] quantised per row and per kBlock columns.
struct Int8Rows {
  int64_t M = 0, K = 0, B = 0;  // B = K / kBlock blocks per row
  std::vector<int8_t> q;        // [M, K]
  std::vector<int8_t> qt;       // [M, K]: q with each block transposed as Q4_KT's weights, or empty
  std::vector<float> d;         // [M, B]: each block's scale
  std::vector<int16_t> sum16;   // [M, K / 16]: the sum of q over each 16 columns
  std::vector<float> sum32;     // [M, K / 32]: d times the sum of q over each 32 columns
};

// The rounding is lrintf's (to nearest, ties to even, the default mode), as torch.round's: the
// Python reference (engine.kernels.quantize_activations) reproduces q and d exactly. With
// `transposed`, qt too (for Q4_KT parts).
Int8Rows quantize_rows(const float* x, int64_t M, int64_t K, bool transposed) {
  Int8Rows r;
  r.M = M, r.K = K, r.B = K / kBlock;
  r.q.resize(M * K), r.d.resize(M * r.B), r.sum16.resize(M * K / 16), r.sum32.resize(M * K / 32);
  if (transposed) r.qt.resize(M * K);
  at::parallel_for(0, M * r.B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // block i: row i / B, columns (i % B) * 256 ...
      const float* xb = x + i * kBlock;      // rows are contiguous, so block i starts at 256 i
      float amax = 0.0f;
      for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = r.q.data() + i * kBlock;
      for (int k = 0; k < kBlock; ++k)
        qb[k] = static_cast<int8_t>(std::clamp(std::lrintf(xb[k] * id), -127L, 127L));
      r.d[i] = d;
      if (transposed) transpose_groups(qb, r.qt.data() + i * kBlock);
      for (int g = 0; g < kBlock / 16; ++g) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += qb[16 * g + k];
        r.sum16[i * (kBlock / 16) + g] = static_cast<int16_t>(sum);
      }
      for (int g = 0; g < kBlock / 32; ++g) {
        const int16_t* s = r.sum16.data() + i * (kBlock / 16) + 2 * g;
        r.sum32[i * (kBlock / 32) + g] = d * static_cast<float>(s[0] + s[1]);
      }
    }
  });
  return r;
}

// Q4_K's eight 6-bit sub-block scales and offsets (gguf's get_scale_min), as bytes 0-7 (scales)
// and 8-15 (offsets) of a vector.
inline __m128i q4k_scales_mins(const uint8_t* b) {
  uint32_t sc[2], mn[2];
  q4k_scale_bytes(b, sc, mn);
  return _mm_setr_epi32(static_cast<int>(sc[0]), static_cast<int>(sc[1]), static_cast<int>(mn[0]),
                        static_cast<int>(mn[1]));
}

// pshufb masks over 16-bit lanes (Q6_K8's scales): pair(g) puts element 2g in the low half's
// lanes and 2g + 1 in the high half's.
struct ShuffleMasks {
  alignas(32) uint8_t pairs[4][32];
  ShuffleMasks() {
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 32; ++i) pairs[g][i] = static_cast<uint8_t>(2 * (2 * g + (i >= 16)) + (i & 1));
  }
  __m256i pair(int g) const { return _mm256_load_si256(reinterpret_cast<const __m256i*>(pairs[g])); }
};
const ShuffleMasks g_masks;

constexpr int64_t kRowChunk = 16;  // weight rows a thread takes at a time

// Activation rows per pass over a weight row: each row holds one register (its integer sums)
// through a block, its float sums an array updated once a block (int8_products.h), so AVX2's 16
// registers take 8 rows beside the weights. AVX-512's 32 (its VL encodings of these 256-bit forms) would take
// 16, but Q6_K8's 16-row loop spills and was no faster (bench/kernels.py --gguf --int8).
namespace avx2 {
constexpr int kMaxTile = 8;
struct Ops {
  // acc + the pairwise sums of p * s (16-bit lanes, s the sub-block scales), exact in int32.
  // The add is an asm statement: as an intrinsic, GCC regroups a block's chain of adds into a
  // tree over all of its products, which holds them all at once and spills them to the stack.
  static __m256i madd_add(__m256i acc, __m256i p, __m256i s) {
    __m256i sum;
    asm("vpaddd %2, %1, %0" : "=x"(sum) : "x"(acc), "x"(_mm256_madd_epi16(p, s)));
    return sum;
  }
  // Q4_KT: acc (16-bit lanes, 2 s and 2 s + 1 for sub-block s) + the pairs of w * x products.
  // A saturating add, which never saturates here (8 x 2 x 15 x 127 < 2^15) and which, not being
  // associative, GCC keeps in order (see madd_add).
  static __m256i q4_add(__m256i acc, __m256i w, __m256i x) {
    return _mm256_adds_epi16(acc, _mm256_maddubs_epi16(w, x));
  }
  // The 8 scales (bytes 0-7) as 16-bit lanes, each twice: lanes 2 s and 2 s + 1 hold scale s.
  static __m256i q4_scales(__m128i scales_mins) {
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(scales_mins, scales_mins));
  }
  // Lane s: scale s times sub-block s's sum.
  static __m256i q4_scaled(__m256i acc, __m256i scales) { return _mm256_madd_epi16(acc, scales); }
};
#include "int8_products.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
namespace vnni {
constexpr int kMaxTile = 8;
struct Ops {
  static __m256i madd_add(__m256i acc, __m256i p, __m256i s) { return _mm256_dpwssd_epi32(acc, p, s); }
  // Q4_KT: acc (lane s for sub-block s) + the sums of four w * x products per lane.
  static __m256i q4_add(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
  static __m256i q4_scales(__m128i scales_mins) { return _mm256_cvtepu8_epi32(scales_mins); }
  static __m256i q4_scaled(__m256i acc, __m256i scales) { return _mm256_mullo_epi32(acc, scales); }
};
#include "int8_products.h"
}  // namespace vnni
#pragma GCC pop_options

// Whether the CPU has AVX-512 VNNI (with VL, for its 256-bit form) and SPECSERVE_CPU_ISA does not
// say avx2. Decided once per process; the results are the same either way.
bool int8_vnni_from_environment() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && !told_avx2();
}
const bool g_int8_vnni = int8_vnni_from_environment();

}  // namespace

// Whether a GGML type with K columns has an int8-activation product here.
bool int8_supported(int64_t qtype, int64_t K) {
  return (qtype == kQ4_KT || qtype == kQ6_K8) && K % kBlock == 0;
}

std::string int8_isa() { return g_int8_vnni ? "avx512vnni" : "avx2"; }

// x [M, K] (any float dtype) @ W.T (+ bias) -> float32 [M, N] with x quantised to int8 (above),
// W the rows of parts[0], then of parts[1], ... of GGML types qtypes[i], each int8_supported.
torch::Tensor quant_linear_int8(torch::Tensor x, std::vector<torch::Tensor> parts,
                                std::vector<int64_t> qtypes, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "quant_linear_int8: x [M, K] on the CPU expected");
  TORCH_CHECK(!parts.empty() && parts.size() == qtypes.size(),
              "quant_linear_int8: one GGML type per part expected");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  int64_t N = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& blocks = parts[p];
    TORCH_CHECK(int8_supported(qtypes[p], K), "quant_linear_int8: GGML type ", qtypes[p], " with ",
                K, " columns has no int8 product");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.device().is_cpu() &&
                    blocks.stride(1) == 1,
                "quantised weight: a CPU uint8 tensor [rows, bytes per row] expected");
    const int64_t block_bytes = qtypes[p] == kQ4_KT ? 144 : 274;
    TORCH_CHECK(blocks.size(1) == K / kBlock * block_bytes, "quantised weight: rows of ",
                blocks.size(1), " bytes, expected ", K / kBlock * block_bytes);
    N += blocks.size(0);
  }
  auto out = torch::empty({M, N}, xf.options());
  if (M == 0) return out;
  const bool transposed = std::find(qtypes.begin(), qtypes.end(), kQ4_KT) != qtypes.end();
  const Int8Rows xr = quantize_rows(xf.data_ptr<float>(), M, K, transposed);
  float* op = out.data_ptr<float>();
  int64_t column = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const auto& blocks = parts[p];
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    const int64_t row_bytes = blocks.stride(0), qtype = qtypes[p];
    float* part_out = op + column;
    at::parallel_for(0, blocks.size(0), kRowChunk, [&](int64_t begin, int64_t end) {
      for (int64_t n0 = begin; n0 < end; n0 += kRowChunk) {
        const int64_t n1 = std::min(end, n0 + kRowChunk);
        if (g_int8_vnni) {
          vnni::part_rows(w, row_bytes, qtype, xr, n0, n1, N, part_out);
        } else {
          avx2::part_rows(w, row_bytes, qtype, xr, n0, n1, N, part_out);
        }
      }
    });
    column += blocks.size(0);
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear_int8: a bias of ", N, " values expected");
    out.add_(bias->to(at::kFloat));
  }
  return out;
}
