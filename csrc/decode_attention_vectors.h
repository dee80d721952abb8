// The vectors of one instruction set and the operations every other part
// is written in: Floats (kLanes floats, one register), Rows (kRowLanes query
// rows), unaligned loads and stores, and max and int/float conversions
// generic over a float or a vector.
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it reads kLanes and kRowLanes from there.

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
