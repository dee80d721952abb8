// The decode attention kernel's AVX-512 path: decode_attention_isa.h with
// AVX-512 vectors of sixteen floats (32 zmm registers), compiled for that
// instruction set alone (the target pragma); the library picks it where the
// CPU runs it.  Each path is a source of its own so that the paths compile in
// parallel (decode_attention_chunks.h).

#include "decode_attention_chunks.h"

#ifdef JSS_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
#endif
namespace jss::attention::avx512 {  // x86-64-v4: 32 zmm registers
#define JSS_LANES 16
#define JSS_KEYS 8
#define JSS_REGS 16
#define JSS_VROWS 4
#define JSS_ROW_LANES JSS_LANES
#define JSS_PAIR_KEYS 8
#define JSS_DENSE_FLOAT_TILE 1024
#define JSS_DENSE_PAIR_TILE 1024
#define JSS_LARGEST_DIM 256
#include "decode_attention_isa.h"
}  // namespace jss::attention::avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
