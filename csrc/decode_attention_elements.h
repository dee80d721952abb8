// K/V cache elements as float32: float32, bfloat16, float16, float8_e4m3fn
// and int8 converted, kLanes at a time in registers (load_elements; bfloat16
// pairs by load_pair, in the layout paired_order makes) or a run at a time
// into a tile buffer (widen).  Quantized elements come out unscaled: their
// row scales are applied by the caller.
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it uses decode_attention_vectors.h.

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
