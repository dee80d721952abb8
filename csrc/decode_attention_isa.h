// The per-ISA part of the decode attention kernel: one chunk's online softmax.
//
// decode_attention.cc includes this file once per instruction set, inside a
// namespace of its own and under a target pragma, with
//   JSS_LANES  floats per vector (4: SSE2 / NEON, 8: AVX2, 16: AVX-512),
//   JSS_KEYS   keys scored together (independent FMA chains),
//   JSS_REGS   vector registers the value accumulators may hold at once,
//   JSS_VROWS  query rows that share one pass over a tile's values,
//   JSS_ROW_LANES  query rows scored together in rows_in_lanes,
//   JSS_PAIR_KEYS  keys scored together over bfloat16 rows read as pairs,
//   JSS_DENSE_FLOAT_TILE, JSS_DENSE_PAIR_TILE  keys per tile where few query
//                  rows read a dense pair's float32 or bfloat16 rows in place;
// it undefines them at its end, for the next.
// Vectors are exactly one register wide, so nothing is split in two and the
// accumulators of a loop nest fit the register file (16 registers for SSE2
// and AVX2, 32 for AVX-512): a 16-float vector on AVX2 is two registers,
// and eight of them plus their operands spill on every key.

constexpr int64_t kLanes = JSS_LANES;
constexpr int64_t kKeys = JSS_KEYS;
constexpr int64_t kRegs = JSS_REGS;
constexpr int64_t kValueRows = JSS_VROWS;

constexpr int64_t kRowLanes = JSS_ROW_LANES;
constexpr int64_t kPairKeys = JSS_PAIR_KEYS;
// Keys per tile of paged bfloat16 rows read in place (rows_by_dot): more
// than kTile, since no buffer holds them and the tile's softmax (a chain of
// reductions the FMAs wait for) is paid once per tile.
constexpr int64_t kPairTile = 4 * kTile;
// A dense pair's float32 and bfloat16 rows, read in place and asked for
// ahead, go in tiles of their own, longer where measured faster: each
// tile's softmax is a barrier (its values wait for all its scores).
constexpr int64_t kDenseFloatTile = JSS_DENSE_FLOAT_TILE;
constexpr int64_t kDensePairTile = JSS_DENSE_PAIR_TILE;

typedef float Floats __attribute__((vector_size(4 * kLanes)));
typedef int32_t Ints __attribute__((vector_size(4 * kLanes)));
// Query rows scored together in rows_in_lanes: one register or two.
typedef float Rows __attribute__((vector_size(4 * kRowLanes)));
typedef int32_t RowInts __attribute__((vector_size(4 * kRowLanes)));

