// The decode attention kernel's generic path, for every target but x86-64
// (and for x86-64 under JSS_PORTABLE): decode_attention_isa.h with vectors of
// four floats (aarch64: NEON, 32 registers).  Each path is a source of its
// own so that the paths compile in parallel (decode_attention_chunks.h).

#include "decode_attention_chunks.h"

#ifndef JSS_X86
namespace jss::attention::generic {  // any other target (aarch64: NEON, 32 registers)
#define JSS_LANES 4
#define JSS_KEYS 8
#define JSS_REGS 16
#define JSS_VROWS 2
#define JSS_ROW_LANES JSS_LANES
#define JSS_PAIR_KEYS 8
#define JSS_DENSE_FLOAT_TILE 64
#define JSS_DENSE_PAIR_TILE 256
#define JSS_LARGEST_DIM 256
#include "decode_attention_isa.h"
}  // namespace jss::attention::generic
#endif
