// bfloat16-weight linear layers for x86-64 CPUs with AVX2 and FMA, the shapes of decode and
// verify steps: a few rows of activations against a large weight matrix, where the time is the
// weight bytes read from memory.
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), x converted to float32 once, w bfloat16
// [N, K] row-major as nn.Linear stores it. A bfloat16 value is the high half of a float32, so a
// weight converts with one widening move and one shift; products and sums are float32. Each
// thread takes a contiguous range of output rows (so it streams a contiguous range of weight
// memory) and, for every group of NT weight rows, loads each 8-wide chunk once and multiplies it
// with MT activation rows held in registers; for more activation rows the group's weight rows
// are read again from L1/L2, not from memory. Threads come from torch's own pool
// (at::parallel_for), so the engine keeps one OpenMP team.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// NT weight rows [n, n + NT) times MT activation rows [m, m + MT): NT * MT accumulators, NT
// weight registers and one activation register (at most 16 ymm registers).
template <int NT, int MT>
inline void tile(const float* x, const uint16_t* w, float* out, int64_t K, int64_t N, int64_t n,
                 int64_t m) {
  __m256 acc[NT][MT];
  for (int i = 0; i < NT; ++i)
    for (int j = 0; j < MT; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = K - K % 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[NT];
    if ((k & 31) == 0) {  // one prefetch per 64-byte line, 512 bytes ahead of the loads
      for (int i = 0; i < NT; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + i) * K + k + 256), _MM_HINT_T0);
    }
    for (int i = 0; i < NT; ++i) wv[i] = load_bf16(w + (n + i) * K + k);
    for (int j = 0; j < MT; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + (m + j) * K + k);
      for (int i = 0; i < NT; ++i) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < NT; ++i) {
    for (int j = 0; j < MT; ++j) {
      float sum = horizontal_sum(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) sum += bf16_to_float(w[(n + i) * K + k]) * x[(m + j) * K + k];
      out[(m + j) * N + n + i] = sum;
    }
  }
}

// NT weight rows against MT activation rows, MT chosen at run time (1 to 6).
template <int NT>
inline void tile_rows(int64_t mt, const float* x, const uint16_t* w, float* out, int64_t K,
                      int64_t N, int64_t n, int64_t m) {
  switch (mt) {
    case 6: tile<NT, 6>(x, w, out, K, N, n, m); break;
    case 5: tile<NT, 5>(x, w, out, K, N, n, m); break;
    case 4: tile<NT, 4>(x, w, out, K, N, n, m); break;
    case 3: tile<NT, 3>(x, w, out, K, N, n, m); break;
    case 2: tile<NT, 2>(x, w, out, K, N, n, m); break;
    default: tile<NT, 1>(x, w, out, K, N, n, m); break;
  }
}

// Weight rows [n0, n1) against activation rows [m0, m1). With 2 weight rows per group the
// activation rows go in tiles of up to 6 (12 accumulators), as even as possible (9 rows: 5 + 4,
// not 6 + 2 + 1): every weight load is then shared by as many multiply-adds as the registers
// allow, which is what bounds these shapes once they stop being bandwidth-bound.
template <int NT>
void row_range(const float* x, const uint16_t* w, float* out, int64_t m0, int64_t m1, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  constexpr int64_t kMaxTile = NT <= 2 ? 6 : 1;
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    for (int64_t m = m0; m < m1;) {
      const int64_t left = m1 - m;
      const int64_t tiles = (left + kMaxTile - 1) / kMaxTile;
      const int64_t mt = (left + tiles - 1) / tiles;
      tile_rows<NT>(mt, x, w, out, K, N, n, m);
      m += mt;
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = m0; m < m1; ++m) tile<1, 1>(x, w, out, K, N, n, m);
  }
}

// Activation rows per pass over the weights: a block of them (16 x K floats, 573 KB at K 8960)
// stays in L2 while every weight row is multiplied with it, and the weights are streamed once
// per block.
constexpr int64_t kRowBlock = 16;

}  // namespace

// x [M, K] (any float dtype), weight [N, K] bfloat16, bias [N] or empty -> [M, N] in x's dtype.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_linear: a contiguous bfloat16 weight expected");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors expected");
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), N = weight.size(0);
  auto out = torch::empty({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  // Work in groups of 4 weight rows (one activation row: 4 rows in flight hide memory latency)
  // or 2 (more activation rows: 2 x up to 6 accumulators).
  const int64_t group = M == 1 ? 4 : 2;
  const int64_t num_groups = (N + group - 1) / group;
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    at::parallel_for(0, num_groups, 8, [&](int64_t begin, int64_t end) {
      const int64_t n0 = begin * group, n1 = std::min(N, end * group);
      if (group == 4) {
        row_range<4>(xp, wp, op, m0, m1, K, N, n0, n1);
      } else {
        row_range<2>(xp, wp, op, m0, m1, K, N, n0, n1);
      }
    });
  }
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

// cpu_quant.cpp
torch::Tensor dequantize(torch::Tensor blocks, int64_t qtype, int64_t K);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype);
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> parts,
                                 std::vector<int64_t> qtypes, c10::optional<torch::Tensor> bias);
torch::Tensor repack_q6_k(torch::Tensor blocks, int64_t K);
torch::Tensor repack_q5_0(torch::Tensor blocks, int64_t K);
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
  m.def("bf16_linear", &bf16_linear, "x @ weight.T (+ bias) with a bfloat16 weight (AVX2/FMA)",
        kFree);
  m.def("dequantize", &dequantize, "GGUF blocks [N, bytes] of a GGML type -> float32 [N, K]",
        kFree);
  m.def("quant_linear", &quant_linear, "x @ dequantize(blocks).T in float32 (AVX2/FMA/F16C)",
        kFree);
  m.def("quant_linear_parts", &quant_linear_parts,
        "x @ W.T (+ bias) in float32, W's rows in runs of GGUF blocks of different types",
        kFree);
  m.def("repack_q6_k", &repack_q6_k, "Q6_K blocks -> the same weights in our Q6_K8 layout",
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