// Unaligned loads and stores of any vector type (memcpy: a std::vector of
// vector types would not be aligned for them).
template <typename V, typename T>
JSS_INLINE V load_as(const T* p) {
  V x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <typename V, typename T>
JSS_INLINE void store_as(T* p, V x) {
  std::memcpy(p, &x, sizeof x);
}
JSS_INLINE Floats load(const float* p) { return load_as<Floats>(p); }
JSS_INLINE void store(float* p, Floats x) { store_as(p, x); }
JSS_INLINE Rows load_rows(const float* p) { return load_as<Rows>(p); }
JSS_INLINE void store_rows(float* p, Rows x) { store_as(p, x); }
JSS_INLINE RowInts load_row_ints(const int32_t* p) { return load_as<RowInts>(p); }
typedef uint16_t Halves __attribute__((vector_size(2 * kLanes)));
typedef int8_t Bytes __attribute__((vector_size(kLanes)));
// Generic over a float or a vector of floats (Floats or Rows, which may be one type).
template <typename F>
using IntsOf = typename std::conditional<std::is_same<F, float>::value, int32_t, decltype(F{} > F{})>::type;
template <typename F>
JSS_INLINE F vmax(F a, F b) {
  return a > b ? a : b;
}
template <typename F>
JSS_INLINE IntsOf<F> to_int(F x) {
  if constexpr (std::is_same<F, float>::value) {
    return static_cast<int32_t>(x);
  } else {
    return __builtin_convertvector(x, IntsOf<F>);
  }
}
template <typename F>
JSS_INLINE F to_float(IntsOf<F> x) {
  if constexpr (std::is_same<F, float>::value) {
    return static_cast<float>(x);
  } else {
    return __builtin_convertvector(x, F);
  }
}
template <typename F>
JSS_INLINE F bits_to_float(IntsOf<F> x) {
  F f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

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

// kLanes cache elements as floats: float32 as they are, bfloat16 (E =
// uint16_t) widened in registers (zero-extend, shift into the high half),
// int8 values converted (their row scales are applied by the caller).  On
// x86 through intrinsics: GCC lowers a generic int8 -> float conversion
// element by element, and a 16-bit widening in five instructions for two.
template <typename E>
JSS_INLINE Floats load_elements(const E* p) {
  if constexpr (std::is_same<E, float>::value) {
    return load(p);
  } else if constexpr (std::is_same<E, int8_t>::value) {
#if defined(JSS_X86) && JSS_LANES == 16
    return (Floats)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(JSS_X86) && JSS_LANES == 8
    return (Floats)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(JSS_X86)  // SSE2: sign-extend by unpacking each byte into the top of its lane
    int32_t word;
    std::memcpy(&word, p, sizeof word);
    __m128i x = _mm_cvtsi32_si128(word);
    x = _mm_unpacklo_epi8(x, x);
    x = _mm_srai_epi32(_mm_unpacklo_epi16(x, x), 24);
    return (Floats)_mm_cvtepi32_ps(x);
#else
    return __builtin_convertvector(load_as<Bytes>(p), Floats);
#endif
  } else {
#if defined(JSS_X86) && JSS_LANES == 16
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return (Floats)_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(JSS_X86) && JSS_LANES == 8
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return (Floats)_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#elif defined(JSS_X86)
    const __m128i halves = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return (Floats)_mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), halves));
#else
    const Ints wide = __builtin_convertvector(load_as<Halves>(p), Ints) << 16;
    return bits_to_float<Floats>(wide);
#endif
  }
}

// bfloat16 rows read in place, of a head dim that is a multiple of 2 *
// kLanes, are read as pairs: 2 * kLanes elements loaded as kLanes 32-bit lanes, whose low
// halves (the even elements) shift up and whose high halves (the odd ones)
// are masked, two instructions for 2 * kLanes floats.  Queries and value
// accumulators are then laid out the same way within each block of 2 *
// kLanes: the even elements, then the odd ones (paired_order).
template <int64_t kDim, typename E>
constexpr bool kPaired = std::is_same<E, uint16_t>::value && kDim > 0 && kDim % (2 * kLanes) == 0;

// Keys a query row scores at once over rows of E (JSS_PAIR_KEYS over pairs).
template <int64_t kDim, typename E>
constexpr int64_t kRowKeys = kPaired<kDim, E> ? kPairKeys : kKeys;

JSS_INLINE void load_pair(const uint16_t* p, Floats* even, Floats* odd) {
  const Ints bits = load_as<Ints>(p);
  *even = bits_to_float<Floats>(bits << 16);
  *odd = bits_to_float<Floats>(bits & static_cast<int32_t>(0xffff0000u));
}

// x[0, D) into (to_pairs) or out of the paired layout, through tmp[D].
JSS_INLINE void paired_order(float* x, int64_t D, bool to_pairs, float* tmp) {
  for (int64_t block = 0; block < D; block += 2 * kLanes)
    for (int64_t i = 0; i < kLanes; ++i)
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t natural = block + 2 * i + half, paired = block + half * kLanes + i;
        tmp[to_pairs ? paired : natural] = x[to_pairs ? natural : paired];
      }
  std::memcpy(x, tmp, D * sizeof(float));
}

// Asks for the cache lines of bytes [0, bytes) from `elements` elements of
// E past p on into the L2 cache.  The address is worked out as an integer:
// near a buffer's end it may lie past it (a prefetch never faults).
template <typename E>
JSS_INLINE void prefetch_lines(const E* p, int64_t elements, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(elements) * sizeof(E);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(start + b), 0, 1);
}

