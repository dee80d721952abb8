// Append-mode attention over a head-major K/V cache, for XLA:CPU through the XLA FFI.
//
// The semantics are those of jax_session_state.attention.attend_with_lse on a
// KVView with window=None: for batch row b and kv head h, the first
// lengths[b] rows of k[b, h] and v[b, h] are one contiguous [L, D] block and
// are read in place.  A query at position qp sees key p when p < lengths[b]
// and, if causal, p <= qp; qp is q_positions[b, t], plus lengths[b] when the
// attribute relative is set (offsets from the end).  Query head h * G + g
// reads kv head h (GQA with G = q_heads / kv_heads).  A query that sees
// nothing gets zeros and lse = -inf.
//
// Work: for every (batch row, kv head) pair, its T * G query rows walk the
// keys in tiles of kTile with an online softmax (running max, sum and
// accumulator per row), so a step costs what is valid, not what is allocated.
// Large steps split each pair's keys into chunks run on XLA's intra-op thread
// pool and merged exactly by log-sum-exp; small ones run on the calling
// thread (waking a pool thread costs more than they do).
//
// Portable C++17: the inner loops are written so that GCC and Clang vectorise
// them at -O3 for any target (fixed-width lane accumulators instead of a float
// reduction, an exp built from a polynomial and the exponent bits).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTile = 64;               // keys per tile: a K and a V tile stay in L1
constexpr int64_t kKeys = 8;                // keys scored together with the rows in the lanes
constexpr int64_t kLaneRows = 4;            // from this many rows per pair on, put rows in the lanes
constexpr int64_t kChunkKeys = 512;         // the fewest keys one thread's chunk gets
// A step runs on the pool when it reads at least kParallelKeys key rows (K/V
// bytes dominate: decoding is bound by memory bandwidth) or scores at least
// kParallelWork (query row, key) pairs; below both, one thread is faster
// than waking another (measured on XLA:CPU, 8 kv-heads x 64).
constexpr int64_t kParallelKeys = 4096;
constexpr int64_t kParallelWork = 1 << 17;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if defined(__GNUC__) || defined(__clang__)
#define JSS_INLINE inline __attribute__((always_inline))
#else
#define JSS_INLINE inline
#endif
#if defined(__x86_64__) && defined(__linux__) && !defined(JSS_NO_TARGET_CLONES)
#define JSS_TARGET_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define JSS_TARGET_CLONES
#endif

// Sixteen floats: one AVX-512 register, two AVX2 or four SSE2 / NEON ones.
// GCC's and Clang's generic vectors; GCC's auto-vectoriser keeps the rows'
// accumulators of a loop nest in memory, these stay in registers.
typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

JSS_INLINE Floats load(const float* p) {
  Floats x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
JSS_INLINE void store(float* p, Floats x) { std::memcpy(p, &x, sizeof x); }
JSS_INLINE Ints load_ints(const int32_t* p) {
  Ints x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
JSS_INLINE Floats vmax(Floats a, Floats b) { return a > b ? a : b; }

JSS_INLINE int32_t to_int(float x) { return static_cast<int32_t>(x); }
JSS_INLINE Ints to_int(Floats x) { return __builtin_convertvector(x, Ints); }
JSS_INLINE float to_float(int32_t x) { return static_cast<float>(x); }
JSS_INLINE Floats to_float(Ints x) { return __builtin_convertvector(x, Floats); }
JSS_INLINE float bits_to_float(int32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}
JSS_INLINE Floats bits_to_float(Ints x) {
  Floats f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// exp(x) for x in [-88, 0] (a float or 16 of them), ~2 ulp; exactly 0 below
// about -87.7 (where 2^n would leave the normal range).  No calls and no
// branches, so plain loops over it vectorise too; callers clamp first, in a
// loop of their own (GCC turns a clamp inside into a branch).
template <typename F>
JSS_INLINE F exp_clamped(F x) {
  const auto n = to_int(x * 1.44269504f - 0.5f);  // round(x / ln 2), x <= 0
  const F r = x - to_float(n) * 0.693359375f + to_float(n) * 2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * bits_to_float((n + 127) << 23);  // 2^n; +0 at n = -127
}

constexpr float kExpFloor = -88.0f;

// exp(x) for any x <= 0, -inf included.
JSS_INLINE float exp_nonpositive(float x) { return exp_clamped(std::max(x, kExpFloor)); }

struct Shape {
  int64_t batch, T, q_heads, kv_heads, capacity, dim, groups;
  int64_t rows() const { return T * groups; }  // query rows per (batch row, kv head), ordered (t, g)
};

// One thread's share: a (batch row, kv head) pair and a key range, and where
// its running state lives: top[M], total[M], acc[M, D].
struct Chunk {
  int64_t pair, first_key, end_key;
  float *top, *total, *acc;
};

// What one chunk reads: its pair's query rows (scaled), keys, values and the
// last key each row may see (clipped to the chunk).
struct ChunkInput {
  const float* keys;    // [capacity, D] of this pair
  const float* values;  // [capacity, D] of this pair
  std::vector<float> q;  // [M, D], scaled
  std::vector<int64_t> last;  // [M]: the last key each row sees in this chunk (< first_key: none)
  int64_t first_key, end_key;  // keys this chunk reads: [first_key, end_key)
};

// For each of kRows rows: acc[D] = acc * decay + sum_j weight[j * stride] *
// values[j], j < n.  Rows taken together share the loads of the values and
// give the FMA units independent chains.
template <int64_t kDim, int64_t kRows>
JSS_INLINE void accumulate_values(float* const* acc, const float* decay, const float* const* weight, int64_t stride,
                                  const float* values, int64_t n, int64_t dim) {
  if constexpr (kDim > 0) {
    constexpr int64_t kChunks = kDim / kLanes;
    Floats local[kRows][kChunks];  // in registers for the fixed head dims
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kChunks; ++c) local[r][c] = load(acc[r] + c * kLanes) * decay[r];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t c = 0; c < kChunks; ++c) {
        const Floats value = load(values + j * kDim + c * kLanes);
        for (int64_t r = 0; r < kRows; ++r) local[r][c] += weight[r][j * stride] * value;
      }
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t c = 0; c < kChunks; ++c) store(acc[r] + c * kLanes, local[r][c]);
  } else {
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t d = 0; d < dim; ++d) acc[r][d] *= decay[r];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < dim; ++d) acc[r][d] += weight[r][j * stride] * values[j * dim + d];
    }
  }
}

