// Helpers of the GGUF block products shared by cpu_quant.cpp (float32 activations) and
// cpu_quant_int8.cpp (int8 activations). Each .cpp includes this once, inside no namespace of its
// own: the functions are inline and file-local in effect.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

namespace {

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// How far ahead of the block being multiplied its row is prefetched, in bytes: enough to cover
// memory's latency at one core's rate whatever the block size. (8 blocks ahead, as this was,
// is 272 bytes of Q8_0, and a single row's product waited on memory: bench/decode.py timed the
// 0.5B draft, Q8_0 blocks mostly, 1.18x faster at 4 KiB.)
constexpr int64_t kPrefetchAhead = 4096;

// Prefetches the block kPrefetchAhead bytes past b, a cache line at a time.
inline void prefetch_ahead(const uint8_t* b, int bytes) {
  for (int line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchAhead + line), _MM_HINT_T0);
}

// A Q4_K block's eight 6-bit sub-block scales (sc) and offsets (mn) as bytes, four to a word
// (gguf's get_scale_min: packed in the 12 bytes after d and dmin, unpacked four at a time).
inline void q4k_scale_bytes(const uint8_t* b, uint32_t sc[2], uint32_t mn[2]) {
  uint32_t u[3];
  std::memcpy(u, b + 4, sizeof(u));
  const uint32_t low2 = 0x03030303u, low4 = 0x0f0f0f0fu, low6 = 0x3f3f3f3fu;
  sc[0] = u[0] & low6;
  sc[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  mn[0] = u[1] & low6;
  mn[1] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
}

// Q4_KT, our 1012 (not a GGML type): Q4_K with each block's 256 weights reordered for the
// int8-activation product (repack_q4_k_t makes it at load; the header, scales and offsets are
// Q4_K's). The weights of sub-block s are 32 s .. 32 s + 31; their group r of four, 32 s + 4 r ..
// + 3, sits at positions 32 r + 4 s .. + 3 instead: an 8 x 8 transpose of 4-weight groups, its own
// inverse. The nibbles pack the reordered weights as Q4_K packs its own (32 bytes hold positions
// 64 c .. 64 c + 31 in their low nibbles and the next 32 in their high ones), so 32 weights
// unpacked into a register hold four of every sub-block, sub-block s in 32-bit lane s: an integer
// dot product over 4 bytes per lane (vpdpbusd) never mixes two sub-blocks, and one multiply by the
// 8 sub-block scales finishes a block.
constexpr int64_t kQ4_KT = 1012;

// The transpose above over 256 values (weights or activations) of one block.
template <class T>
inline void transpose_groups(const T* in, T* out) {
  for (int s = 0; s < 8; ++s)
    for (int r = 0; r < 8; ++r) std::memcpy(out + 32 * r + 4 * s, in + 32 * s + 4 * r, 4 * sizeof(T));
}

// f(std::integral_constant<int, size>()) for 1 <= size <= Max.
template <int Max, class F>
void with_size(int64_t size, F&& f) {
  if constexpr (Max > 1) {
    if (size < Max) return with_size<Max - 1>(size, f);
  }
  f(std::integral_constant<int, Max>());
}

// f(first, size) for consecutive tiles covering [0, count), each at most Max long and as even as
// possible; size is a std::integral_constant, so f can instantiate a kernel per tile size.
template <int Max, class F>
void for_tiles(int64_t count, F&& f) {
  for (int64_t first = 0; first < count;) {
    const int64_t tiles = (count - first + Max - 1) / Max;
    const int64_t size = (count - first + tiles - 1) / tiles;
    with_size<Max>(size, [&](auto n) { f(first, n); });
    first += size;
  }
}

// Whether SPECSERVE_CPU_ISA says avx2: then the products keep their AVX2 forms on any CPU.
inline bool told_avx2() {
  const char* isa = std::getenv("SPECSERVE_CPU_ISA");
  return isa != nullptr && std::string(isa) == "avx2";
}

}  // namespace
