// The decode attention kernel's AVX2 path: decode_attention_isa.h with AVX2
// and FMA vectors of eight floats (16 ymm registers), compiled for that
// instruction set alone (the target pragma); the library picks it where the
// CPU runs it.  Each path is a source of its own so that the paths compile in
// parallel (decode_attention_chunks.h).

#include "decode_attention_chunks.h"

#ifdef JSS_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace jss::attention::avx2 {  // x86-64-v3: 16 ymm registers
#define JSS_LANES 8
#define JSS_KEYS 8
#define JSS_REGS 8
#define JSS_VROWS 4
#define JSS_ROW_LANES JSS_LANES
#define JSS_PAIR_KEYS 4
#define JSS_DENSE_FLOAT_TILE 1024
#define JSS_DENSE_PAIR_TILE 1024
#define JSS_LARGEST_DIM 256
#include "decode_attention_isa.h"
}  // namespace jss::attention::avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