// The sum of a vector's lanes.
JSS_INLINE float lane_sum(Floats x) {
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += x[l];
  return sum;
}

// The scores of a tile's n keys for one query row qm, into p.  For the fixed
// head dims kKeys keys are scored at once, each in its own vector
// accumulator (independent FMA chains instead of one dependent one); past
// the end the last key is read again (j + u < kTile, as j < n <= kTile and
// kTile is a multiple of kKeys).
template <int64_t kDim>
JSS_INLINE void score_keys(const float* qm, const float* keys, int64_t n, int64_t dim, float* p) {
  if constexpr (kDim > 0) {
    for (int64_t j = 0; j < n; j += kKeys) {
      Floats acc[kKeys] = {};
      for (int64_t c = 0; c < kDim; c += kLanes) {
        const Floats x = load(qm + c);
        for (int64_t u = 0; u < kKeys; ++u) acc[u] += x * load(keys + std::min(j + u, n - 1) * kDim + c);
      }
      for (int64_t u = 0; u < kKeys; ++u) p[j + u] = lane_sum(acc[u]);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const float* key = keys + j * dim;
      float score = 0.0f;
#pragma omp simd reduction(+ : score)
      for (int64_t d = 0; d < dim; ++d) score += qm[d] * key[d];
      p[j] = score;
    }
  }
}

// Few query rows (T = 1 decoding): one row at a time, a dot product per key.
template <int64_t kDim>
JSS_INLINE void rows_by_dot(const ChunkInput& in, int64_t M, int64_t dim, const Chunk& chunk) {
  const int64_t D = kDim > 0 ? kDim : dim;
  float p[kTile];  // a tile's scores, then its weights
  for (int64_t m = 0; m < M; ++m) {
    const float* qm = in.q.data() + m * D;
    const int64_t end = std::min(in.end_key, in.last[m] + 1);
    float top = kNegInf, total = 0.0f;
    float* acc = chunk.acc + m * D;
    for (int64_t start = in.first_key; start < end; start += kTile) {
      const int64_t n = std::min(kTile, end - start);
      score_keys<kDim>(qm, in.keys + start * D, n, D, p);
      float tile_top = kNegInf;
      for (int64_t j = 0; j < n; ++j) tile_top = std::max(tile_top, p[j]);
      const float new_top = std::max(top, tile_top);
      for (int64_t j = 0; j < n; ++j) p[j] = std::max(p[j] - new_top, kExpFloor);
      float tile_total = 0.0f;
#pragma omp simd reduction(+ : tile_total)
      for (int64_t j = 0; j < n; ++j) {
        p[j] = exp_clamped(p[j]);
        tile_total += p[j];
      }
      const float decay = exp_nonpositive(top - new_top);  // 0 while nothing was seen
      top = new_top;
      total = total * decay + tile_total;
      const float* weights = p;
      accumulate_values<kDim, 1>(&acc, &decay, &weights, 1, in.values + start * D, n, D);
    }
    chunk.top[m] = top;
    chunk.total[m] = total;
  }
}

