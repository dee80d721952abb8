// The per-ISA part of the decode attention kernel: it instantiates the kernel
// for one instruction set, from the parts below, and dispatches a chunk to it
// (run_chunks, by head dim and cache dtype).
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
//   JSS_LARGEST_DIM  the largest head dim built for (128 or 256, run_chunks);
// it undefines them at its end, for the next.
// Vectors are exactly one register wide, so nothing is split in two and the
// accumulators of a loop nest fit the register file (16 registers for SSE2
// and AVX2, 32 for AVX-512): a 16-float vector on AVX2 is two registers,
// and eight of them plus their operands spill on every key.
//
// The parts, each included here (so once per instruction set, in that set's
// namespace; none has an include guard), in the order each needs those
// before it:
//   decode_attention_vectors.h     vector types, loads, stores, conversions
//   decode_attention_elements.h    K/V cache elements as float32
//   decode_attention_tiles.h       where a tile's rows and row scales lie
//   decode_attention_prefetch.h    asking for rows before they are read
//   decode_attention_row_reader.h  a query row's scores and weighted values
//   decode_attention_sse2_int8.h   (SSE2 only) that over int8 rows in integers
//   decode_attention_softmax.h     a chunk's online softmax over its tiles

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

#include "decode_attention_vectors.h"
#include "decode_attention_elements.h"
#include "decode_attention_tiles.h"
#include "decode_attention_prefetch.h"
#include "decode_attention_row_reader.h"
#if defined(JSS_X86) && JSS_LANES == 4
#include "decode_attention_sse2_int8.h"
#else
template <int64_t kDim, typename E>
constexpr bool kIntegerInt8 = false;
#endif
#include "decode_attention_softmax.h"

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
// specialisation, or any head dim.  The specialisations are the head dims of
// published models (64, 128 and, up to JSS_LARGEST_DIM, 256): each costs
// about as much compile time as the rest of the path, and the build is what
// every install waits for.  Any other head dim runs the same loops with the
// head dim read at run time.
void run_chunks(const ChunkInput* ins, const Chunk* chunks, int64_t count, int64_t M, int64_t dim) {
  switch (dim) {
    case 64: return run_chunks_dim<64>(ins, chunks, count, M, dim);
    case 128: return run_chunks_dim<128>(ins, chunks, count, M, dim);
#if JSS_LARGEST_DIM >= 256
    case 256: return run_chunks_dim<256>(ins, chunks, count, M, dim);
#endif
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
#undef JSS_LARGEST_DIM
