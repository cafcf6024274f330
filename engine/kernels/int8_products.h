// The int8-activation products of cpu_quant_int8.cpp, written once over `Ops` (the integer steps
// each instruction set does its own way: AVX2's vpmaddubsw, vpmaddwd and adds; AVX-512 VNNI's
// vpdpbusd and vpdpwssd) and included twice by it, each time in its own namespace with Ops
// declared, the second time inside its AVX-512 VNNI region, so the compiler inlines the VNNI
// instructions into the loops. Both give the same integers, and so the same results.
//
// No include guard: each inclusion is a separate set of definitions.

// The loops over one weight row's blocks for MT activation rows (rows m .. m + MT - 1 of xr),
// per format; the column's float sums are left in acc[8 j .. 8 j + 7] per row, an array the
// compiler may keep in memory: updated once a block, they need no register through it, where
// each row's integer sums need one.
//
// Q4_KT (gguf_blocks.h): each 32 unpacked weights hold four of every sub-block, sub-block s in
// lane s, and the activations come transposed alike (xr.qt), so the products of a block add up
// per sub-block in Ops's accumulator, which `scaled` turns into lane s = sc_s * (sub-block s's
// integer dot product), exact in int32. One integer multiply-add per 32 weights and row where
// Q4_K's own order needs two (each register one sub-block: products, then times its scale).
template <int MT>
inline void q4kt_row(const uint8_t* w, int64_t num_blocks, const Int8Rows& xr, int64_t m,
                     float* acc) {
  const __m256i nibble = _mm256_set1_epi8(15);
  const int64_t K = xr.K, B = xr.B;
  const int8_t* xq = xr.qt.data() + m * K;  // row m's activations, transposed per block
  const float* xd = xr.d.data() + m * B;
  const float* xs = xr.sum32.data() + m * B * 8;
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const uint8_t* b = w + bi * 144;
    prefetch_ahead(b, 144);
    const __m128i scales_mins = q4k_scales_mins(b);
    const int8_t* xbi = xq + bi * kBlock;
    __m256i dot[MT];
    for (int j = 0; j < MT; ++j) dot[j] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {  // 32 bytes: 32 weights in the low nibbles, 32 in the high
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      const __m256i lo = _mm256_and_si256(v, nibble);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int j = 0; j < MT; ++j) {
        const int8_t* x = xbi + j * K + 64 * c;
        dot[j] = Ops::q4_add(dot[j], lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        dot[j] = Ops::q4_add(dot[j], hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
      }
    }
    const __m256i scales = Ops::q4_scales(scales_mins);
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const __m256 mins = _mm256_mul_ps(
        _mm256_set1_ps(dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales_mins, 8))));
    for (int j = 0; j < MT; ++j) {
      const __m256 total = _mm256_cvtepi32_ps(Ops::q4_scaled(dot[j], scales));
      __m256 a = _mm256_fmadd_ps(total, _mm256_set1_ps(d * xd[j * B + bi]), _mm256_load_ps(acc + 8 * j));
      a = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(xs + (j * B + bi) * 8), a);
      _mm256_store_ps(acc + 8 * j, a);
    }
  }
}

template <int MT>
inline void q6k8_row(const uint8_t* w, int64_t num_blocks, const Int8Rows& xr, int64_t m,
                     float* acc) {
  const __m256i bias = _mm256_set1_epi8(32);  // stored q - 32 in [-32, 31] -> q in [0, 63]
  const int64_t K = xr.K, B = xr.B;
  const int8_t* xq = xr.q.data() + m * K;  // row m's activations
  const float* xd = xr.d.data() + m * B;
  const int16_t* xs = xr.sum16.data() + m * B * 16;
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const uint8_t* b = w + bi * 274;
    prefetch_ahead(b, 274);
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 256)));
    // Scales 0-7 and 8-15, each 8 in both halves, for the shuffles that pick a pair of them.
    const __m256i first = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales));
    const __m256i second = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scales, 1));
    const int8_t* xbi = xq + bi * kBlock;
    __m256i dot[MT];
    for (int j = 0; j < MT; ++j) dot[j] = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {  // 32 weights: scale 2g for the first 16, 2g + 1 for the rest
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * g));
      const __m256i q = _mm256_add_epi8(v, bias);
      const __m256i s = _mm256_shuffle_epi8(g < 4 ? first : second, g_masks.pair(g % 4));
      for (int j = 0; j < MT; ++j) {
        const int8_t* x = xbi + j * K + 32 * g;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        dot[j] = Ops::madd_add(dot[j], _mm256_maddubs_epi16(q, xv), s);
      }
    }
    // sum_k (q_k - 32) x_k = sum_k q_k x_k - 32 sum_k x_k, per scale group of 16.
    const __m256i scales32 = _mm256_slli_epi16(scales, 5);
    const float d = half_to_float(b + 272);
    for (int j = 0; j < MT; ++j) {
      const int64_t xb = j * B + bi;
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + xb * 16));
      const __m256i total = _mm256_sub_epi32(dot[j], _mm256_madd_epi16(scales32, sums));
      _mm256_store_ps(acc + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * xd[xb]),
                                                   _mm256_load_ps(acc + 8 * j)));
    }
  }
}

// Output columns [n0, n1) of one part (weight rows of format qtype) for every activation row,
// kMaxTile rows per pass over a weight row, into out (rows ld apart).
inline void part_rows(const uint8_t* w, int64_t row_bytes, int64_t qtype, const Int8Rows& xr,
                      int64_t n0, int64_t n1, int64_t ld, float* out) {
  for_tiles<kMaxTile>(xr.M, [&](int64_t m, auto mt) {
    constexpr int MT = decltype(mt)::value;
    alignas(32) float acc[8 * MT];
    for (int64_t n = n0; n < n1; ++n) {
      for (int j = 0; j < MT; ++j) _mm256_store_ps(acc + 8 * j, _mm256_setzero_ps());
      if (qtype == kQ4_KT) {
        q4kt_row<MT>(w + n * row_bytes, xr.B, xr, m, acc);
      } else {
        q6k8_row<MT>(w + n * row_bytes, xr.B, xr, m, acc);
      }
      for (int j = 0; j < MT; ++j) out[(m + j) * ld + n] = horizontal_sum(_mm256_load_ps(acc + 8 * j));
    }
  });
}
