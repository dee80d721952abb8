// A chunk's online softmax over its tiles: per query row a running max, sum
// and accumulator, rescaled by the exp of the max's change each tile
// (exp_clamped), for few query rows (rows_by_dot: a dot product per key and
// row, through RowReader) and for many (rows_in_lanes: rows in the lanes).
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it uses every part included before it.

// exp(x) for x in [-88, 0] (a float or a vector), ~2 ulp; exactly 0 below
// about -87.7.  No calls and no branches; callers clamp first.
template <typename F>
JSS_INLINE F exp_clamped(F x) {
  const IntsOf<F> n = to_int<F>(x * 1.44269504f - 0.5f);  // round(x / ln 2), x <= 0
  const F r = x - to_float<F>(n) * 0.693359375f + to_float<F>(n) * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float<F>((n + 127) << 23);  // 2^n; +0 at n = -127
}

JSS_INLINE float exp_nonpositive(float x) { return exp_clamped<float>(std::max(x, kExpFloor)); }

// The largest of x[0, n): a vector of running maxima (a scalar one is a
// chain through memory where registers run short).
JSS_INLINE float largest(const float* x, int64_t n) {
  Floats tops = Floats{} + kNegInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) tops = vmax(tops, load(x + j));
  float top = kNegInf;
  for (int64_t i = 0; i < kLanes; ++i) top = std::max(top, tops[i]);
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// Few query rows (T = 1 decoding): a dot product per key and row; tiles are
// the outer loop, so each tile is fetched once for all rows, in place where
// it lies (float32; E = uint16_t: bfloat16, E = int8_t: int8, widened in
// registers; pages up to their end): a pass through the tile buffer costs
// more than the FMAs of so few rows.  A quantized tile's key scales multiply the scores,
// its value scales the weights (after their sum is taken).  The count pairs
// (the kv heads of a paged cache's batch row, or one pair) share their keys'
// range and take each tile in turn, so a page's rows of every head, which
// lie together, are read together.
template <int64_t kDim, typename E = float>
JSS_INLINE void rows_by_dot(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim) {
  const int64_t D = kDim > 0 ? kDim : dim;
  constexpr bool kPairRows = std::is_same<E, uint16_t>::value;
  constexpr int64_t kRowTile = kPairRows ? kPairTile : kTile;
  constexpr int64_t kDenseTile = kPairRows ? kDensePairTile : kDenseFloatTile;
  float p[std::max(kRowTile, kDenseTile) + kRowKeys<kDim, E> + kLanes];  // a tile's scores, then its weights
  std::vector<float> paired_q, tmp;
  if constexpr (kPaired<kDim, E>) {
    paired_q.resize(count * M * D);
    tmp.resize(D);
    for (int64_t i = 0; i < count; ++i) {
      std::copy(ins[i].q.begin(), ins[i].q.end(), paired_q.begin() + i * M * D);
      for (int64_t m = 0; m < M; ++m) paired_order(paired_q.data() + (i * M + m) * D, D, true, tmp.data());
    }
  }
  using Reader = RowReader<kDim, E, kIntegerInt8<kDim, E>>;
  const ChunkInput& first = ins[0];
  // A dense pair's rows lie in order: float32 ones, and bfloat16 ones read as pairs (E = uint16_t), are
  // asked for ahead as they are read in place, in tiles of kDenseTile (int8 rows are read slower than memory
  // delivers them; float16, fp8 and, at a head dim without its own build, bfloat16 ones are widened into
  // tile buffers of kTile rows).
  const bool dense_rows = first.source.pages == nullptr &&
                          (first.source.dtype == Dtype::kF32 || (first.source.dtype == Dtype::kBF16 && kPairRows));
  const int64_t ahead = dense_rows ? kAheadKeys * D : 0;  // elements
  const int64_t row_tile = dense_rows ? kDenseTile : kRowTile;
  std::vector<Reader> readers;  // [count, M]
  readers.reserve(count * M);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t m = 0; m < M; ++m)
      readers.emplace_back((kPaired<kDim, E> ? paired_q.data() + i * M * D : ins[i].q.data()) + m * D, D, ahead);
  int64_t end_all = first.first_key;
  for (int64_t m = 0; m < M; ++m) end_all = std::max(end_all, std::min(first.end_key, first.last[m] + 1));
  for (int64_t i = 0; i < count; ++i)
    for (int64_t m = 0; m < M; ++m) {
      chunks[i].top[m] = kNegInf;
      chunks[i].total[m] = 0.0f;
    }
  // Every pair's rows lie alike: the first pair's layout serves them all.
  TileLayout next = tile_layout(first.source, first.first_key, std::min(row_tile, end_all - first.first_key));
  for (int64_t start = first.first_key, after; start < end_all; start = after) {
    const TileLayout layout = next;
    const int64_t tile = layout.rows_given;
    after = start + tile;
    if (after < end_all) next = tile_layout(first.source, after, std::min(row_tile, end_all - after));
    for (int64_t i = 0; i < count; ++i) {
      const ChunkInput& in = ins[i];
      const Chunk& chunk = chunks[i];
      const TileRows<E> tile_rows = few_rows_tile<E>(in, layout, D);
      const float *k_scale, *v_scale;
      tile_scales(in.source, layout, in.ksbuf, in.vsbuf, &k_scale, &v_scale);
      // The next tile's share of this pair, a part at each run's scores and values and the rest at the end.
      SharePrefetch prefetch(first.source, next, i, count, in.source.pages != nullptr && after < end_all);
      const int64_t lines_per_step = (prefetch.lines() + 2 * tile_rows.count - 1) / (2 * tile_rows.count);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t end = std::min(in.end_key, in.last[m] + 1);
        // Keys of the tile before the row's first (a ring's window) are skipped where they lie.
        const int64_t skip = std::max<int64_t>(0, in.first[m] - start);
        if (start + skip >= end || skip >= tile) continue;
        const int64_t n = std::min(tile, end - start) - skip;
        int64_t counts[TileLayout::kMaxRuns];
        const TileRows<E> rows = skip == 0 ? tile_rows : without_first(tile_rows, skip, counts);
        const Reader& reader = readers[i * M + m];
        for (int64_t r = 0, j0 = 0; r < rows.count && j0 < n; j0 += rows.rows[r++]) {
          reader.score(rows.keys[r], std::min(rows.rows[r], n - j0), rows.stride, p + j0);
          prefetch.issue(lines_per_step);
        }
        if (k_scale != nullptr) {
          const float unit = reader.unit();
          for (int64_t j = 0; j < n; ++j) p[j] *= k_scale[skip + j] * unit;
        }
        const float top = chunk.top[m], new_top = std::max(top, largest(p, n));
        for (int64_t j = 0; j < n; ++j) p[j] = std::max(p[j] - new_top, kExpFloor);
        float tile_total = 0.0f;
#pragma omp simd reduction(+ : tile_total)
        for (int64_t j = 0; j < n; ++j) {
          p[j] = exp_clamped(p[j]);
          tile_total += p[j];
        }
        const float decay = exp_nonpositive(top - new_top);  // 0 while nothing was seen
        chunk.top[m] = new_top;
        chunk.total[m] = chunk.total[m] * decay + tile_total;
        if (v_scale != nullptr)
          for (int64_t j = 0; j < n; ++j) p[j] *= v_scale[skip + j];
        const int64_t value_steps = reader.value_steps(rows);  // the values' runs' share of the prefetches
        const int64_t value_lines = (lines_per_step * rows.count + value_steps - 1) / value_steps;
        reader.accumulate(chunk.acc + m * D, decay, p, rows, n, [&] { prefetch.issue(value_lines); });
      }
      prefetch.issue(prefetch.lines());
    }
  }
  if constexpr (kPaired<kDim, E>) {
    for (int64_t i = 0; i < count; ++i)
      for (int64_t m = 0; m < M; ++m) paired_order(chunks[i].acc + m * D, D, false, tmp.data());
  }
}

