// One query row (or a few) against a tile's rows: the scores q . k of its
// keys (score_keys, summed across lanes by lane_sums) and the weighted sum of
// its values into an accumulator (accumulate_values, accumulate_pairs),
// joined in RowReader, through which rows_by_dot reads a tile
// (decode_attention_sse2_int8.h: its int8 specialisation on SSE2).
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it uses the vectors, elements, tiles and prefetch parts.

// Keys a query row scores at once over rows of E (JSS_PAIR_KEYS over pairs).
template <int64_t kDim, typename E>
constexpr int64_t kRowKeys = kPaired<kDim, E> ? kPairKeys : kKeys;

// The largest power of two <= n (n >= 1).
constexpr int64_t floor_pow2(int64_t n) { return n >= 2 ? 2 * floor_pow2(n / 2) : 1; }

// For each of kRows rows, over the slab of kSlab vectors from vector c0 on:
// acc = acc * decay + sum_j weight[j * stride] * values[j], j < n (row j at
// values + j * value_stride).  The rows' accumulators of the slab stay in
// registers over the tile's keys.  Where ahead is not 0, each slab of a row
// asks for the same slab ahead elements on.
template <int64_t kRows, int64_t kSlab, typename E>
JSS_INLINE void accumulate_slab(float* const* acc, const float* decay, const float* const* weight, int64_t stride,
                                const E* values, int64_t n, int64_t value_stride, int64_t c0, int64_t ahead) {
  Floats local[kRows][kSlab];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kSlab; ++c) local[r][c] = load(acc[r] + (c0 + c) * kLanes) * decay[r];
  for (int64_t j = 0; j < n; ++j) {
    if (ahead != 0) prefetch_lines(values, j * value_stride + c0 * kLanes + ahead, kSlab * kLanes * sizeof(E));
    for (int64_t c = 0; c < kSlab; ++c) {
      const Floats value = load_elements(values + j * value_stride + (c0 + c) * kLanes);
      for (int64_t r = 0; r < kRows; ++r) local[r][c] += weight[r][j * stride] * value;
    }
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < kSlab; ++c) store(acc[r] + (c0 + c) * kLanes, local[r][c]);
}

// For each of kRows rows: acc[D] = acc * decay + sum_j weight[j * stride] *
// values[j], j < n, the head dim in slabs of registers (accumulate_slab).  At
// a head dim without a build of its own (kDim = 0) each slab is one vector,
// their count read at run time (a slab of more would be one more copy of the
// loop nest for the compiler to build, per caller); the elements past the
// last whole vector go one at a time.
template <int64_t kDim, int64_t kRows, typename E = float>
JSS_INLINE void accumulate_values(float* const* acc, const float* decay, const float* const* weight, int64_t stride,
                                  const E* values, int64_t n, int64_t dim, int64_t value_stride, int64_t ahead = 0) {
  if constexpr (kDim > 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    constexpr int64_t kSlab = std::min(kChunks, floor_pow2(std::max<int64_t>(1, kRegs / kRows)));
    for (int64_t c0 = 0; c0 < kChunks; c0 += kSlab)
      accumulate_slab<kRows, kSlab>(acc, decay, weight, stride, values, n, value_stride, c0, ahead);
  } else {
    static_assert(std::is_same<E, float>::value, "any head dim: float32 tiles only");
    const int64_t vectors = dim / kLanes;
    for (int64_t c0 = 0; c0 < vectors; ++c0)
      accumulate_slab<kRows, 1>(acc, decay, weight, stride, values, n, value_stride, c0, ahead);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t d = vectors * kLanes; d < dim; ++d) acc[r][d] *= decay[r];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = vectors * kLanes; d < dim; ++d) acc[r][d] += weight[r][j * stride] * values[j * value_stride + d];
    }
  }
}

