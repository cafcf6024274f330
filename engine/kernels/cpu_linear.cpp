// bfloat16- and float32-weight linear layers for x86-64 CPUs with AVX2 and FMA: a few rows of
// activations against a large weight matrix (decode and verify steps), where the time is the
// weight bytes read from memory, and prefill chunks of any length.
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x converted to float32 once, w [N, K]
// row-major as nn.Linear stores it. A bfloat16 value is the high half of a float32, so a
// weight converts with one widening move and one shift; products and sums are float32. Each
// thread takes a contiguous range of output rows (so it streams a contiguous range of weight
// memory) and, for every group of NT weight rows, loads each 8-wide chunk once and multiplies it
// with MT activation rows held in registers; for more activation rows the group's weight rows
// are read again from L1/L2, not from memory. Threads come from torch's own pool
// (at::parallel_for), so the engine keeps one OpenMP team. Every output is the same chain of
// float32 operations whatever M and the tiling are, so a row's result does not depend on the
// other rows of the step (batch invariance; a BLAS GEMM does not promise that).
//
// On CPUs with AVX-512 BF16 (avx512_bf16_enabled) the same product runs on VDPBF16PS instead,
// which multiplies 32 bfloat16 pairs exactly into float32 and adds them in one instruction, so
// the weights need no conversion at all: activations that are bfloat16 are used as they are, and
// float32 ones as three bfloat16 parts whose sum is exactly x (bf16_terms), so every product is
// still exact and only the float32 summation order differs from the AVX2 path (and is again
// the same for every row at any M).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "simd.h"

namespace {

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool isa_from_environment() {
  const char* isa = std::getenv("SPECSERVE_CPU_ISA");
  return cpu_has_avx512_bf16() && !(isa != nullptr && std::string(isa) == "avx2");
}

std::atomic<bool> g_avx512_bf16{isa_from_environment()};

// Whether bf16_linear takes its AVX-512 BF16 path: decided once per process (the CPU has AVX-512
// F/BW/VL and BF16, and SPECSERVE_CPU_ISA does not say avx2); set_cpu_isa switches it.
bool avx512_bf16_enabled() { return g_avx512_bf16.load(std::memory_order_relaxed); }

}  // namespace

// The bfloat16 linear's instruction set: "avx512bf16" or "avx2".
std::string cpu_isa() { return avx512_bf16_enabled() ? "avx512bf16" : "avx2"; }

// Switches the bfloat16 linear's instruction set (tests compare both paths; the engine keeps the
// one decided at start) and returns the previous one. avx512bf16 is refused where the CPU lacks
// it.
std::string set_cpu_isa(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512bf16", "set_cpu_isa: avx2 or avx512bf16 expected");
  TORCH_CHECK(isa == "avx2" || cpu_has_avx512_bf16(), "set_cpu_isa: this CPU has no AVX-512 BF16");
  const std::string previous = cpu_isa();
  g_avx512_bf16.store(isa == "avx512bf16");
  return previous;
}

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// A weight chunk of 8 as float32 lanes, and one weight as a float: bfloat16 (the high halves of
// float32s) or float32.
inline __m256 load_weights(const uint16_t* p) { return load_bf16(p); }
inline __m256 load_weights(const float* p) { return _mm256_loadu_ps(p); }
inline float weight_value(uint16_t v) { return bf16_to_float(v); }
inline float weight_value(float v) { return v; }

// NT weight rows [n, n + NT) times MT activation rows [m, m + MT): NT * MT accumulators, NT
// weight registers and one activation register (at most 16 ymm registers). Each output's sum is
// the same chain of multiply-adds over k whatever NT and MT are (8 lanes, in k order, then
// horizontal_sum, then the columns past the last multiple of 8 in order), so a row's result does
// not depend on how many rows share its tile or on where they sit: batch invariance.
template <class W, int NT, int MT>
inline void tile(const float* x, const W* w, float* out, int64_t K, int64_t N, int64_t n,
                 int64_t m) {
  constexpr int64_t kLine = 64 / sizeof(W), kAhead = 512 / sizeof(W);  // weights per line, ahead
  __m256 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NT];
    if ((k & (kLine - 1)) == 0) {  // one prefetch per 64-byte line, 512 bytes ahead of the loads
      for (int i = 0; i < NT; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + i) * K + k + kAhead), _MM_HINT_T0);
    }
    for (int i = 0; i < NT; ++i) wv[i] = load_weights(w + (n + i) * K + k);
    for (int j = 0; j < MT; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + (m + j) * K + k);
      for (int i = 0; i < NT; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NT; ++i) {
    for (int j = 0; j < MT; ++j) {
      float sum = horizontal_sum(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) sum += weight_value(w[(n + i) * K + k]) * x[(m + j) * K + k];
      out[(m + j) * N + n + i] = sum;
    }
  }
}