// Many query rows: kLanes rows at a time with the rows in the vector lanes
// (no horizontal sums; the softmax vectorised over rows).  Keys are the
// outer loop: each tile is fetched once and scored against every block of
// rows while it is in cache.
template <int64_t kDim>
JSS_INLINE void rows_in_lanes(const ChunkInput& in, int64_t M, int64_t dim, const Chunk& chunk) {
  const int64_t D = kDim > 0 ? kDim : dim;
  const Rows neg_inf = Rows{} + kNegInf, floor = Rows{} + kExpFloor;
  const int64_t blocks = (M + kRowLanes - 1) / kRowLanes;
  std::vector<float> qt(blocks * D * kRowLanes);  // per block of rows: [D, kRowLanes], the rows transposed
  std::vector<float> tops(blocks * kRowLanes, kNegInf), totals(blocks * kRowLanes, 0.0f);
  std::vector<int32_t> lasts(blocks * kRowLanes);  // each row's last visible key
  std::vector<int32_t> firsts(blocks * kRowLanes);  // and its first (0 but in a ring's window)
  std::vector<int64_t> begins(blocks), ends(blocks);  // the keys each block reads: [begin, end)
  float *kbuf = in.kbuf, *vbuf = in.vbuf;
  int64_t end_all = in.first_key;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t m0 = block * kRowLanes, rows = std::min(kRowLanes, M - m0);
    float* q_block = qt.data() + block * D * kRowLanes;
    ends[block] = in.first_key;
    begins[block] = std::numeric_limits<int64_t>::max();
    for (int64_t r = 0; r < kRowLanes; ++r) {
      lasts[block * kRowLanes + r] = static_cast<int32_t>(r < rows ? in.last[m0 + r] : -1);
      firsts[block * kRowLanes + r] = static_cast<int32_t>(r < rows ? in.first[m0 + r] : 0);
      if (r < rows) begins[block] = std::min(begins[block], in.first[m0 + r]);
      ends[block] = std::max(ends[block], std::min<int64_t>(in.end_key, lasts[block * kRowLanes + r] + int64_t{1}));
      for (int64_t d = 0; d < D; ++d) q_block[d * kRowLanes + r] = r < rows ? in.q[(m0 + r) * D + d] : 0.0f;
    }
    end_all = std::max(end_all, ends[block]);
  }
  Rows s[kTile];  // a tile's scores (one vector of rows per key), then its weights
  for (int64_t start = in.first_key, tile; start < end_all; start += tile) {
    const TileLayout layout = tile_layout(in.source, start, std::min(kTile, end_all - start));
    const TileRows<float> rows = float_rows(in.source, layout, D, false, kbuf, vbuf);  // one run
    const float *keys = rows.keys[0], *values = rows.values[0], *k_scale, *v_scale;
    const int64_t stride = rows.stride;
    tile = layout.rows_given;
    tile_scales(in.source, layout, in.ksbuf, in.vsbuf, &k_scale, &v_scale);
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t end = ends[block];
      if (start >= end || start + tile <= begins[block]) continue;
      const int64_t m0 = block * kRowLanes, rows = std::min(kRowLanes, M - m0);
      const int64_t n = std::min(tile, end - start);
      const float* q_block = qt.data() + block * D * kRowLanes;
      const RowInts last = load_row_ints(lasts.data() + block * kRowLanes);
      const RowInts first = load_row_ints(firsts.data() + block * kRowLanes);
      for (int64_t j = 0; j < n; j += kKeys) {
        const float* key[kKeys];
        for (int64_t u = 0; u < kKeys; ++u) key[u] = keys + std::min(j + u, n - 1) * stride;
        Rows acc[kKeys] = {};
        for (int64_t d = 0; d < D; ++d) {
          const Rows x = load_rows(q_block + d * kRowLanes);
          for (int64_t u = 0; u < kKeys; ++u) acc[u] += x * key[u][d];
        }
        if (k_scale != nullptr)
          for (int64_t u = 0; u < kKeys; ++u) acc[u] *= k_scale[std::min(j + u, n - 1)];
        for (int64_t u = 0; u < kKeys; ++u) {
          const int32_t key = static_cast<int32_t>(start + j + u);
          s[j + u] = (key <= last) & (key >= first) ? acc[u] : neg_inf;
        }
      }
      const Rows top = load_rows(tops.data() + block * kRowLanes);
      Rows new_top = top, tile_total{};
      for (int64_t j = 0; j < n; ++j) new_top = vmax(new_top, s[j]);
      const Rows shift = new_top == neg_inf ? Rows{} : new_top;  // rows that saw nothing: exp(-inf) = 0
      const Rows decay = exp_clamped(vmax(top - shift, floor));
      for (int64_t j = 0; j < n; ++j) {
        s[j] = exp_clamped(vmax(s[j] - shift, floor));
        tile_total += s[j];
      }
      store_rows(totals.data() + block * kRowLanes, load_rows(totals.data() + block * kRowLanes) * decay + tile_total);
      store_rows(tops.data() + block * kRowLanes, new_top);
      if (v_scale != nullptr)
        for (int64_t j = 0; j < n; ++j) s[j] *= v_scale[j];
      // Weights past a row's last key are exactly 0, so rows go kValueRows at a time over the tile's n keys.
      const float* weights = reinterpret_cast<const float*>(s);
      int64_t r = 0;
      for (; r + kValueRows <= rows; r += kValueRows) {
        float* acc[kValueRows];
        float row_decay[kValueRows];
        const float* row_weights[kValueRows];
        for (int64_t i = 0; i < kValueRows; ++i) {
          acc[i] = chunk.acc + (m0 + r + i) * D;
          row_decay[i] = decay[r + i];
          row_weights[i] = weights + r + i;
        }
        accumulate_values<kDim, kValueRows>(acc, row_decay, row_weights, kRowLanes, values, n, D, stride);
      }
      for (; r < rows; ++r) {
        float* acc = chunk.acc + (m0 + r) * D;
        const float row_decay = decay[r];
        const float* row_weights = weights + r;
        accumulate_values<kDim, 1>(&acc, &row_decay, &row_weights, kRowLanes, values, n, D, stride);
      }
    }
  }
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t m0 = block * kRowLanes, rows = std::min(kRowLanes, M - m0);
    for (int64_t r = 0; r < rows; ++r) {
      chunk.top[m0 + r] = tops[block * kRowLanes + r];
      chunk.total[m0 + r] = totals[block * kRowLanes + r];
    }
  }
}