// One row's acc[kDim] = acc * decay + sum_j weight[j] * values[j], j < n, over
// bfloat16 rows (row j at values + j * stride) in the paired layout.  The
// sums start from zero and meet acc and decay only at the end, so the FMAs
// do not wait for the tile's decay; where a slab is too few registers to
// hide the FMA latency (AVX-512: 4 for a head dim of 64), kSets sets of sums
// take alternate keys.  Rows ask for their slabs ahead as accumulate_values'.
template <int64_t kDim>
JSS_INLINE void accumulate_pairs(float* acc, float decay, const float* weight, const uint16_t* values, int64_t n,
                                 int64_t stride, int64_t ahead) {
  constexpr int64_t kChunks = kDim / kLanes;
  constexpr int64_t kSlab = std::min(kChunks, kRegs);
  constexpr int64_t kSets = std::max<int64_t>(1, kRegs / kSlab);
  static_assert(kSlab % 2 == 0, "a slab holds whole pairs");
  const auto add_key = [&](Floats* sum, int64_t j, int64_t c0) {
    const uint16_t* row = values + j * stride + c0 * kLanes;
    if (ahead != 0) prefetch_lines(row, ahead, kSlab * kLanes * sizeof(uint16_t));
    for (int64_t c = 0; c < kSlab; c += 2) {
      Floats even, odd;
      load_pair(row + c * kLanes, &even, &odd);
      sum[c] += weight[j] * even;
      sum[c + 1] += weight[j] * odd;
    }
  };
  for (int64_t c0 = 0; c0 < kChunks; c0 += kSlab) {
    Floats sum[kSets][kSlab] = {};
    int64_t j = 0;
    for (; j + kSets <= n; j += kSets)
      for (int64_t s = 0; s < kSets; ++s) add_key(sum[s], j + s, c0);
    for (; j < n; ++j) add_key(sum[0], j, c0);
    for (int64_t c = 0; c < kSlab; ++c) {
      Floats total = sum[0][c];
      for (int64_t s = 1; s < kSets; ++s) total += sum[s][c];
      store(acc + (c0 + c) * kLanes, load(acc + (c0 + c) * kLanes) * decay + total);
    }
  }
}

// Lanes [0, L/2) of the result: a's groups of 2W lanes folded to W (each
// half added to the other); lanes [L/2, L): b's.
template <int W, int... J>
JSS_INLINE Floats fold_groups(Floats a, Floats b, std::integer_sequence<int, J...>) {
  constexpr int H = kLanes / 2;
  return __builtin_shufflevector(a, b, ((J < H ? 0 : kLanes) + (J % H) / W * 2 * W + J % W)...) +
         __builtin_shufflevector(a, b, ((J < H ? 0 : kLanes) + (J % H) / W * 2 * W + J % W + W)...);
}
template <int W>
JSS_INLINE Floats fold_groups(Floats a, Floats b) {
  return fold_groups<W>(a, b, std::make_integer_sequence<int, kLanes>{});
}

// The lane sums of x[0 .. N) (each lane a group of G partial sums of one
// key), stored in key order from p on (p has room for kLanes more floats):
// pairs of vectors folded into one while groups have two lanes or more,
// then a single vector folded into itself.  A transposing reduction: a
// shuffle and an add per two keys and level instead of a lane-by-lane sum.
template <int N, int G>
JSS_INLINE void lane_sums(Floats* x, float* p) {
  if constexpr (G == 1) {
    for (int i = 0; i < N; ++i) store(p + i * kLanes, x[i]);
  } else if constexpr (N > 1) {
    for (int i = 0; i < N / 2; ++i) x[i] = fold_groups<G / 2>(x[2 * i], x[2 * i + 1]);
    lane_sums<N / 2, G / 2>(x, p);
  } else {
    x[0] = fold_groups<G / 2>(x[0], x[0]);
    lane_sums<1, G / 2>(x, p);
  }
}