// NT weight rows against MT activation rows, MT chosen at run time (1 to 6).
template <class W, int NT>
inline void tile_rows(int64_t mt, const float* x, const W* w, float* out, int64_t K, int64_t N,
                      int64_t n, int64_t m) {
  switch (mt) {
    case 6: tile<W, NT, 6>(x, w, out, K, N, n, m); break;
    case 5: tile<W, NT, 5>(x, w, out, K, N, n, m); break;
    case 4: tile<W, NT, 4>(x, w, out, K, N, n, m); break;
    case 3: tile<W, NT, 3>(x, w, out, K, N, n, m); break;
    case 2: tile<W, NT, 2>(x, w, out, K, N, n, m); break;
    default: tile<W, NT, 1>(x, w, out, K, N, n, m); break;
  }
}

// Weight rows [n0, n1) in groups of NT against activation rows [m0, m1) in tiles of up to
// max_tile rows, as even as possible (9 rows in tiles of 6: 5 + 4, not 6 + 2 + 1): every weight
// load is then shared by as many multiply-adds as the registers allow, which is what bounds these
// shapes once they stop being bandwidth-bound. tile(group, mt, n, m) computes one tile; weight
// rows left over past the last whole group go one at a time, tile(false, 1, n, m).
template <int NT, class F>
inline void for_each_tile(int64_t max_tile, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                          F&& tile) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    for (int64_t m = m0; m < m1;) {
      const int64_t left = m1 - m;
      const int64_t tiles = (left + max_tile - 1) / max_tile;
      const int64_t mt = (left + tiles - 1) / tiles;
      tile(true, mt, n, m);
      m += mt;
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) tile(false, 1, n, m);
}

// With 2 weight rows per group the activation rows go in tiles of up to 6 (12 accumulators).
template <int NT, class W>
void row_range(const float* x, const W* w, float* out, int64_t m0, int64_t m1, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  for_each_tile<NT>(NT <= 2 ? 6 : 1, m0, m1, n0, n1, [&](bool group, int64_t mt, int64_t n, int64_t m) {
    if (group) {
      tile_rows<W, NT>(mt, x, w, out, K, N, n, m);
    } else {
      tile<W, 1, 1>(x, w, out, K, N, n, m);
    }
  });
}

// Activation rows per pass over the weights: a block of them (16 x K floats, 573 KB at K 8960)
// stays in L2 while every weight row is multiplied with it, and the weights are streamed once
// per block.
constexpr int64_t kRowBlock = 16;
// Past kRowBlock rows (prefill chunks), weight groups a thread takes at a time through every
// block of activation rows: a few KiB to a few hundred of weights, read from memory once and
// from cache by the other blocks, and one parallel region for the whole product instead of one
// per block of rows (each a wait on the slowest thread).
constexpr int64_t kGroupChunk = 16;

// The activation rows in blocks of kRowBlock, each against all the weight rows split among the
// threads in groups of 4 (one activation row: 4 weight rows in flight hide memory latency) or 2
// (more activation rows: 2 x a tile of accumulators). range(group, m0, m1, n0, n1) computes one
// thread's share of one block. How the work is split changes no output's arithmetic (`tile`).
template <class F>
void split_rows(int64_t M, int64_t N, F&& range) {
  const int64_t group = M == 1 ? 4 : 2;
  const int64_t num_groups = (N + group - 1) / group;
  if (M > kRowBlock) {
    at::parallel_for(0, num_groups, kGroupChunk, [&](int64_t begin, int64_t end) {
      for (int64_t g0 = begin; g0 < end; g0 += kGroupChunk) {
        const int64_t n0 = g0 * group, n1 = std::min(N, std::min(end, g0 + kGroupChunk) * group);
        for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) range(group, m0, std::min(M, m0 + kRowBlock), n0, n1);
      }
    });
    return;
  }
  at::parallel_for(0, num_groups, 8, [&](int64_t begin, int64_t end) {
    range(group, 0, M, begin * group, std::min(N, end * group));
  });
}

