// Greedy sampling's argmax over a vocabulary of logits, for x86-64 CPUs with AVX2: torch's CPU
// argmax compares one element at a time, as slow as the rest of a decode step's sampling over a
// 152k vocabulary; this one finds the maximum 8 lanes at a time, then its first index.
//
// Same answer as torch.argmax(x, -1): the lowest index among equal maxima, and the first NaN if a
// row has one. Rows are split across torch's thread pool.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace {

template <class T>
int64_t argmax_row(const T* x, int64_t n) {
  // Pass 1: the maximum, and whether any element is NaN.
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float top = lanes[0];
  for (int k = 1; k < 8; ++k) top = std::max(top, lanes[k]);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    has_nan |= std::isnan(v);
    top = std::max(top, v);
  }
  // Pass 2: the first index holding it (or the first NaN).
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(static_cast<float>(x[j]))) return j;
  }
  const __m256 top8 = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + j), top8, _CMP_EQ_OQ));
    if (hits != 0) return j + __builtin_ctz(hits);
  }
  for (; j < n; ++j)
    if (static_cast<float>(x[j]) == top) return j;
  return 0;  // not reached: the maximum is one of the elements
}

}  // namespace

// x [rows, n] float32 or bfloat16 -> int64 [rows]: torch.argmax(x, -1).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.size(1) > 0,
              "argmax_rows: a non-empty CPU tensor [rows, n] expected");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = torch::empty({rows}, torch::dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (xc.scalar_type() == at::kFloat) {
    const float* p = xc.data_ptr<float>();
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * n, n);
    });
  } else {
    TORCH_CHECK(xc.scalar_type() == at::kBFloat16, "argmax_rows: float32 or bfloat16 expected");
    const auto* p = reinterpret_cast<const at::BFloat16*>(xc.data_ptr());
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) o[r] = argmax_row(p + r * n, n);
    });
  }
  return out;
}
