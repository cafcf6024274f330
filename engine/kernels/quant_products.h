// The group decoders and block loops of the GGUF products (cpu_quant.cpp), written once over a
// vector type V and included twice by cpu_quant.cpp, each time in its own namespace with V
// declared: for AVX2 with V = Y8 (one activation row per 8-lane register) and, inside its
// AVX-512 region, with V = Z16 (two rows per 16-lane register: lanes 0-7 row r, lanes 8-15 row
// r + 1, the decoded weights repeated in both halves). Every operation is lane-wise until the
// final sums, which take each 8-lane half alone, so a row gets the same float32 operations in the
// same order from either: the AVX-512 form only does two rows' work per instruction where a batch
// is big enough to be bound by multiply-adds.
//
// An activation unit (V::kRows rows) starting at row m is at x + m * K, column k at offset
// k * V::kRows: for Y8 that is the row-major activations, for Z16 the rows interleaved 8 columns
// at a time (interleave_pairs). Group sums xs stay row-major (rows G floats apart).
//
// No include guard: each inclusion is a separate set of definitions.

// One group of 32 weights: q[0..3] hold q for weights 0-7, 8-15, 16-23, 24-31 (integer-valued
// floats, the format's zero point already subtracted), weights 0-15 scale by s0 and 16-31 by s1,
// and mm is subtracted from every weight (0 where the format has no offset).
struct Group {
  typename V::T q[4];
  float s0, s1, mm;
};

// Group g of a block, per format.
inline void decode(Q4_0, const uint8_t* b, int, Group& out) {
  const float d = half_to_float(b);
  const typename V::I lo = V::u8(b + 2), hi = V::u8(b + 10);
  const typename V::T eight = V::set1(8.0f);  // q - 8 is exact in float32 as in int32
  out.q[0] = V::sub(V::cvt(V::low4(lo)), eight);
  out.q[1] = V::sub(V::cvt(V::low4(hi)), eight);
  out.q[2] = V::sub(V::cvt(V::high4(lo)), eight);
  out.q[3] = V::sub(V::cvt(V::high4(hi)), eight);
  out.s0 = out.s1 = d;
  out.mm = 0.0f;
}

inline void decode(Q4_1, const uint8_t* b, int, Group& out) {
  const typename V::I lo = V::u8(b + 4), hi = V::u8(b + 12);
  out.q[0] = V::cvt(V::low4(lo));
  out.q[1] = V::cvt(V::low4(hi));
  out.q[2] = V::cvt(V::high4(lo));
  out.q[3] = V::cvt(V::high4(hi));
  out.s0 = out.s1 = half_to_float(b);
  out.mm = -half_to_float(b + 2);
}

inline void decode(Q8_0, const uint8_t* b, int, Group& out) {
  for (int i = 0; i < 4; ++i) out.q[i] = V::cvt(V::i8(b + 2 + 8 * i));
  out.s0 = out.s1 = half_to_float(b);
  out.mm = 0.0f;
}

inline void decode(Q6_K8, const uint8_t* b, int g, Group& out) {
  const auto* scales = reinterpret_cast<const int8_t*>(b + 256);
  const float d = half_to_float(b + 272);
  for (int i = 0; i < 4; ++i) out.q[i] = V::cvt(V::i8(b + 32 * g + 8 * i));
  out.s0 = d * static_cast<float>(scales[2 * g]);
  out.s1 = d * static_cast<float>(scales[2 * g + 1]);
  out.mm = 0.0f;
}

// The loops below work a block at a time, so the per-block values (scales, offsets) are unpacked
// once, and the accumulators are split (acc[j][0], acc[j][1]) so consecutive multiply-adds do not
// wait on each other. x points at the block's first column of unit 0, xs at the block's first
// group sum of row 0.

inline typename V::T dot4(const typename V::T* q, const float* x) {  // sum over 32 weights
  typename V::T t = V::mul(q[0], V::load(x));
  t = V::fmadd(q[1], V::load(x + 8 * V::kRows), t);
  t = V::fmadd(q[2], V::load(x + 16 * V::kRows), t);
  return V::fmadd(q[3], V::load(x + 24 * V::kRows), t);
}

// Formats of one group per block (Q4_0, Q4_1, Q8_0): parity alternates the accumulator.
template <class Q, int MT>
inline void small_block(const uint8_t* b, const float* x, const float* xs, int64_t K, int64_t G,
                        int parity, typename V::T (*acc)[2], float* off) {
  Group grp;
  decode(Q{}, b, 0, grp);
  const typename V::T s = V::set1(grp.s0);
  for (int j = 0; j < MT; ++j) {
    acc[j][parity] = V::fmadd(s, dot4(grp.q, x + j * V::kRows * K), acc[j][parity]);
    if (Q::kHasOffset)
      for (int r = 0; r < V::kRows; ++r) off[j * V::kRows + r] += grp.mm * xs[(j * V::kRows + r) * G];
  }
}