// Many query rows: kLanes rows at a time with the rows in the vector lanes, so
// a score needs no horizontal sum; the softmax is vectorised over rows too.
// Keys are the outer loop: each tile of keys is scored against every block
// of rows while it is in cache, so the keys and values are read from memory
// once however many rows there are (speculative lanes folded into rows read
// their shared prefix once).
template <int64_t kDim>
JSS_INLINE void rows_in_lanes(const ChunkInput& in, int64_t M, int64_t dim, const Chunk& chunk) {
  const int64_t D = kDim > 0 ? kDim : dim;
  const Floats neg_inf = Floats{} + kNegInf, floor = Floats{} + kExpFloor;
  const int64_t blocks = (M + kLanes - 1) / kLanes;
  std::vector<float> qt(blocks * D * kLanes);  // per block of rows: [D, kLanes], the rows transposed
  // Per block, kLanes values each, read and written with load/store (memcpy:
  // a std::vector of vector types would not be aligned for them).
  std::vector<float> tops(blocks * kLanes, kNegInf), totals(blocks * kLanes, 0.0f);  // running max and sum
  std::vector<int32_t> lasts(blocks * kLanes);  // each row's last visible key
  std::vector<int64_t> ends(blocks);          // the keys each block reads: [first_key, end)
  int64_t end_all = in.first_key;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t m0 = block * kLanes, rows = std::min(kLanes, M - m0);
    float* q_block = qt.data() + block * D * kLanes;
    ends[block] = in.first_key;
    for (int64_t r = 0; r < kLanes; ++r) {
      lasts[block * kLanes + r] = static_cast<int32_t>(r < rows ? in.last[m0 + r] : -1);
      ends[block] = std::max(ends[block], std::min<int64_t>(in.end_key, lasts[block * kLanes + r] + int64_t{1}));
      for (int64_t d = 0; d < D; ++d) q_block[d * kLanes + r] = r < rows ? in.q[(m0 + r) * D + d] : 0.0f;
    }
    end_all = std::max(end_all, ends[block]);
  }
  Floats s[kTile];  // a tile's scores (one vector of rows per key), then its weights
  for (int64_t start = in.first_key; start < end_all; start += kTile) {
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t end = ends[block];
      if (start >= end) continue;
      const int64_t m0 = block * kLanes, rows = std::min(kLanes, M - m0);
      const int64_t n = std::min(kTile, end - start);
      const float* q_block = qt.data() + block * D * kLanes;
      const Ints last = load_ints(lasts.data() + block * kLanes);
      // Scores of kKeys keys at once (independent chains); past the end the
      // last key is read again and masked by its position.
      for (int64_t j = 0; j < n; j += kKeys) {
        const float* key[kKeys];
        for (int64_t u = 0; u < kKeys; ++u) key[u] = in.keys + std::min(start + j + u, end - 1) * D;
        Floats acc[kKeys] = {};
        for (int64_t d = 0; d < D; ++d) {
          const Floats x = load(q_block + d * kLanes);
          for (int64_t u = 0; u < kKeys; ++u) acc[u] += x * key[u][d];
        }
        for (int64_t u = 0; u < kKeys; ++u)
          s[j + u] = static_cast<int32_t>(start + j + u) <= last ? acc[u] : neg_inf;
      }
      const Floats top = load(tops.data() + block * kLanes);
      Floats new_top = top, tile_total{};
      for (int64_t j = 0; j < n; ++j) new_top = vmax(new_top, s[j]);
      const Floats shift = new_top == neg_inf ? Floats{} : new_top;  // rows that saw nothing: exp(-inf) = 0
      const Floats decay = exp_clamped(vmax(top - shift, floor));
      for (int64_t j = 0; j < n; ++j) {
        s[j] = exp_clamped(vmax(s[j] - shift, floor));
        tile_total += s[j];
      }
      store(totals.data() + block * kLanes, load(totals.data() + block * kLanes) * decay + tile_total);
      store(tops.data() + block * kLanes, new_top);
      // Weights past a row's last key are exactly 0, so rows go two by two over the tile's n keys.
      const float* weights = reinterpret_cast<const float*>(s);
      for (int64_t r = 0; r < rows; r += 2) {
        float* acc[2] = {chunk.acc + (m0 + r) * D, chunk.acc + (m0 + r + 1) * D};
        const float row_decay[2] = {decay[r], decay[r + 1]};
        const float* row_weights[2] = {weights + r, weights + r + 1};
        if (r + 1 < rows) {
          accumulate_values<kDim, 2>(acc, row_decay, row_weights, kLanes, in.values + start * D, n, D);
        } else {
          accumulate_values<kDim, 1>(acc, row_decay, row_weights, kLanes, in.values + start * D, n, D);
        }
      }
    }
  }
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t m0 = block * kLanes, rows = std::min(kLanes, M - m0);
    for (int64_t r = 0; r < rows; ++r) {
      chunk.top[m0 + r] = tops[block * kLanes + r];
      chunk.total[m0 + r] = totals[block * kLanes + r];
    }
  }
}

