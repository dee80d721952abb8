// int8 keys and values read in integers on SSE2 (decode_attention_isa.h
// includes this file for its baseline path only).
//
// SSE2 has no FMA and no single-instruction int8 -> float conversion: four
// int8 values cost four instructions to become floats and two more to meet
// the query.  Here the query row is split into two int16 parts, q = unit *
// (hi + lo / 2^15), hi the nearest integer to q / unit (|hi| <= 32767, unit =
// max|q| / 32767) and lo the rest (|lo| <= 2^14), so q is held to 2^-31 of
// max|q|, finer than float32 rounds it.  A key's sixteen bytes are
// sign-extended to int16 (an unpack and a shift per eight) and multiplied
// into int32 sums by pmaddwd, two instructions per eight values for each
// part; the sums are exact (|sum| <= 128 * 32767 * 256 < 2^31 at head dim
// 256) and are converted to float once per key, four lanes at a time.
//
// Values go the same way with the roles turned: a tile's weights (softmax
// times value scale) are split into two int16 parts of unit = max weight /
// 32767, and two keys of a run at a time meet their pair of weights in one
// pmaddwd, their bytes interleaved; the tile's int32 sums (|sum| <= 2 * 128
// * 32767 * kMaxPairs < 2^31) become floats once per tile.  Either way about
// half the instructions of widening to float, and the results stay within
// float32 rounding of exact arithmetic on the stored values.

// Head dims whose int8 rows are read in integers: whole 16-byte loads.
constexpr int64_t kInt8Slab = 16;
template <int64_t kDim, typename E>
constexpr bool kIntegerInt8 = std::is_same<E, int8_t>::value && kDim > 0 && kDim % kInt8Slab == 0;

// Keys scored at once, two int32 sums each (hi, lo); the query's parts are
// read from memory by pmaddwd.  Two beat four by 4% and eight by 12% (one
// core, 8 kv heads x 64): more spill the sixteen registers.
constexpr int64_t kIntegerKeys = 2;

// q[D] as hi[D] + lo[D] / 2^15 units; returns the unit (0 for a zero row).
JSS_INLINE float split_query(const float* q, int64_t D, int16_t* hi, int16_t* lo) {
  float top = 0.0f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::abs(q[d]));
  const double unit = static_cast<double>(top) / 32767.0;
  for (int64_t d = 0; d < D; ++d) {
    const double x = top > 0.0f ? q[d] / unit : 0.0, whole = std::nearbyint(x);
    hi[d] = static_cast<int16_t>(whole);
    lo[d] = static_cast<int16_t>(std::nearbyint((x - whole) * 32768.0));
  }
  return static_cast<float>(unit);
}

// The scores, in units of the query's unit, of n int8 keys (row j at keys +
// j * stride) against a split query row, into p; past the end the last key
// is read again.
template <int64_t kDim>
JSS_INLINE void score_int8_keys(const int16_t* hi, const int16_t* lo, const int8_t* keys, int64_t n, int64_t stride,
                                float* p) {
  for (int64_t j = 0; j < n; j += kIntegerKeys) {
    __m128i big[kIntegerKeys], small[kIntegerKeys];
    for (int64_t u = 0; u < kIntegerKeys; ++u) big[u] = small[u] = _mm_setzero_si128();
    for (int64_t c = 0; c < kDim; c += 16) {
      const __m128i* h = reinterpret_cast<const __m128i*>(hi + c);  // aligned: pmaddwd reads them from memory
      const __m128i* l = reinterpret_cast<const __m128i*>(lo + c);
      for (int64_t u = 0; u < kIntegerKeys; ++u) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + std::min(j + u, n - 1) * stride + c));
        const __m128i first = _mm_srai_epi16(_mm_unpacklo_epi8(x, x), 8);  // elements 0..7 as int16
        const __m128i second = _mm_srai_epi16(_mm_unpackhi_epi8(x, x), 8);  // 8..15
        big[u] = _mm_add_epi32(big[u], _mm_add_epi32(_mm_madd_epi16(first, _mm_load_si128(h)),
                                                     _mm_madd_epi16(second, _mm_load_si128(h + 1))));
        small[u] = _mm_add_epi32(small[u], _mm_add_epi32(_mm_madd_epi16(first, _mm_load_si128(l)),
                                                         _mm_madd_epi16(second, _mm_load_si128(l + 1))));
      }
    }
    Floats sums[kIntegerKeys];
    for (int64_t u = 0; u < kIntegerKeys; ++u)
      sums[u] = (Floats)_mm_cvtepi32_ps(big[u]) + (Floats)_mm_cvtepi32_ps(small[u]) * (1.0f / 32768.0f);
    lane_sums<kIntegerKeys, kLanes>(sums, p + j);
  }
}

// A tile's weights split into int16 parts, consecutive keys of a run paired
// (a run's odd last key with a zero weight), each pair broadcast for pmaddwd.
struct PairWeights {
  static constexpr int64_t kMaxPairs = kTile / 2 + TileLayout::kMaxRuns;
  __m128i hi[kMaxPairs], lo[kMaxPairs];
};

