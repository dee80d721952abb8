// Where a tile's K/V rows and row scales lie and how a chunk gets them:
// TileLayout (runs of rows, one per page the tile touches), TileRows (the
// rows in place, or widened into the chunk's tile buffers) and tile_scales
// (a quantized tile's row scales, in place or gathered).
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it uses decode_attention_elements.h.

// Where a tile's rows lie, the same for every kv head of a batch row (their
// pairs differ only in where k and v start): one run per page the tile
// touches, a dense cache's tile one run.  Run r is rows[r] rows from byte
// offset[r] of the pair's k and v, row_stride bytes apart, and their row
// scales from float scale[r] of k_scale and v_scale, scale_stride apart.
struct TileLayout {
  static constexpr int64_t kMaxRuns = 8;
  int64_t count, rows_given;
  int64_t rows[kMaxRuns], offset[kMaxRuns], scale[kMaxRuns];
};

// The layout of up to n rows from row start (at most kMaxRuns pages; a dense
// cache's one run, up to where a ring wraps).
JSS_INLINE TileLayout tile_layout(const PairSource& src, int64_t start, int64_t n) {
  TileLayout layout;
  layout.count = layout.rows_given = 0;
  while (layout.rows_given < n && layout.count < TileLayout::kMaxRuns) {
    const int64_t row = start + layout.rows_given, r = layout.count++, left = n - layout.rows_given;
    layout.rows[r] = std::min(left, src.rows_in_order(row));
    layout.offset[r] = src.row_offset(row);
    layout.scale[r] = src.scale_index(row);
    layout.rows_given += layout.rows[r];
    if (src.pages == nullptr) break;  // a dense tile is one run: a ring's ends where the ring wraps
  }
  return layout;
}

// A tile's keys and values as rows of E, one run per run of its layout:
// where they lie (float32, or E, the cache's own type, widened in
// registers), or float32 rows widened into the tile buffers, one run.
template <typename E>
struct TileRows {
  const E* keys[TileLayout::kMaxRuns];
  const E* values[TileLayout::kMaxRuns];
  int64_t count, stride;  // runs; elements between two rows of a run
  const int64_t* rows;    // [count]
};

JSS_INLINE void widen_rows(const PairSource& src, const TileLayout& layout, int64_t D, float* kbuf, float* vbuf) {
  for (int64_t r = 0, i = 0; r < layout.count; i += layout.rows[r++]) {
    if (src.pages == nullptr) {  // dense: the run is one stretch of rows * D elements
      widen(src.k + layout.offset[r], src.dtype, layout.rows[r] * D, kbuf + i * D);
      widen(src.v + layout.offset[r], src.dtype, layout.rows[r] * D, vbuf + i * D);
      continue;
    }
    for (int64_t j = 0; j < layout.rows[r]; ++j) {
      widen(src.k + layout.offset[r] + j * src.row_stride, src.dtype, D, kbuf + (i + j) * D);
      widen(src.v + layout.offset[r] + j * src.row_stride, src.dtype, D, vbuf + (i + j) * D);
    }
  }
}

// rows without their first skip rows (skip below the rows given); counts
// holds the runs' new row counts and must outlive the result.
template <typename E>
JSS_INLINE TileRows<E> without_first(const TileRows<E>& rows, int64_t skip, int64_t* counts) {
  TileRows<E> tile;
  tile.count = 0;
  tile.stride = rows.stride;
  tile.rows = counts;
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t drop = std::min(skip, rows.rows[r]);
    skip -= drop;
    if (drop == rows.rows[r]) continue;
    tile.keys[tile.count] = rows.keys[r] + drop * rows.stride;
    tile.values[tile.count] = rows.values[r] + drop * rows.stride;
    counts[tile.count++] = rows.rows[r] - drop;
  }
  return tile;
}

// The tile's rows in place, as E.
template <typename E>
JSS_INLINE TileRows<E> rows_in_place(const PairSource& src, const TileLayout& layout) {
  TileRows<E> tile;
  tile.count = layout.count;
  tile.stride = src.row_stride / static_cast<int64_t>(sizeof(E));
  tile.rows = layout.rows;
  for (int64_t r = 0; r < layout.count; ++r) {
    tile.keys[r] = reinterpret_cast<const E*>(src.k + layout.offset[r]);
    tile.values[r] = reinterpret_cast<const E*>(src.v + layout.offset[r]);
  }
  return tile;
}

// The tile's rows as float32: in place for float32 where in_place allows
// (a dense cache always; pages for few query rows, where a copy costs more
// than short runs), else copied or widened into kbuf/vbuf, one run of
// rows_given (many rows, whose accumulators are reloaded once per run).
JSS_INLINE TileRows<float> float_rows(const PairSource& src, const TileLayout& layout, int64_t D, bool in_place,
                                      float* kbuf, float* vbuf) {
  if (src.dtype == Dtype::kF32 && (src.pages == nullptr || in_place)) return rows_in_place<float>(src, layout);
  widen_rows(src, layout, D, kbuf, vbuf);
  TileRows<float> tile;
  tile.count = 1;
  tile.stride = D;
  tile.rows = &layout.rows_given;
  tile.keys[0] = kbuf;
  tile.values[0] = vbuf;
  return tile;
}

// Few query rows read the tile's rows in place, unless they must be widened
// first (float16, fp8).
template <typename E>
JSS_INLINE TileRows<E> few_rows_tile(const ChunkInput& in, const TileLayout& layout, int64_t D) {
  if constexpr (std::is_same<E, float>::value) {
    return float_rows(in.source, layout, D, true, in.kbuf, in.vbuf);
  } else {
    return rows_in_place<E>(in.source, layout);
  }
}

// The row scales of a quantized pair's tile (nullptr otherwise): in place
// for a dense cache, else gathered into ksbuf/vsbuf, run by run.
JSS_INLINE void tile_scales(const PairSource& src, const TileLayout& layout, float* ksbuf, float* vsbuf,
                            const float** k_scale, const float** v_scale) {
  if (!src.quantized()) {
    *k_scale = *v_scale = nullptr;
    return;
  }
  if (src.pages == nullptr && src.scale_stride == 1) {
    *k_scale = src.k_scale + layout.scale[0];
    *v_scale = src.v_scale + layout.scale[0];
    return;
  }
  for (int64_t r = 0, i = 0; r < layout.count; i += layout.rows[r++])
    for (int64_t j = 0; j < layout.rows[r]; ++j) {
      ksbuf[i + j] = src.k_scale[layout.scale[r] + j * src.scale_stride];
      vsbuf[i + j] = src.v_scale[layout.scale[r] + j * src.scale_stride];
    }
  *k_scale = ksbuf;
  *v_scale = vsbuf;
}