// The scores of a tile's n keys (row j at keys + j * stride) for one query
// row qm, into p; kAtOnce keys at once, past the end the last key is read
// again; where ahead is not 0, each key asks for the row ahead elements on.
// Over bfloat16 pairs, fewer keys at once than kKeys leave the registers for
// a second sum per key (the odd elements'): as many FMA chains as kKeys
// keys, half as long (AVX2: 7% faster than eight keys).
template <int64_t kDim, typename E = float, int64_t kAtOnce = kKeys>
JSS_INLINE void score_keys(const float* qm, const E* keys, int64_t n, int64_t dim, int64_t stride, float* p,
                           int64_t ahead) {
  if constexpr (kDim > 0) {
    for (int64_t j = 0; j < n; j += kAtOnce) {
      if (ahead != 0)
        for (int64_t u = 0; u < kAtOnce; ++u) prefetch_lines(keys, (j + u) * stride + ahead, kDim * sizeof(E));
      Floats acc[kAtOnce] = {};
      if constexpr (kPaired<kDim, E>) {  // qm in the paired layout
        constexpr bool kOddSums = kAtOnce < kKeys;
        Floats odd_acc[kAtOnce] = {};
        for (int64_t c = 0; c < kDim; c += 2 * kLanes) {
          const Floats x_even = load(qm + c), x_odd = load(qm + c + kLanes);
          for (int64_t u = 0; u < kAtOnce; ++u) {
            Floats even, odd;
            load_pair(keys + std::min(j + u, n - 1) * stride + c, &even, &odd);
            acc[u] += x_even * even;
            (kOddSums ? odd_acc[u] : acc[u]) += x_odd * odd;
          }
        }
        if constexpr (kOddSums)
          for (int64_t u = 0; u < kAtOnce; ++u) acc[u] += odd_acc[u];
      } else {
        for (int64_t c = 0; c < kDim; c += kLanes) {
          const Floats x = load(qm + c);
          for (int64_t u = 0; u < kAtOnce; ++u) acc[u] += x * load_elements(keys + std::min(j + u, n - 1) * stride + c);
        }
      }
      lane_sums<kAtOnce, kLanes>(acc, p + j);
    }
  } else {
    static_assert(std::is_same<E, float>::value, "any head dim: float32 tiles only");
    for (int64_t j = 0; j < n; ++j) {
      const float* key = keys + j * stride;
      float score = 0.0f;
#pragma omp simd reduction(+ : score)
      for (int64_t d = 0; d < dim; ++d) score += qm[d] * key[d];
      p[j] = score;
    }
  }
}

// How one query row reads a tile's runs of keys and values of E: its
// scores, in units of unit(), and the weighted sum of the values, with
// step() run after each of value_steps() parts of that work (the row's
// share of the next tile's prefetches goes between them).  Here the row as
// floats (in the paired layout over bfloat16 pairs), unit 1, and the values
// run by run, asking for the rows ahead elements on where ahead is not 0; on
// SSE2, int8 rows are read in integers instead.
template <int64_t kDim, typename E, bool kInteger = false>
class RowReader {
 public:
  RowReader(const float* row, int64_t dim, int64_t ahead) : row_(row), dim_(dim), ahead_(ahead) {}
  float unit() const { return 1.0f; }
  void score(const E* keys, int64_t n, int64_t stride, float* p) const {
    score_keys<kDim, E, kRowKeys<kDim, E>>(row_, keys, n, dim_, stride, p, ahead_);
  }
  int64_t value_steps(const TileRows<E>& rows) const { return rows.count; }
  // acc = acc * decay + sum_j weight[j] * values(j), j < n.
  template <typename Step>
  void accumulate(float* acc, float decay, const float* weight, const TileRows<E>& rows, int64_t n, Step&& step) const {
    for (int64_t r = 0, j0 = 0; r < rows.count && j0 < n; j0 += rows.rows[r++]) {
      const float* weights = weight + j0;
      const float run_decay = r == 0 ? decay : 1.0f;
      const int64_t run = std::min(rows.rows[r], n - j0);
      if constexpr (kPaired<kDim, E>) {
        accumulate_pairs<kDim>(acc, run_decay, weights, rows.values[r], run, rows.stride, ahead_);
      } else {
        accumulate_values<kDim, 1, E>(&acc, &run_decay, &weights, 1, rows.values[r], run, dim_, rows.stride, ahead_);
      }
      step();
    }
  }

 private:
  const float* row_;
  int64_t dim_, ahead_;
};
