// The decode attention kernel's x86-64 baseline path: decode_attention_isa.h
// with SSE2 vectors of four floats (16 registers).  Each path is a source of
// its own so that the paths compile in parallel (decode_attention_chunks.h).
// The fallback for CPUs without AVX2 builds head dims up to 128: a head dim
// of 256 runs the any-head-dim loops, which saves the install a third of
// this path's compile time.

#include "decode_attention_chunks.h"

#ifdef JSS_X86
namespace jss::attention::baseline {  // x86-64: SSE2, 16 registers
#define JSS_LANES 4
#define JSS_KEYS 8
#define JSS_REGS 8
#define JSS_VROWS 1
#define JSS_ROW_LANES 4
#define JSS_PAIR_KEYS 4
#define JSS_DENSE_FLOAT_TILE 64
#define JSS_DENSE_PAIR_TILE 1024
#define JSS_LARGEST_DIM 128
#include "decode_attention_isa.h"
}  // namespace jss::attention::baseline
#endif