// The largest power of two <= n (n >= 1).
constexpr int64_t floor_pow2(int64_t n) { return n >= 2 ? 2 * floor_pow2(n / 2) : 1; }

// D elements of a tile as float32: copied (f32 with a row stride, paged) or
// widened (bf16: the high half of a float; f16 and float8_e4m3fn: exponent
// rebiased, with subnormals, infinities and NaN; int8: converted; the row
// scales of quantized values are applied by the caller).
JSS_INLINE void widen(const char* src, Dtype dtype, int64_t D, float* dst) {
  if (dtype == Dtype::kF32) {
    std::memcpy(dst, src, D * sizeof(float));
    return;
  }
  if (dtype == Dtype::kI8) {
    const int8_t* b = reinterpret_cast<const int8_t*>(src);
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(b[d]);
    return;
  }
  // Exponents are rebiased in the integer bits; subnormals go through an
  // integer conversion (XLA runs with denormal inputs read as zero).
  if (dtype == Dtype::kF8) {  // e4m3fn: no infinities, NaN at magnitude 0x7f
    const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
    uint32_t* out = reinterpret_cast<uint32_t*>(dst);
    for (int64_t d = 0; d < D; ++d) {
      const uint32_t bits = b[d], magnitude = bits & 0x7fu;
      const float subnormal = static_cast<float>(magnitude) * 0.001953125f;  // m * 2^-9
      uint32_t small;
      std::memcpy(&small, &subnormal, sizeof small);
      uint32_t widened = magnitude < 0x08u ? small : (magnitude << 20) + (120u << 23);
      widened = magnitude == 0x7fu ? 0x7fc00000u : widened;
      out[d] = widened | ((bits & 0x80u) << 24);
    }
    return;
  }
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  if (dtype == Dtype::kBF16) {
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(h[d]) << 16;
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    const uint32_t bits = h[d], magnitude = bits & 0x7fffu, shifted = magnitude << 13;
    const float subnormal = static_cast<float>(magnitude) * 5.9604644775390625e-8f;  // m * 2^-24
    uint32_t small;
    std::memcpy(&small, &subnormal, sizeof small);
    uint32_t widened = magnitude < 0x400u ? small : shifted + (112u << 23);
    widened = magnitude >= 0x7c00u ? (shifted | 0x7f800000u) : widened;  // inf, nan
    out[d] = widened | ((bits & 0x8000u) << 16);
  }
}

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