template <int MT>
inline void q4k_block(const uint8_t* b, const float* x, const float* xs, int64_t K, int64_t G,
                      typename V::T (*acc)[2], __m256* off) {
  alignas(32) float scale[8];
  __m256 scales, mins;
  q4k_scales(b, scales, mins);
  _mm256_store_ps(scale, scales);
  for (int r = 0; r < MT * V::kRows; ++r) off[r] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(xs + r * G), off[r]);
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; ++c) {  // 32 bytes: group 2c in the low nibbles, 2c + 1 in the high
    typename V::T lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const typename V::I v = V::u8(qs + 32 * c + 8 * i);
      lo[i] = V::cvt(V::low4(v));
      hi[i] = V::cvt(V::high4(v));
    }
    const typename V::T s_lo = V::broadcast(scale + 2 * c), s_hi = V::broadcast(scale + 2 * c + 1);
    for (int j = 0; j < MT; ++j) {
      const float* xj = x + j * V::kRows * K + V::kRows * 64 * c;
      acc[j][0] = V::fmadd(s_lo, dot4(lo, xj), acc[j][0]);
      acc[j][1] = V::fmadd(s_hi, dot4(hi, xj + V::kRows * 32), acc[j][1]);
    }
  }
}

template <int MT>
inline void q6k8_block(const uint8_t* b, const float* x, int64_t K, typename V::T (*acc)[2]) {
  alignas(32) float scale[16];
  const __m256 d = _mm256_set1_ps(half_to_float(b + 272));
  _mm256_store_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_i32(b + 256))));
  _mm256_store_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(bytes8_i32(b + 264))));
  for (int g = 0; g < 8; ++g) {
    typename V::T q[4];
    for (int i = 0; i < 4; ++i) q[i] = V::cvt(V::i8(b + 32 * g + 8 * i));
    const typename V::T s0 = V::broadcast(scale + 2 * g), s1 = V::broadcast(scale + 2 * g + 1);
    for (int j = 0; j < MT; ++j) {
      const float* xj = x + j * V::kRows * K + V::kRows * 32 * g;
      typename V::T t0 = V::mul(q[0], V::load(xj));
      t0 = V::fmadd(q[1], V::load(xj + 8 * V::kRows), t0);
      typename V::T t1 = V::mul(q[2], V::load(xj + 16 * V::kRows));
      t1 = V::fmadd(q[3], V::load(xj + 24 * V::kRows), t1);
      acc[j][g & 1] = V::fmadd(s0, t0, acc[j][g & 1]);
      acc[j][g & 1] = V::fmadd(s1, t1, acc[j][g & 1]);
    }
  }
}

// The sums of output column n (one weight row) for activation rows [m, m + MT * V::kRows), taken
// over any run of the row's blocks at a time (add), so a product can walk the columns in chunks
// while the sums wait here: stored and reloaded unchanged, they give the same result as one pass.
// Each block is decoded once and used by all the rows. xsum[m][g] = sum of x[m] over group g.
template <class Q, int MT>
struct RowSums {
  static constexpr int kRows = MT * V::kRows;
  typename V::T acc[MT][2];
  __m256 off_v[kRows];
  float off[kRows];

  void start() {
    for (int j = 0; j < MT; ++j) acc[j][0] = acc[j][1] = V::zero();
    for (int r = 0; r < kRows; ++r) {
      off_v[r] = _mm256_setzero_ps();
      off[r] = 0.0f;
    }
  }

  // Blocks [b0, b1) of weight row w.
  void add(const uint8_t* w, const float* x, const float* xsum, int64_t K, int64_t m, int64_t b0,
           int64_t b1) {
    const int64_t G = K / 32;
    typename V::T a[MT][2];
    __m256 ov[kRows];
    float o[kRows];
    std::memcpy(a, acc, sizeof(a));
    std::memcpy(ov, off_v, sizeof(ov));
    std::memcpy(o, off, sizeof(o));
    const float* xm = x + m * K;
    const float* xsm = xsum + m * G;
    for (int64_t bi = b0; bi < b1; ++bi) {
      const uint8_t* b = w + bi * Q::kBytes;
      const int64_t k = bi * Q::kWeights;
      prefetch_ahead(b, Q::kBytes);
      if constexpr (std::is_same_v<Q, Q4_K>) {
        q4k_block<MT>(b, xm + V::kRows * k, xsm + k / 32, K, G, a, ov);
      } else if constexpr (std::is_same_v<Q, Q6_K8>) {
        q6k8_block<MT>(b, xm + V::kRows * k, K, a);
      } else {
        small_block<Q, MT>(b, xm + V::kRows * k, xsm + k / 32, K, G, static_cast<int>(bi & 1), a, o);
      }
    }
    std::memcpy(acc, a, sizeof(a));
    std::memcpy(off_v, ov, sizeof(ov));
    std::memcpy(off, o, sizeof(o));
  }

  void finish(int64_t ld, int64_t n, int64_t m, float* out) const {
    for (int j = 0; j < MT; ++j) {
      float total[V::kRows];
      V::sums(V::add(acc[j][0], acc[j][1]), total);
      for (int r = 0; r < V::kRows; ++r) {
        const int row = j * V::kRows + r;
        out[(m + row) * ld + n] = total[r] - off[row] - horizontal_sum(off_v[row]);
      }
    }
  }
};