// acc[kDim] = acc * decay + sum_j weight[j] * values(j), j < n, over a
// tile's int8 value runs; between_slabs() runs after each kInt8Slab
// elements.  Weights that are all 0, or not finite, take the float path.
template <int64_t kDim, typename Between>
JSS_INLINE void accumulate_int8_values(float* acc, float decay, const float* weight, const TileRows<int8_t>& rows,
                                       int64_t n, Between&& between_slabs) {
  float top = 0.0f;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, std::abs(weight[j]));
  if (!(top > 0.0f && top <= std::numeric_limits<float>::max())) {
    RowReader<kDim, int8_t>(nullptr, kDim, 0).accumulate(acc, decay, weight, rows, n, [] {});
    for (int64_t c = 0; c < kDim / kInt8Slab; ++c) between_slabs();
    return;
  }
  // Each weight in units as its nearest integer and the rest in 2^-15 units
  // (cvtps2dq rounds to nearest), four at a time.
  const float per_unit = 32767.0f / top, unit = top / 32767.0f;
  alignas(16) int32_t hi[kTile + 4], lo[kTile + 4];
  for (int64_t j = 0; j < n; j += 4) {
    const __m128 x = _mm_mul_ps(_mm_loadu_ps(weight + j), _mm_set1_ps(per_unit));  // past n: unused
    const __m128i whole = _mm_cvtps_epi32(x);
    _mm_store_si128(reinterpret_cast<__m128i*>(hi + j), whole);
    const __m128 rest = _mm_mul_ps(_mm_sub_ps(x, _mm_cvtepi32_ps(whole)), _mm_set1_ps(32768.0f));
    _mm_store_si128(reinterpret_cast<__m128i*>(lo + j), _mm_cvtps_epi32(rest));
  }
  const auto pair = [](const int32_t* part, int64_t j, bool second) {
    return _mm_set1_epi32(static_cast<int32_t>((part[j] & 0xffff) | (second ? static_cast<uint32_t>(part[j + 1]) << 16 : 0u)));
  };
  PairWeights w;
  for (int64_t r = 0, j0 = 0, k = 0; r < rows.count && j0 < n; j0 += rows.rows[r++]) {
    const int64_t end = j0 + std::min(rows.rows[r], n - j0);
    for (int64_t j = j0; j < end; j += 2, ++k) {
      w.hi[k] = pair(hi, j, j + 1 < end);
      w.lo[k] = pair(lo, j, j + 1 < end);
    }
  }
  for (int64_t c0 = 0; c0 < kDim; c0 += kInt8Slab) {
    __m128i big[4], small[4];  // elements c0 + 4 * i .. + 3
    for (int64_t i = 0; i < 4; ++i) big[i] = small[i] = _mm_setzero_si128();
    for (int64_t r = 0, j0 = 0, k = 0; r < rows.count && j0 < n; j0 += rows.rows[r++]) {
      const int64_t run = std::min(rows.rows[r], n - j0);
      const int8_t* base = rows.values[r] + c0;
      for (int64_t j = 0; j < run; j += 2, ++k) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + j * rows.stride));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + std::min(j + 1, run - 1) * rows.stride));
        const __m128i mixed[2] = {_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)};  // a0 b0 a1 b1 ...
        for (int64_t h = 0; h < 2; ++h) {
          const __m128i first = _mm_srai_epi16(_mm_unpacklo_epi8(mixed[h], mixed[h]), 8);  // as int16
          const __m128i second = _mm_srai_epi16(_mm_unpackhi_epi8(mixed[h], mixed[h]), 8);
          big[2 * h] = _mm_add_epi32(big[2 * h], _mm_madd_epi16(first, w.hi[k]));
          big[2 * h + 1] = _mm_add_epi32(big[2 * h + 1], _mm_madd_epi16(second, w.hi[k]));
          small[2 * h] = _mm_add_epi32(small[2 * h], _mm_madd_epi16(first, w.lo[k]));
          small[2 * h + 1] = _mm_add_epi32(small[2 * h + 1], _mm_madd_epi16(second, w.lo[k]));
        }
      }
    }
    for (int64_t i = 0; i < 4; ++i) {
      const Floats sum = (Floats)_mm_cvtepi32_ps(big[i]) + (Floats)_mm_cvtepi32_ps(small[i]) * (1.0f / 32768.0f);
      float* out = acc + c0 + 4 * i;
      store(out, load(out) * decay + sum * unit);
    }
    between_slabs();
  }
}

// An int8 query row's reader: the row split once per chunk (int8 rows are
// not asked for ahead).
template <int64_t kDim>
class RowReader<kDim, int8_t, true> {
 public:
  RowReader(const float* row, int64_t, int64_t) : unit_(split_query(row, kDim, hi_, lo_)) {}
  float unit() const { return unit_; }
  void score(const int8_t* keys, int64_t n, int64_t stride, float* p) const {
    score_int8_keys<kDim>(hi_, lo_, keys, n, stride, p);
  }
  int64_t value_steps(const TileRows<int8_t>&) const { return kDim / kInt8Slab; }
  template <typename Step>
  void accumulate(float* acc, float decay, const float* weight, const TileRows<int8_t>& rows, int64_t n,
                  Step&& step) const {
    accumulate_int8_values<kDim>(acc, decay, weight, rows, n, step);
  }

 private:
  alignas(16) int16_t hi_[kDim];
  alignas(16) int16_t lo_[kDim];
  float unit_;
};
