// CRC-32 (zip, gzip and zlib's checksum: reflected polynomial 0x04C11DB7) by carry-less multiplication.
//
// A checkpoint checks every byte it restores against CRC-32s (checkpoint/_digest.py); zlib's table-driven
// crc32 reads about 3 GB/s on one core, which a verified restore pays in full.  Folding the message 64
// bytes at a time with PCLMULQDQ (Gopal et al., "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ Instruction", Intel, 2009) reads several times faster and gives the same values, so a
// checkpoint's digests do not depend on which computed them.  Every constant below is x^e mod P for the
// e named beside it, bit-reflected to 32 bits and shifted left by one (the reflected domain's convention),
// or P and floor(x^64 / P) themselves, reflected to 33 bits; tests compare against zlib on random data.
//
// JssCrc32(data, size, crc) continues zlib.crc32(earlier, crc) over data; JssCrc32Supported() says
// whether it folds on this CPU (x86-64 with PCLMULQDQ and SSE4.1).  Where it does not, JssCrc32 goes bit
// by bit (correct, slow) and callers use zlib instead.

#include <cstddef>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(JSS_PORTABLE)
#define JSS_CRC32_FOLDS 1
#include <immintrin.h>
#endif

namespace {

constexpr uint32_t kReflectedPolynomial = 0xEDB88320u;

// Bit by bit, for the fewer than 64 bytes the fold leaves (and all of it where there is no fold).
uint32_t BitwiseCrc(const uint8_t* data, size_t size, uint32_t crc) {
  for (size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (kReflectedPolynomial & (0u - (crc & 1u)));
  }
  return crc;
}

#ifdef JSS_CRC32_FOLDS
alignas(16) constexpr uint64_t kFoldBy512[2] = {0x154442bd4, 0x1c6e41596};  // e = 512 + 32, 512 - 32
alignas(16) constexpr uint64_t kFoldBy128[2] = {0x1751997d0, 0x0ccaa009e};  // e = 128 + 32, 128 - 32
alignas(16) constexpr uint64_t kFold64To32[2] = {0x163cd6124, 0};            // e = 64
alignas(16) constexpr uint64_t kBarrett[2] = {0x1db710641, 0x1f7011641};     // P, floor(x^64 / P)

// One 128-bit lane folded forward over `distance` (the constants of a fold) and merged with `next`.
__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i lane, __m128i distance, __m128i next) {
  const __m128i low = _mm_clmulepi64_si128(lane, distance, 0x00);
  const __m128i high = _mm_clmulepi64_si128(lane, distance, 0x11);
  return _mm_xor_si128(_mm_xor_si128(low, high), next);
}

// The CRC register (inverted, as zlib keeps it) after `size` bytes; size >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) uint32_t FoldedCrc(const uint8_t* data, size_t size, uint32_t crc) {
  auto load = [](const uint8_t* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); };
  __m128i lanes[4] = {_mm_xor_si128(load(data), _mm_cvtsi32_si128(static_cast<int>(crc))), load(data + 16),
                      load(data + 32), load(data + 48)};
  const uint8_t* at = data + 64;
  const uint8_t* end = data + size;
  const __m128i by512 = _mm_load_si128(reinterpret_cast<const __m128i*>(kFoldBy512));
  for (; end - at >= 64; at += 64) {  // four independent lanes keep the multiplier busy
    for (int i = 0; i < 4; ++i) lanes[i] = Fold(lanes[i], by512, load(at + 16 * i));
  }
  const __m128i by128 = _mm_load_si128(reinterpret_cast<const __m128i*>(kFoldBy128));
  __m128i x = lanes[0];
  for (int i = 1; i < 4; ++i) x = Fold(x, by128, lanes[i]);
  for (; at < end; at += 16) x = Fold(x, by128, load(at));

  const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
  // 128 bits to 64: the low half times x^(128-32), added to the high half.
  x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, by128, 0x10));
  // 64 bits to 32 (plus the 32 kept for the reduction): the low 32 bits times x^64.
  const __m128i by64 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kFold64To32));
  x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, low32), by64, 0x00));
  // Barrett reduction modulo P.
  const __m128i barrett = _mm_load_si128(reinterpret_cast<const __m128i*>(kBarrett));
  __m128i quotient = _mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10);
  quotient = _mm_clmulepi64_si128(_mm_and_si128(quotient, low32), barrett, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, quotient), 1));
}

#endif  // JSS_CRC32_FOLDS

}  // namespace

extern "C" int JssCrc32Supported() {
#ifdef JSS_CRC32_FOLDS
  return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#else
  return 0;
#endif
}

extern "C" uint32_t JssCrc32(const uint8_t* data, size_t size, uint32_t crc) {
  crc = ~crc;
  size_t folded = 0;
#ifdef JSS_CRC32_FOLDS
  folded = size >= 64 ? size & ~size_t{15} : 0;
  if (folded > 0) crc = FoldedCrc(data, folded, crc);
#endif
  return ~BitwiseCrc(data + folded, size - folded, crc);
}