// Runs the online softmax of one chunk.  kDim > 0 fixes the head dim at
// compile time (the common sizes, a multiple of kLanes); kDim == 0 reads it
// from `shape` (any head dim, slower).
template <int64_t kDim>
JSS_INLINE void run_chunk(const Shape& shape, const float* q, const float* k, const float* v, const int64_t* last,
                          float scale, const Chunk& chunk) {
  const int64_t D = kDim > 0 ? kDim : shape.dim;
  const int64_t M = shape.rows(), G = shape.groups;
  const int64_t b = chunk.pair / shape.kv_heads, h = chunk.pair % shape.kv_heads;
  ChunkInput in{k + chunk.pair * shape.capacity * D, v + chunk.pair * shape.capacity * D,
                std::vector<float>(M * D), std::vector<int64_t>(M), chunk.first_key, chunk.end_key};
  for (int64_t m = 0; m < M; ++m) {
    const float* row = q + ((b * shape.T + m / G) * shape.q_heads + h * G + m % G) * D;
    for (int64_t d = 0; d < D; ++d) in.q[m * D + d] = row[d] * scale;
    in.last[m] = last[b * shape.T + m / G];
  }
  std::fill(chunk.acc, chunk.acc + M * D, 0.0f);
  if (M >= kLaneRows) {
    rows_in_lanes<kDim>(in, M, D, chunk);
  } else {
    rows_by_dot<kDim>(in, M, D, chunk);
  }
}

// One chunk at the head dim's specialisation, compiled for baseline x86-64
// and again for AVX2+FMA and AVX-512 (picked at load time where supported).
JSS_TARGET_CLONES void run_chunk_any(const Shape& shape, const float* q, const float* k, const float* v,
                                     const int64_t* last, float scale, const Chunk& chunk) {
  switch (shape.dim) {
    case 16: return run_chunk<16>(shape, q, k, v, last, scale, chunk);
    case 32: return run_chunk<32>(shape, q, k, v, last, scale, chunk);
    case 64: return run_chunk<64>(shape, q, k, v, last, scale, chunk);
    case 128: return run_chunk<128>(shape, q, k, v, last, scale, chunk);
    case 256: return run_chunk<256>(shape, q, k, v, last, scale, chunk);
    default: return run_chunk<0>(shape, q, k, v, last, scale, chunk);
  }
}