// The layout of up to n rows from row start (at most kMaxRuns pages).
JSS_INLINE TileLayout tile_layout(const PairSource& src, int64_t start, int64_t n) {
  TileLayout layout;
  layout.count = layout.rows_given = 0;
  while (layout.rows_given < n && layout.count < TileLayout::kMaxRuns) {
    const int64_t row = start + layout.rows_given, r = layout.count++, left = n - layout.rows_given;
    layout.rows[r] = src.pages == nullptr ? left : std::min(left, src.page_size - row % src.page_size);
    layout.offset[r] = src.row_offset(row);
    layout.scale[r] = src.scale_index(row);
    layout.rows_given += layout.rows[r];
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

// Share part of parts of the keys and values of a paged batch row's next
// tile, brought into the L2 cache a few lines at a time while this tile is
// read: pages lie in any order, where the CPU's prefetchers do not follow,
// and a burst of prefetches would wait for the core's few miss buffers
// (or be dropped) where, spread over the tile's work, they arrive while
// the FMAs run.  src is the row's first kv head: a run's rows of all its
// heads lie together, so each share is read in address order.
class SharePrefetch {
 public:
  // Nothing is asked for unless active (a paged pair with a next tile).
  // A quantized pair's row scales (a few lines per page) are asked for at once.
  SharePrefetch(const PairSource& src, const TileLayout& layout, int64_t part, int64_t parts, bool active)
      : src_(src), layout_(layout), part_(part), parts_(parts), runs_(active ? layout.count : 0) {
    for (int64_t r = 0; r < runs_; ++r) lines_ += (bytes_end(r) - bytes_begin(r) + 63) / 64;
    start_run(0);
    if (!src.quantized()) return;
    for (int64_t r = 0; r < runs_; ++r) {
      const int64_t span = layout.rows[r] * src.scale_stride * static_cast<int64_t>(sizeof(float));
      const char *k_scale = reinterpret_cast<const char*>(src.k_scale + layout.scale[r]),
                 *v_scale = reinterpret_cast<const char*>(src.v_scale + layout.scale[r]);
      for (int64_t byte = share_begin(span); byte < share_end(span); byte += 64) {
        __builtin_prefetch(k_scale + byte, 0, 1);
        __builtin_prefetch(v_scale + byte, 0, 1);
      }
    }
  }
  int64_t lines() const { return lines_; }
  // Asks for up to n more lines of K and of V.
  void issue(int64_t n) {
    for (; n > 0 && run_ < runs_; --n) {
      while (byte_ >= end_) {
        start_run(run_ + 1);
        if (run_ >= runs_) return;
      }
      __builtin_prefetch(src_.k + layout_.offset[run_] + byte_, 0, 1);
      __builtin_prefetch(src_.v + layout_.offset[run_] + byte_, 0, 1);
      byte_ += 64;
    }
  }

 private:
  // This part's bytes of a span of the given bytes, from a cache line's start.
  int64_t share_begin(int64_t bytes) const { return bytes * part_ / parts_ / 64 * 64; }
  int64_t share_end(int64_t bytes) const { return bytes * (part_ + 1) / parts_; }
  int64_t bytes_begin(int64_t r) const { return share_begin(layout_.rows[r] * src_.row_stride); }
  int64_t bytes_end(int64_t r) const { return share_end(layout_.rows[r] * src_.row_stride); }
  void start_run(int64_t r) {
    run_ = r;
    if (r < runs_) byte_ = bytes_begin(r), end_ = bytes_end(r);
  }
  const PairSource& src_;
  const TileLayout& layout_;
  int64_t part_, parts_, runs_, lines_ = 0, run_ = 0, byte_ = 0, end_ = 0;
};

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

// For each of kRows rows: acc[D] = acc * decay + sum_j weight[j * stride] *
// values[j], j < n (row j at values + j * value_stride).  The head dim goes
// in slabs of registers, so the rows' accumulators of a slab stay in
// registers over the tile's keys.  Where ahead is not 0, each slab of a row
// asks for the same slab ahead elements on.
template <int64_t kDim, int64_t kRows, typename E = float>
JSS_INLINE void accumulate_values(float* const* acc, const float* decay, const float* const* weight, int64_t stride,
                                  const E* values, int64_t n, int64_t dim, int64_t value_stride, int64_t ahead = 0) {
  if constexpr (kDim > 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    constexpr int64_t kSlab = std::min(kChunks, floor_pow2(std::max<int64_t>(1, kRegs / kRows)));
    for (int64_t c0 = 0; c0 < kChunks; c0 += kSlab) {
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
  } else {
    static_assert(std::is_same<E, float>::value, "any head dim: float32 tiles only");
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t d = 0; d < dim; ++d) acc[r][d] *= decay[r];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; ++d) acc[r][d] += weight[r][j * stride] * values[j * value_stride + d];
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

#if defined(JSS_X86) && JSS_LANES == 4
#include "decode_attention_sse2_int8.h"
#else
template <int64_t kDim, typename E>
constexpr bool kIntegerInt8 = false;
#endif

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
  // A dense pair's rows lie in order: float32 and bfloat16 ones are asked for ahead as they are read, in
  // tiles of kDenseTile (int8 rows are read slower than memory delivers them; float16 and fp8 ones are
  // widened into tile buffers of kTile rows).
  const bool dense_rows = first.source.pages == nullptr &&
                          (first.source.dtype == Dtype::kF32 || first.source.dtype == Dtype::kBF16);
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
      const TileRows<E> rows = few_rows_tile<E>(in, layout, D);
      const float *k_scale, *v_scale;
      tile_scales(in.source, layout, in.ksbuf, in.vsbuf, &k_scale, &v_scale);
      // The next tile's share of this pair, a part at each run's scores and values and the rest at the end.
      SharePrefetch prefetch(first.source, next, i, count, in.source.pages != nullptr && after < end_all);
      const int64_t lines_per_step = (prefetch.lines() + 2 * rows.count - 1) / (2 * rows.count);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t end = std::min(in.end_key, in.last[m] + 1);
        if (start >= end) continue;
        const int64_t n = std::min(tile, end - start);
        const Reader& reader = readers[i * M + m];
        for (int64_t r = 0, j0 = 0; r < rows.count && j0 < n; j0 += rows.rows[r++]) {
          reader.score(rows.keys[r], std::min(rows.rows[r], n - j0), rows.stride, p + j0);
          prefetch.issue(lines_per_step);
        }
        if (k_scale != nullptr) {
          const float unit = reader.unit();
          for (int64_t j = 0; j < n; ++j) p[j] *= k_scale[j] * unit;
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
          for (int64_t j = 0; j < n; ++j) p[j] *= v_scale[j];
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
  std::vector<int64_t> ends(blocks);          // the keys each block reads: [first_key, end)
  float *kbuf = in.kbuf, *vbuf = in.vbuf;
  int64_t end_all = in.first_key;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t m0 = block * kRowLanes, rows = std::min(kRowLanes, M - m0);
    float* q_block = qt.data() + block * D * kRowLanes;
    ends[block] = in.first_key;
    for (int64_t r = 0; r < kRowLanes; ++r) {
      lasts[block * kRowLanes + r] = static_cast<int32_t>(r < rows ? in.last[m0 + r] : -1);
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
      if (start >= end) continue;
      const int64_t m0 = block * kRowLanes, rows = std::min(kRowLanes, M - m0);
      const int64_t n = std::min(tile, end - start);
      const float* q_block = qt.data() + block * D * kRowLanes;
      const RowInts last = load_row_ints(lasts.data() + block * kRowLanes);
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
        for (int64_t u = 0; u < kKeys; ++u)
          s[j + u] = static_cast<int32_t>(start + j + u) <= last ? acc[u] : neg_inf;
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

template <int64_t kDim>
JSS_INLINE void run_chunks_dim(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim) {
  for (int64_t i = 0; i < count; ++i) std::fill(chunks[i].acc, chunks[i].acc + M * dim, 0.0f);
  if (M >= kLaneRows) {
    for (int64_t i = 0; i < count; ++i) rows_in_lanes<kDim>(ins[i], M, dim, chunks[i]);
  } else if constexpr (kDim > 0) {
    if (ins[0].source.dtype == Dtype::kBF16) {
      rows_by_dot<kDim, uint16_t>(ins, chunks, count, M, dim);
    } else if (ins[0].source.dtype == Dtype::kI8) {
      rows_by_dot<kDim, int8_t>(ins, chunks, count, M, dim);
    } else {
      rows_by_dot<kDim>(ins, chunks, count, M, dim);
    }
  } else {
    rows_by_dot<kDim>(ins, chunks, count, M, dim);
  }
}

// count chunks of one key range (pairs of one cache dtype) at the head dim's
// specialisation (a multiple of kLanes), or any head dim.
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim) {
  switch (dim) {
    case 16: return run_chunks_dim<16>(ins, chunks, count, M, dim);
    case 32: return run_chunks_dim<32>(ins, chunks, count, M, dim);
    case 64: return run_chunks_dim<64>(ins, chunks, count, M, dim);
    case 128: return run_chunks_dim<128>(ins, chunks, count, M, dim);
    case 256: return run_chunks_dim<256>(ins, chunks, count, M, dim);
    default: return run_chunks_dim<0>(ins, chunks, count, M, dim);
  }
}

#undef JSS_LANES
#undef JSS_KEYS
#undef JSS_REGS
#undef JSS_VROWS
#undef JSS_ROW_LANES
#undef JSS_PAIR_KEYS
#undef JSS_DENSE_FLOAT_TILE
#undef JSS_DENSE_PAIR_TILE
