// What the decode attention kernel's instruction-set paths share with
// decode_attention.cc, which splits a step into chunks and hands them to one
// path: the chunk a path runs (its pair's rows, its query rows, where its
// running state lives), the constants of the loops, and each path's entry
// point, run_chunks.
//
// Each path is a source of its own (decode_attention_baseline.cc, _avx2.cc,
// _avx512.cc on x86-64; decode_attention_generic.cc elsewhere), so the paths
// compile in parallel; each instantiates decode_attention_isa.h in its own
// namespace.  This header also brings in the standard headers the parts of
// decode_attention_isa.h use: they have no #include of their own (it would
// land inside a path's namespace).

#ifndef JSS_DECODE_ATTENTION_CHUNKS_H_
#define JSS_DECODE_ATTENTION_CHUNKS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

// JSS_PORTABLE (-DJSS_PORTABLE) builds the generic path alone, as every non-x86 target gets it, so
// that x86 machines can check it compiles (tests/test_native_build.py).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(JSS_PORTABLE)
#define JSS_X86 1
#include <immintrin.h>
#endif

namespace jss::attention {

constexpr int64_t kTile = 64;               // keys per tile: a K and a V tile stay in L1
constexpr int64_t kLaneRows = 4;            // from this many rows per pair on, put rows in the lanes
// Keys ahead of the one being read whose rows a dense float32 or bfloat16
// pair asks for, for few query rows (rows_by_dot): the CPU's own prefetchers
// stay too close to a read this slow per byte (SSE2: 32k float32 valid took
// 6.3 ms without, 4.0 with; 4k bfloat16 240 us against 180, on two cores).
constexpr int64_t kAheadKeys = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kExpFloor = -88.0f;

#if defined(__GNUC__) || defined(__clang__)
#define JSS_INLINE inline __attribute__((always_inline))
#else
#define JSS_INLINE inline
#endif

enum class Dtype { kF32, kBF16, kF16, kI8, kF8 };

// Where one (batch row, kv head) pair's rows lie.  Row p starts at byte
// k + row_offset(p) (and the same offset from v): dense, p * row_stride; paged,
// through the row's page table.  A quantized cache's row scales lie the same
// way, in floats: k_scale[scale_index(p)].
struct PairSource {
  const char *k, *v;
  Dtype dtype;
  int64_t row_stride;          // bytes between rows of one page (dense: between all rows)
  const int32_t* pages;        // the pair's page table (nullptr: dense)
  int64_t page_size, page_stride, num_pages;  // rows per page, bytes per page, pages in the pool
  const float *k_scale = nullptr, *v_scale = nullptr;  // quantized: the row scales (else nullptr)
  int64_t scale_stride = 0, scale_page_stride = 0;      // floats between rows' scales, between pages'
  // A ring (ring > 0, dense only): positions below sink lie in their own slot, a later position p in slot
  // sink + (p - sink) % ring, so a run of positions lies in order up to the ring's end, then wraps.
  int64_t sink = 0, ring = 0;

  bool read_in_place() const { return dtype == Dtype::kF32 && pages == nullptr; }  // else tile buffers too
  bool quantized() const { return k_scale != nullptr; }
  int64_t page_of(int64_t p) const { return std::clamp<int64_t>(pages[p / page_size], 0, num_pages - 1); }
  int64_t slot(int64_t p) const { return ring == 0 || p < sink ? p : sink + (p - sink) % ring; }
  // Rows from p on that lie in order (p's page, the sinks, or the ring up to its end).
  int64_t rows_in_order(int64_t p) const {
    if (pages != nullptr) return page_size - p % page_size;
    if (ring == 0) return std::numeric_limits<int64_t>::max();
    return p < sink ? sink - p : ring - (p - sink) % ring;
  }
  int64_t row_offset(int64_t p) const {
    if (pages == nullptr) return slot(p) * row_stride;
    return page_of(p) * page_stride + (p % page_size) * row_stride;
  }
  int64_t scale_index(int64_t p) const {
    if (pages == nullptr) return slot(p) * scale_stride;
    return page_of(p) * scale_page_stride + (p % page_size) * scale_stride;
  }
};

// One thread's share: a (batch row, kv head) pair and a key range, and where
// its running state lives: top[M], total[M], acc[M, D].
struct Chunk {
  int64_t pair, first_key, end_key;
  float *top, *total, *acc;
  bool windowed;  // its rows' keys start at their first (a ring's window), else at 0 (its sinks, a cache)
};

// What one chunk reads: its pair's query rows (scaled), keys and values, the
// last key each row may see, and tile buffers for rows not read in place.
struct ChunkInput {
  PairSource source;
  std::vector<float> q;       // [M, D], scaled
  std::vector<int64_t> last;  // [M]: the last key each row sees
  std::vector<int64_t> first;  // [M]: the first key each row sees (0 but in a ring's window)
  int64_t first_key, end_key;  // keys this chunk reads: [first_key, end_key)
  float *kbuf, *vbuf;          // [kTile, D] each
  float *ksbuf, *vsbuf;        // [kTile] each: a paged tile's row scales
};

// count chunks of one key range, with M query rows each of head dim dim.
using ChunkFn = void (*)(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim);

// The kernel once per instruction set, each vector one register wide.  The
// parameters (the JSS_ macros in each path's source) were chosen by measurement (8 kv-heads x 64, T = 1 and 16, one
// core; benchmarks/attention.py): four rows per pass over the values beat
// two by 5-10% on AVX2 and AVX-512; four keys at a time instead of eight lost
// 30% at T = 16; on SSE2 no choice reaches XLA's loop for many rows (its dots
// dispatch to the CPU's widest vectors), so there the kernel declines them
// (jax_session_state._native.DECLINED_ROWS).  Over bfloat16 rows at T = 1,
// four keys at a time beat eight by 7% on AVX2 (with a second sum per key)
// and 5% on SSE2; sixteen lost 15-20% everywhere.  A dense pair read at
// T = 1 goes in tiles of 1024 keys on AVX2 and AVX-512 (one core, 1k-32k
// valid: float32 12-18% and bfloat16 3-10% faster than tiles of 64 and 256;
// 2048 gained 2% more), and SSE2's bfloat16 too (3% at 4k); SSE2's float32
// keeps 64 (1024 lost 3-8%).  Elsewhere the tiles stay as they were.
//
// Each path's run_chunks: count chunks of one key range (pairs of one cache
// dtype) at the head dim's specialisation, or any head dim.
#ifdef JSS_X86
namespace baseline {  // x86-64: SSE2, 16 registers (decode_attention_baseline.cc)
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim);
}
namespace avx2 {  // x86-64-v3: 16 ymm registers (decode_attention_avx2.cc)
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim);
}
namespace avx512 {  // x86-64-v4: 32 zmm registers (decode_attention_avx512.cc)
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim);
}
#else
namespace generic {  // any other target (aarch64: NEON, 32 registers; decode_attention_generic.cc)
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim);
}
#endif

}  // namespace jss::attention

#endif  // JSS_DECODE_ATTENTION_CHUNKS_H_