// Runs work(0) .. work(count - 1) on the calling thread and up to
// `helpers` pool threads.  Each index is claimed once through an atomic
// counter, so a helper that starts late (or never) only finds nothing left;
// the caller returns once every claimed index has finished.
void parallel_for(ffi::ThreadPool& pool, int64_t helpers, int64_t count, const std::function<void(int64_t)>& work) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  const std::function<void(int64_t)>* shared_work = &work;
  const auto drain = [progress, shared_work, count] {
    for (int64_t i; (i = progress->next.fetch_add(1)) < count;) {
      (*shared_work)(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(std::function<void()>(drain));
  drain();
  while (progress->done.load(std::memory_order_acquire) < count) std::this_thread::yield();
}

// Typed buffers of a fixed rank (the FFI checks dtype and rank before the call).
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using F32x3 = ffi::Buffer<ffi::F32, 3>;
using S32x2 = ffi::Buffer<ffi::S32, 2>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;

ffi::Error DecodeAttention(ffi::ThreadPool pool, F32x4 q, F32x4 k, F32x4 v, S32x1 lengths, S32x2 q_positions,
                           ffi::Result<F32x4> out, ffi::Result<F32x3> lse, float scale, bool causal, bool relative) {
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), v_dims = v.dimensions();
  if (!std::equal(k_dims.begin(), k_dims.end(), v_dims.begin()) || q_dims[0] != k_dims[0] ||
      q_dims[3] != k_dims[3] || k_dims[1] == 0 || q_dims[2] % k_dims[1] != 0 ||
      lengths.dimensions()[0] != q_dims[0] || q_positions.dimensions()[0] != q_dims[0] ||
      q_positions.dimensions()[1] != q_dims[1]) {
    return ffi::Error::InvalidArgument("decode attention: q [B, T, Hq, D] and k, v [B, Hk, C, D] do not match");
  }
  const Shape shape{q_dims[0], q_dims[1], q_dims[2], k_dims[1], k_dims[2], q_dims[3], q_dims[2] / k_dims[1]};
  const int64_t M = shape.rows(), D = shape.dim, pairs = shape.batch * shape.kv_heads;

  // Last visible key of every query, clipped to the cache: -1 sees nothing.
  std::vector<int64_t> last(shape.batch * shape.T);
  int64_t work = 0;
  std::vector<int64_t> pair_keys(shape.batch, 0);
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t length = std::clamp<int64_t>(lengths.typed_data()[b], 0, shape.capacity);
    for (int64_t t = 0; t < shape.T; ++t) {
      int64_t visible = length - 1;
      if (causal) {
        const int64_t position = q_positions.typed_data()[b * shape.T + t] + (relative ? lengths.typed_data()[b] : 0);
        visible = std::min<int64_t>(visible, position);
      }
      last[b * shape.T + t] = std::max<int64_t>(visible, -1);
      pair_keys[b] = std::max(pair_keys[b], last[b * shape.T + t] + 1);
      work += last[b * shape.T + t] + 1;
    }
  }
  work *= shape.groups * shape.kv_heads;
  int64_t keys_read = 0;
  for (int64_t b = 0; b < shape.batch; ++b) keys_read += pair_keys[b] * shape.kv_heads;

  // Chunks: one per pair, or each pair's keys split so both threads have work.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool parallel = threads > 1 && (keys_read >= kParallelKeys || work >= kParallelWork);
  int64_t splits = 1;
  if (parallel && pairs < 4 * threads) splits = (4 * threads + pairs - 1) / pairs;
  std::vector<Chunk> chunks;
  std::vector<float> state(pairs * splits * M * (D + 2));
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t keys = pair_keys[pair / shape.kv_heads];
    const int64_t size = std::max((keys + splits - 1) / splits, std::min(keys, kChunkKeys));
    for (int64_t s = 0; s < splits; ++s) {
      float* base = state.data() + (pair * splits + s) * M * (D + 2);
      chunks.push_back({pair, std::min(keys, s * size), std::min(keys, (s + 1) * size), base, base + M,
                        base + 2 * M});
    }
  }
  const std::function<void(int64_t)> run_one = [&](int64_t i) {
    run_chunk_any(shape, q.typed_data(), k.typed_data(), v.typed_data(), last.data(), scale, chunks[i]);
  };
  if (parallel) {
    parallel_for(pool, threads - 1, static_cast<int64_t>(chunks.size()), run_one);
  } else {
    for (size_t i = 0; i < chunks.size(); ++i) run_one(static_cast<int64_t>(i));
  }

  // Merge each pair's chunks by log-sum-exp and normalise into q's layout.
  float* out_data = out->typed_data();
  float* lse_data = lse->typed_data();
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / shape.kv_heads, h = pair % shape.kv_heads;
    const Chunk* mine = chunks.data() + pair * splits;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t head = h * shape.groups + m % shape.groups, t = m / shape.groups;
      float* o = out_data + ((b * shape.T + t) * shape.q_heads + head) * D;
      float top = kNegInf;
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, mine[s].top[m]);
      std::fill(o, o + D, 0.0f);
      float total = 0.0f;
      if (top != kNegInf) {
        for (int64_t s = 0; s < splits; ++s) {
          const float weight = exp_nonpositive(mine[s].top[m] - top);
          total += weight * mine[s].total[m];
          const float* acc = mine[s].acc + m * D;
          for (int64_t d = 0; d < D; ++d) o[d] += weight * acc[d];
        }
        for (int64_t d = 0; d < D; ++d) o[d] /= total;
      }
      lse_data[(b * shape.T + t) * shape.q_heads + head] = total > 0.0f ? top + std::log(total) : kNegInf;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssDecodeAttentionF32, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()  // q [B, T, Hq, D]
                                  .Arg<F32x4>()  // k [B, Hk, C, D]
                                  .Arg<F32x4>()  // v [B, Hk, C, D]
                                  .Arg<S32x1>()  // lengths [B]
                                  .Arg<S32x2>()  // q_positions [B, T]
                                  .Ret<F32x4>()  // out [B, T, Hq, D]
                                  .Ret<F32x3>()  // lse [B, T, Hq]
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("relative"));