// out [M, N] float32 = x [M, K] float32 @ w [N, K].T by the AVX2 tiles.
template <class W>
void dense_linear_avx2(const float* xp, const W* wp, float* op, int64_t M, int64_t K, int64_t N) {
  split_rows(M, N, [&](int64_t group, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (group == 4) {
      row_range<4>(xp, wp, op, m0, m1, K, N, n0, n1);
    } else {
      row_range<2>(xp, wp, op, m0, m1, K, N, n0, n1);
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------- AVX-512 BF16
// Compiled for AVX-512 here only, and only called where avx512_bf16_enabled(): the rest of the
// extension stays AVX2 and loads on any x86-64 CPU with it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

// x [M, K] as bfloat16 "terms", [M, T, K] int16: x itself when it is bfloat16 (T = 1), else x
// split exactly into three bfloat16 parts (T = 3; hi + mid + lo == x, and a part times a bfloat16
// weight is exact in float32).
torch::Tensor bf16_terms(const torch::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16) {
    const auto xb = x.contiguous();
    return xb.view(at::kShort).view({xb.size(0), 1, xb.size(1)});
  }
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  auto terms = torch::empty({M, 3, K}, torch::dtype(torch::kInt16));
  const float* src = xf.data_ptr<float>();
  auto* dst = reinterpret_cast<uint16_t*>(terms.data_ptr<int16_t>());
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = src + m * K;
    uint16_t* out = dst + m * 3 * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (K - k)) - 1);
      // Truncation leaves a remainder of at most 16, then 8 significant bits: exact each time.
      const __m512 v = _mm512_maskz_loadu_ps(mask, row + k);
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high));
      const __m512 r1 = _mm512_sub_ps(v, hi);
      const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), high));
      const __m512 lo = _mm512_sub_ps(r1, mid);
      const __m512 parts[3] = {hi, mid, lo};
      for (int t = 0; t < 3; ++t) {
        const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(parts[t]), 16));
        _mm256_mask_storeu_epi16(out + t * K + k, mask, h);
      }
    }
  }
  return terms;
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// NT weight rows [n, n + NT) times MT activation rows [m, m + MT), x as T bfloat16 terms
// ([M, T, K]): NT * MT accumulators of 16 lanes, each taking 32 products per instruction.
template <int T, int NT, int MT>
inline void tile_bf16(const uint16_t* x, const uint16_t* w, float* out, int64_t K, int64_t N,
                      int64_t n, int64_t m) {
  __m512 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~0u : (1u << (K - k)) - 1;  // zeros past K add nothing
    __m512i wv[NT];
    for (int i = 0; i < NT; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + i) * K + k + 512), _MM_HINT_T0);
      wv[i] = _mm512_maskz_loadu_epi16(mask, w + (n + i) * K + k);
    }
    for (int j = 0; j < MT; ++j) {
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + ((m + j) * T + t) * K + k);
        for (int i = 0; i < NT; ++i)
          acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(wv[i]), as_bh(xv));
      }
    }
  }
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) out[(m + j) * N + n + i] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int T, int NT>
inline void tile_bf16_rows(int64_t mt, const uint16_t* x, const uint16_t* w, float* out, int64_t K,
                           int64_t N, int64_t n, int64_t m) {
  switch (mt) {
    case 8: tile_bf16<T, NT, 8>(x, w, out, K, N, n, m); break;
    case 7: tile_bf16<T, NT, 7>(x, w, out, K, N, n, m); break;
    case 6: tile_bf16<T, NT, 6>(x, w, out, K, N, n, m); break;
    case 5: tile_bf16<T, NT, 5>(x, w, out, K, N, n, m); break;
    case 4: tile_bf16<T, NT, 4>(x, w, out, K, N, n, m); break;
    case 3: tile_bf16<T, NT, 3>(x, w, out, K, N, n, m); break;
    case 2: tile_bf16<T, NT, 2>(x, w, out, K, N, n, m); break;
    default: tile_bf16<T, NT, 1>(x, w, out, K, N, n, m); break;
  }
}

// As row_range, in tiles of up to 8 activation rows (2 x 8 accumulators of the 32 registers).
template <int T, int NT>
void row_range_bf16(const uint16_t* x, const uint16_t* w, float* out, int64_t m0, int64_t m1,
                    int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for_each_tile<NT>(NT <= 2 ? 8 : 1, m0, m1, n0, n1, [&](bool group, int64_t mt, int64_t n, int64_t m) {
    if (group) {
      tile_bf16_rows<T, NT>(mt, x, w, out, K, N, n, m);
    } else {
      tile_bf16<T, 1, 1>(x, w, out, K, N, n, m);
    }
  });
}

template <int T>
void bf16_linear_avx512(const uint16_t* xp, const uint16_t* wp, float* op, int64_t M, int64_t K,
                        int64_t N) {
  split_rows(M, N, [&](int64_t group, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (group == 4) {
      row_range_bf16<T, 4>(xp, wp, op, m0, m1, K, N, n0, n1);
    } else {
      row_range_bf16<T, 2>(xp, wp, op, m0, m1, K, N, n0, n1);
    }
  });
}

}  // namespace

// out [M, N] float32 = x @ weight.T by VDPBF16PS; x as bf16_terms.
void dense_bf16dot(const torch::Tensor& terms, const uint16_t* wp, float* op, int64_t N) {
  const int64_t M = terms.size(0), T = terms.size(1), K = terms.size(2);
  const auto* xp = reinterpret_cast<const uint16_t*>(terms.data_ptr<int16_t>());
  if (T == 1) {
    bf16_linear_avx512<1>(xp, wp, op, M, K, N);
  } else {
    bf16_linear_avx512<3>(xp, wp, op, M, K, N);
  }
}

#pragma GCC pop_options

// x [M, K] (any float dtype), weight [N, K] bfloat16, bias [N] or empty -> [M, N] in x's dtype.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear: a contiguous bfloat16 weight expected");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors expected");
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, torch::dtype(torch::kFloat32));
  float* op = out.data_ptr<float>();
  if (avx512_bf16_enabled()) {
    dense_bf16dot(bf16_terms(x), wp, op, N);
  } else {
    const auto xf = x.to(at::kFloat).contiguous();
    dense_linear_avx2(xf.data_ptr<float>(), wp, op, M, K, N);
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

// x [M, K] (any float dtype), weight [N, K] float32, bias [N] or empty -> [M, N] in x's dtype:
// bf16_linear's AVX2 tiles over float32 weights, on every CPU. Each row's result is the same
// at any M (`tile`), where a BLAS GEMM picks its blocking and summation order by the shape.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "f32_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "f32_linear: a contiguous float32 weight expected");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "f32_linear: CPU tensors expected");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, torch::dtype(torch::kFloat32));
  const auto xf = x.to(at::kFloat).contiguous();
  dense_linear_avx2(xf.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

// cpu_quant.cpp
torch::Tensor dequantize(torch::Tensor blocks, int64_t qtype, int64_t K);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype);
std::string quant_isa();
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> parts,
                                 std::vector<int64_t> qtypes, c10::optional<torch::Tensor> bias);
torch::Tensor repack_q6_k(torch::Tensor blocks, int64_t K);
torch::Tensor repack_q4_k_t(torch::Tensor blocks, int64_t K);
torch::Tensor repack_q5_0(torch::Tensor blocks, int64_t K);
// cpu_quant_int8.cpp
bool int8_supported(int64_t qtype, int64_t K);
std::string int8_isa();
torch::Tensor quant_linear_int8(torch::Tensor x, std::vector<torch::Tensor> parts,
                                std::vector<int64_t> qtypes, c10::optional<torch::Tensor> bias);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor slot_mapping, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);

// Every kernel runs without Python's GIL (its arguments are converted before and its result
// after): the engine thread computes a step while the server's event loop keeps streaming.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto kFree = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("bf16_linear", &bf16_linear,
        "x @ weight.T (+ bias) with a bfloat16 weight (AVX-512 BF16 or AVX2/FMA)", kFree);
  m.def("f32_linear", &f32_linear, "x @ weight.T (+ bias) with a float32 weight (AVX2/FMA)",
        kFree);
  m.def("cpu_isa", &cpu_isa, "the bfloat16 linear's instruction set: avx512bf16 or avx2", kFree);
  m.def("set_cpu_isa", &set_cpu_isa, "switch the bfloat16 linear's instruction set; returns the previous",
        kFree);
  m.def("dequantize", &dequantize, "GGUF blocks [N, bytes] of a GGML type -> float32 [N, K]",
        kFree);
  m.def("quant_isa", &quant_isa, "the GGUF linear's instruction set for batches: avx512 or avx2", kFree);
  m.def("quant_linear", &quant_linear, "x @ dequantize(blocks).T in float32 (AVX2/FMA/F16C)",
        kFree);
  m.def("quant_linear_parts", &quant_linear_parts,
        "x @ W.T (+ bias) in float32, W's rows in runs of GGUF blocks of different types",
        kFree);
  m.def("int8_supported", &int8_supported,
        "whether GGML type qtype with K columns has an int8-activation product", kFree);
  m.def("int8_isa", &int8_isa, "the int8-activation products' instruction set: avx512vnni or avx2",
        kFree);
  m.def("quant_linear_int8", &quant_linear_int8,
        "x @ W.T (+ bias) in float32 with x quantised to int8 per 256 columns (K-quant blocks)",
        kFree);
  m.def("repack_q6_k", &repack_q6_k, "Q6_K blocks -> the same weights in our Q6_K8 layout",
        kFree);
  m.def("repack_q4_k_t", &repack_q4_k_t, "Q4_K blocks -> the same weights in our Q4_KT order",
        kFree);
  m.def("repack_q5_0", &repack_q5_0, "Q5_0 blocks -> the same weights as Q8_0 blocks",
        kFree);
  m.def("paged_attention", &paged_attention, "decode/verify attention over the paged KV cache",
        kFree);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32 or bfloat16)",
        kFree);
  m.def("rope", &rope, "x * cos + rotate_half(x) * sin",
        kFree);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up]",
        kFree);
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, -1) of float32 or bfloat16 rows",
        kFree);
}
