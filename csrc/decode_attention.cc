// Decode attention over a K/V cache, for XLA:CPU through the XLA FFI.
//
// The semantics are those of jax_session_state.attention.attend_with_lse on a
// KVView with window=None (JssDecodeAttention: k, v [B, Hk, C, D], the first
// lengths[b] rows of k[b, h] read in place) or on a PagedView
// (JssPagedDecodeAttention: token-major pages [P, S, Hk, D], row p of batch
// row b in page page_table[b, p / S], read page by page where it lies) or on
// a ring (JssRingDecodeAttention: k, v [B, Hk, slots, D], positions below
// sink in their own slot and a later position p in slot
// sink + (p - sink) % (slots - sink); the sinks and the window
// window_start[b]..lengths[b] - 1 read by position where they lie, the
// window a run that may wrap).  A query at position qp sees key p when
// p < lengths[b], if causal p <= qp, and on a ring p < sink or
// qp - p < window; qp is q_positions[b, t], plus lengths[b] when the
// attribute relative is set (offsets from the end).  Query head h * G + g reads kv head
// h (GQA with G = q_heads / kv_heads).  A query that sees nothing gets zeros
// and lse = -inf.  The cache is float32, bfloat16 or float16, or quantized
// (JssQuantizedDecodeAttention, JssQuantizedPagedDecodeAttention): int8 or
// float8_e4m3fn values with one float32 scale per row and kv head for K and
// one for V, applied to the scores and to the weights of the values, never
// to a dequantized copy.  Queries, accumulation and results are float32.
//
// Work: for every (batch row, kv head) pair, its T * G query rows walk the
// keys in tiles (kTile keys; longer where few rows read the rows in place)
// with an online softmax (running max, sum and accumulator per row), so a
// step costs what is valid, not what is allocated.
// A paged cache's kv heads of one batch row take each tile in turn (their
// rows of a page lie together) and prefetch the next tile's pages, which lie
// in any order, a few cache lines at a time while this one is read.
// Large steps split each pair's keys into chunks run on XLA's intra-op thread
// pool and merged exactly by log-sum-exp; small ones run on the calling
// thread (waking a pool thread costs more than they do).
//
// The inner loops (decode_attention_isa.h and the parts it includes) are
// compiled once per instruction set (x86-64 baseline, AVX2+FMA, AVX-512; one
// generic build elsewhere), each in a source of its own
// (decode_attention_chunks.h), with vectors exactly one register wide; the
// best path the CPU runs is used unless JssSelectIsa picks another.  On the SSE2
// path int8 rows at T = 1 are read in integers (decode_attention_sse2_int8.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_attention_chunks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace jss::attention;  // what the paths share, and the paths

namespace {

constexpr int64_t kChunkKeys = 512;         // the fewest keys one thread's chunk gets
// A step runs on the pool when it reads at least kParallelKeys key rows (K/V
// bytes dominate: decoding is bound by memory bandwidth) or scores at least
// kParallelWork (query row, key) pairs; below both, one thread is faster
// than waking another (measured on XLA:CPU, 8 kv-heads x 64).
constexpr int64_t kParallelKeys = 4096;
constexpr int64_t kParallelWork = 1 << 17;

constexpr int64_t element_bytes(Dtype dtype) {
  return dtype == Dtype::kF32 ? 4 : (dtype == Dtype::kI8 || dtype == Dtype::kF8) ? 1 : 2;
}

struct Shape {
  int64_t batch, T, q_heads, kv_heads, capacity, dim, groups;
  int64_t rows() const { return T * groups; }  // query rows per (batch row, kv head), ordered (t, g)
};

struct Isa {
  const char* name;
  ChunkFn run;
  bool (*supported)();
};

#ifdef JSS_X86
bool always() { return true; }
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  __builtin_cpu_init();
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}
const Isa kIsas[] = {{"baseline", baseline::run_chunks, always},
                     {"avx2", avx2::run_chunks, has_avx2},
                     {"avx512", avx512::run_chunks, has_avx512}};
#else
bool always() { return true; }
const Isa kIsas[] = {{"baseline", generic::run_chunks, always}};
#endif
constexpr int kIsaCount = sizeof(kIsas) / sizeof(kIsas[0]);

// The best path this CPU runs, until JssSelectIsa picks another.
const Isa* best_isa() {
  for (int i = kIsaCount - 1; i > 0; --i)
    if (kIsas[i].supported()) return &kIsas[i];
  return &kIsas[0];
}
std::atomic<const Isa*> current_isa{nullptr};
const Isa* isa() {
  const Isa* chosen = current_isa.load(std::memory_order_acquire);
  if (chosen == nullptr) {
    chosen = best_isa();
    current_isa.store(chosen, std::memory_order_release);
  }
  return chosen;
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

// The cache's element type, or false where the kernel does not read it
// (a float type unquantized; int8 or float8_e4m3fn quantized).
bool cache_dtype(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, bool quantized, Dtype* dtype) {
  if (k.element_type() != v.element_type()) return false;
  switch (k.element_type()) {
    case ffi::DataType::F32: *dtype = Dtype::kF32; return !quantized;
    case ffi::DataType::BF16: *dtype = Dtype::kBF16; return !quantized;
    case ffi::DataType::F16: *dtype = Dtype::kF16; return !quantized;
    case ffi::DataType::S8: *dtype = Dtype::kI8; return quantized;
    case ffi::DataType::F8E4M3FN: *dtype = Dtype::kF8; return quantized;
    default: return false;
  }
}

// Row scales of a quantized cache: float32, one per row of the cache (its
// shape without head_dim, a trailing 1 allowed).
bool scales_match(const ffi::AnyBuffer& scale, const ffi::AnyBuffer& cache) {
  const auto dims = scale.dimensions(), cache_dims = cache.dimensions();
  if (scale.element_type() != ffi::DataType::F32 || (dims.size() != 3 && dims.size() != 4)) return false;
  if (dims.size() == 4 && dims[3] != 1) return false;
  return std::equal(dims.begin(), dims.begin() + 3, cache_dims.begin());
}

// Which keys each query sees and which each batch row reads.  A query row
// sees keys first..last of a windowed span and 0..last of any other; a batch
// row reads its spans' keys [first, end) (a cache: one span from 0; a ring:
// its sinks, then its window, windowed).
struct Span {
  int64_t first, end;
  bool windowed;
};
struct Visible {
  std::vector<int64_t> first, last;  // [B * T]: -1 for last sees nothing
  int64_t spans;                     // per batch row
  std::vector<Span> span;            // [B, spans]
};

// A cache's keys 0..lengths[b] - 1 (clipped to its capacity), up to each
// query's position where causal.
Visible prefix_keys(const Shape& shape, const int32_t* lengths, const int32_t* q_positions, bool causal,
                    bool relative) {
  Visible keys{std::vector<int64_t>(shape.batch * shape.T, 0), std::vector<int64_t>(shape.batch * shape.T), 1,
               std::vector<Span>(shape.batch, Span{0, 0, false})};
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t length = std::clamp<int64_t>(lengths[b], 0, shape.capacity);
    for (int64_t t = 0; t < shape.T; ++t) {
      int64_t visible = length - 1;
      if (causal) {
        const int64_t position = q_positions[b * shape.T + t] + (relative ? lengths[b] : 0);
        visible = std::min<int64_t>(visible, position);
      }
      keys.last[b * shape.T + t] = std::max<int64_t>(visible, -1);
      keys.span[b].end = std::max(keys.span[b].end, keys.last[b * shape.T + t] + 1);
    }
  }
  return keys;
}

// A ring's keys, by position: its sinks 0..sink - 1 and its window
// window_start[b]..lengths[b] - 1 (a run that wraps in the ring's slots),
// up to each query's position where causal, and in the window from
// qp - window + 1 on.
Visible ring_keys(const Shape& shape, const int32_t* lengths, const int32_t* window_start,
                  const int32_t* q_positions, bool causal, bool relative, int64_t sink, int64_t ring,
                  int64_t window) {
  Visible keys{std::vector<int64_t>(shape.batch * shape.T), std::vector<int64_t>(shape.batch * shape.T), 2,
               std::vector<Span>(2 * shape.batch)};
  for (int64_t b = 0; b < shape.batch; ++b) {
    const int64_t end = std::max<int64_t>(lengths[b], 0);
    // The window held: never below the sinks, nor more than the ring holds.
    const int64_t held = std::min(end, std::max({static_cast<int64_t>(window_start[b]), sink, end - ring}));
    int64_t latest = -1, earliest = end;
    for (int64_t t = 0; t < shape.T; ++t) {
      const int64_t position = q_positions[b * shape.T + t] + (relative ? lengths[b] : 0);
      const int64_t last = std::max<int64_t>(-1, causal ? std::min(end - 1, position) : end - 1);
      const int64_t first = std::max(held, position - window + 1);
      keys.last[b * shape.T + t] = last;
      keys.first[b * shape.T + t] = first;
      latest = std::max(latest, last);
      earliest = std::min(earliest, first);
    }
    keys.span[2 * b] = Span{0, std::min({sink, end, latest + 1}), false};
    const int64_t window_end = std::min(end, latest + 1);
    keys.span[2 * b + 1] = Span{std::min(earliest, window_end), window_end, true};
  }
  return keys;
}

// Attention of every query over its pair's rows, as source(pair) lays them
// out, over the keys of keys.  Runs of pairs_together pairs (of one batch
// row) read each key range together: a paged cache's kv heads, whose rows
// of a page lie side by side.
ffi::Error Attend(ffi::ThreadPool& pool, const Shape& shape, const float* q, const std::function<PairSource(int64_t)>& source,
                  const Visible& keys, float* out_data, float* lse_data, float scale, int64_t pairs_together) {
  const int64_t M = shape.rows(), D = shape.dim, pairs = shape.batch * shape.kv_heads;
  const int64_t runs = pairs / pairs_together;
  const std::vector<int64_t>&first = keys.first, &last = keys.last;

  // The work: (query row, key) pairs scored, and key rows read.
  int64_t work = 0, keys_read = 0;
  std::vector<int64_t> row_keys(shape.batch, 0);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t s = 0; s < keys.spans; ++s) {
      const Span& span = keys.span[b * keys.spans + s];
      row_keys[b] += std::max<int64_t>(0, span.end - span.first);
      for (int64_t t = 0; t < shape.T; ++t) {
        const int64_t from = span.windowed ? std::max(span.first, first[b * shape.T + t]) : span.first;
        work += std::max<int64_t>(0, std::min(span.end, last[b * shape.T + t] + 1) - from);
      }
    }
    keys_read += row_keys[b] * shape.kv_heads;
  }
  work *= shape.groups * shape.kv_heads;

  // Chunks: one per pair and span, or each pair's keys split so both threads
  // have work (cut where its spans meet too); the pairs of a run split alike.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const bool parallel = threads > 1 && (keys_read >= kParallelKeys || work >= kParallelWork);
  int64_t splits = 1;
  if (parallel && runs < 4 * threads) splits = (4 * threads + runs - 1) / runs;
  // Each pair's pieces: [first, end) and windowed; as many for every pair (the most any has, empty ones after).
  std::vector<std::vector<Span>> pieces(pairs);
  int64_t per_pair = 1;
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / shape.kv_heads, total = row_keys[b];
    const int64_t size = std::max<int64_t>(1, std::max((total + splits - 1) / splits, std::min(total, kChunkKeys)));
    int64_t before = 0;  // keys of the spans before this one
    for (int64_t s = 0; s < keys.spans; ++s) {
      const Span& span = keys.span[b * keys.spans + s];
      const int64_t length = std::max<int64_t>(0, span.end - span.first);
      for (int64_t at = 0; at < length;) {  // cut where the whole row's keys reach a multiple of size
        const int64_t to = std::min(length, (before + at) / size * size + size - before);
        pieces[pair].push_back({span.first + at, span.first + to, span.windowed});
        at = to;
      }
      before += length;
    }
    per_pair = std::max<int64_t>(per_pair, pieces[pair].size());
  }
  std::vector<Chunk> chunks;  // [pairs, per_pair]
  std::vector<float> state(pairs * per_pair * M * (D + 2));
  for (int64_t pair = 0; pair < pairs; ++pair) {
    pieces[pair].resize(per_pair, Span{0, 0, false});
    for (int64_t c = 0; c < per_pair; ++c) {
      float* base = state.data() + (pair * per_pair + c) * M * (D + 2);
      const Span& piece = pieces[pair][c];
      chunks.push_back({pair, piece.first, piece.end, base, base + M, base + 2 * M, piece.windowed});
    }
  }
  const ChunkFn run_chunks = isa()->run;
  const std::function<void(int64_t)> run_one = [&](int64_t i) {  // run i / per_pair, chunk i % per_pair
    const int64_t first_pair = i / per_pair * pairs_together, G = shape.groups;
    std::vector<ChunkInput> ins;
    std::vector<Chunk> mine;
    std::unique_ptr<float[]> buffers;  // uninitialised: every tile is written before it is read
    for (int64_t pair = first_pair; pair < first_pair + pairs_together; ++pair) {
      const Chunk& chunk = chunks[pair * per_pair + i % per_pair];
      const int64_t b = pair / shape.kv_heads, h = pair % shape.kv_heads;
      ChunkInput in{source(pair), std::vector<float>(M * D), std::vector<int64_t>(M), std::vector<int64_t>(M, 0),
                    chunk.first_key, chunk.end_key, nullptr, nullptr, nullptr, nullptr};
      for (int64_t m = 0; m < M; ++m) {
        const float* row = q + ((b * shape.T + m / G) * shape.q_heads + h * G + m % G) * D;
        for (int64_t d = 0; d < D; ++d) in.q[m * D + d] = row[d] * scale;
        in.last[m] = last[b * shape.T + m / G];
        if (chunk.windowed) in.first[m] = first[b * shape.T + m / G];
      }
      if (!in.source.read_in_place()) {  // one set of tile buffers: the pairs take each tile in turn
        if (!buffers) buffers.reset(new float[2 * kTile * (D + 1)]);
        in.kbuf = buffers.get();
        in.vbuf = buffers.get() + kTile * D;
        in.ksbuf = buffers.get() + 2 * kTile * D;
        in.vsbuf = in.ksbuf + kTile;
      }
      ins.push_back(std::move(in));
      mine.push_back(chunk);
    }
    run_chunks(ins.data(), mine.data(), pairs_together, M, D);
  };
  const int64_t items = runs * per_pair;
  if (parallel) {
    parallel_for(pool, threads - 1, items, run_one);
  } else {
    for (int64_t i = 0; i < items; ++i) run_one(i);
  }

  // Merge each pair's chunks by log-sum-exp and normalise into q's layout.
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t b = pair / shape.kv_heads, h = pair % shape.kv_heads;
    const Chunk* mine = chunks.data() + pair * per_pair;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t head = h * shape.groups + m % shape.groups, t = m / shape.groups;
      float* o = out_data + ((b * shape.T + t) * shape.q_heads + head) * D;
      float top = kNegInf;
      for (int64_t s = 0; s < per_pair; ++s) top = std::max(top, mine[s].top[m]);
      std::fill(o, o + D, 0.0f);
      float total = 0.0f;
      if (top != kNegInf) {
        for (int64_t s = 0; s < per_pair; ++s) {
          const float weight = std::exp(std::max(mine[s].top[m] - top, kExpFloor));
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

bool queries_match(const Shape& shape, S32x1& lengths, S32x2& q_positions) {
  return shape.kv_heads > 0 && shape.q_heads % shape.kv_heads == 0 && lengths.dimensions()[0] == shape.batch &&
         q_positions.dimensions()[0] == shape.batch && q_positions.dimensions()[1] == shape.T;
}

// What a ring adds to a head-major cache: the first window position each
// batch row shows, the sinks and the window (in positions).
struct RingOperands {
  S32x1* window_start;
  int64_t sink, window;
};

// A head-major cache: k, v [B, Hk, C, D]; quantized, with k_scale, v_scale [B, Hk, C(, 1)]; with ring, a ring
// of C slots, read by position.
ffi::Error DenseAttention(ffi::ThreadPool& pool, F32x4& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                          const ffi::AnyBuffer* k_scale, const ffi::AnyBuffer* v_scale, S32x1& lengths,
                          S32x2& q_positions, ffi::Result<F32x4>& out, ffi::Result<F32x3>& lse, float scale,
                          bool causal, bool relative, const RingOperands* ring = nullptr) {
  Dtype dtype;
  const bool quantized = k_scale != nullptr;
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), v_dims = v.dimensions();
  if (!cache_dtype(k, v, quantized, &dtype) || k_dims.size() != 4 ||
      !std::equal(k_dims.begin(), k_dims.end(), v_dims.begin()) || q_dims[0] != k_dims[0] ||
      q_dims[3] != k_dims[3] || k_dims[1] == 0 ||
      (quantized && !(scales_match(*k_scale, k) && scales_match(*v_scale, v)))) {
    return ffi::Error::InvalidArgument(
        quantized ? "quantized decode attention: q [B, T, Hq, D] float32, k, v [B, Hk, C, D] int8 or float8_e4m3fn "
                    "and k_scale, v_scale [B, Hk, C, 1] float32 do not match"
                  : "decode attention: q [B, T, Hq, D] float32 and k, v [B, Hk, C, D] of one float type do not match");
  }
  const Shape shape{q_dims[0], q_dims[1], q_dims[2], k_dims[1], k_dims[2], q_dims[3], q_dims[2] / k_dims[1]};
  if (!queries_match(shape, lengths, q_positions))
    return ffi::Error::InvalidArgument("decode attention: lengths [B] and q_positions [B, T] do not match q");
  if (ring != nullptr && (ring->window_start->dimensions()[0] != shape.batch || ring->sink < 0 ||
                          ring->sink >= shape.capacity || ring->window <= 0))
    return ffi::Error::InvalidArgument("ring decode attention: window_start [B], 0 <= sink < slots and window > 0 "
                                       "do not match the cache");
  const int64_t row = shape.dim * element_bytes(dtype);
  const char *k_data = static_cast<const char*>(k.untyped_data()), *v_data = static_cast<const char*>(v.untyped_data());
  const float* k_scales = quantized ? static_cast<const float*>(k_scale->untyped_data()) : nullptr;
  const float* v_scales = quantized ? static_cast<const float*>(v_scale->untyped_data()) : nullptr;
  const auto source = [&](int64_t pair) {
    const int64_t offset = pair * shape.capacity * row;
    PairSource src{k_data + offset, v_data + offset, dtype, row, nullptr, 0, 0, 0};
    if (quantized) {
      src.k_scale = k_scales + pair * shape.capacity;
      src.v_scale = v_scales + pair * shape.capacity;
      src.scale_stride = 1;
    }
    if (ring != nullptr) {
      src.sink = ring->sink;
      src.ring = shape.capacity - ring->sink;
    }
    return src;
  };
  const Visible keys =
      ring == nullptr
          ? prefix_keys(shape, lengths.typed_data(), q_positions.typed_data(), causal, relative)
          : ring_keys(shape, lengths.typed_data(), ring->window_start->typed_data(), q_positions.typed_data(), causal,
                      relative, ring->sink, shape.capacity - ring->sink, ring->window);
  return Attend(pool, shape, q.typed_data(), source, keys, out->typed_data(), lse->typed_data(), scale, 1);
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, S32x1 lengths,
                           S32x2 q_positions, ffi::Result<F32x4> out, ffi::Result<F32x3> lse, float scale, bool causal,
                           bool relative) {
  return DenseAttention(pool, q, k, v, nullptr, nullptr, lengths, q_positions, out, lse, scale, causal, relative);
}

ffi::Error QuantizedDecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, S32x1 lengths, S32x2 q_positions,
                                    ffi::Result<F32x4> out, ffi::Result<F32x3> lse, float scale, bool causal,
                                    bool relative) {
  return DenseAttention(pool, q, k, v, &k_scale, &v_scale, lengths, q_positions, out, lse, scale, causal, relative);
}

ffi::Error RingDecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, S32x1 window_start,
                               S32x1 lengths, S32x2 q_positions, ffi::Result<F32x4> out, ffi::Result<F32x3> lse,
                               float scale, bool causal, bool relative, int64_t sink, int64_t window) {
  const RingOperands ring{&window_start, sink, window};
  return DenseAttention(pool, q, k, v, nullptr, nullptr, lengths, q_positions, out, lse, scale, causal, relative,
                        &ring);
}

ffi::Error QuantizedRingDecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                        ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, S32x1 window_start,
                                        S32x1 lengths, S32x2 q_positions, ffi::Result<F32x4> out,
                                        ffi::Result<F32x3> lse, float scale, bool causal, bool relative, int64_t sink,
                                        int64_t window) {
  const RingOperands ring{&window_start, sink, window};
  return DenseAttention(pool, q, k, v, &k_scale, &v_scale, lengths, q_positions, out, lse, scale, causal, relative,
                        &ring);
}

// A paged cache: k_pages, v_pages [P, S, Hk, D] (token-major pages), page_table [B, pages per row];
// quantized, with scale pages k_scale, v_scale [P, S, Hk(, 1)].
ffi::Error PagedAttention(ffi::ThreadPool& pool, F32x4& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                          const ffi::AnyBuffer* k_scale, const ffi::AnyBuffer* v_scale, S32x2& page_table,
                          S32x1& lengths, S32x2& q_positions, ffi::Result<F32x4>& out, ffi::Result<F32x3>& lse,
                          float scale, bool causal, bool relative) {
  Dtype dtype;
  const bool quantized = k_scale != nullptr;
  const auto q_dims = q.dimensions(), k_dims = k.dimensions(), v_dims = v.dimensions();
  const auto table_dims = page_table.dimensions();
  if (!cache_dtype(k, v, quantized, &dtype) || k_dims.size() != 4 ||
      !std::equal(k_dims.begin(), k_dims.end(), v_dims.begin()) || q_dims[0] != table_dims[0] ||
      q_dims[3] != k_dims[3] || k_dims[0] == 0 || k_dims[2] == 0 ||
      (quantized && !(scales_match(*k_scale, k) && scales_match(*v_scale, v)))) {
    return ffi::Error::InvalidArgument(
        quantized ? "quantized paged decode attention: q [B, T, Hq, D] float32, pages [P, S, Hk, D] int8 or "
                    "float8_e4m3fn, scale pages [P, S, Hk, 1] float32 and page_table [B, N] do not match"
                  : "paged decode attention: q [B, T, Hq, D] float32, pages [P, S, Hk, D] of one float type and "
                    "page_table [B, N] do not match");
  }
  const int64_t page_size = k_dims[1], kv_heads = k_dims[2];
  const Shape shape{q_dims[0], q_dims[1], q_dims[2], kv_heads, table_dims[1] * page_size, q_dims[3],
                    q_dims[2] / kv_heads};
  if (!queries_match(shape, lengths, q_positions))
    return ffi::Error::InvalidArgument("paged decode attention: lengths [B] and q_positions [B, T] do not match q");
  const int64_t row = shape.dim * element_bytes(dtype);
  const char *k_data = static_cast<const char*>(k.untyped_data()), *v_data = static_cast<const char*>(v.untyped_data());
  const float* k_scales = quantized ? static_cast<const float*>(k_scale->untyped_data()) : nullptr;
  const float* v_scales = quantized ? static_cast<const float*>(v_scale->untyped_data()) : nullptr;
  const int32_t* table = page_table.typed_data();
  const auto source = [&](int64_t pair) {
    const int64_t b = pair / kv_heads, h = pair % kv_heads;
    PairSource src{k_data + h * row, v_data + h * row, dtype, kv_heads * row, table + b * table_dims[1],
                   page_size, page_size * kv_heads * row, k_dims[0]};
    if (quantized) {
      src.k_scale = k_scales + h;
      src.v_scale = v_scales + h;
      src.scale_stride = kv_heads;
      src.scale_page_stride = page_size * kv_heads;
    }
    return src;
  };
  return Attend(pool, shape, q.typed_data(), source,
                prefix_keys(shape, lengths.typed_data(), q_positions.typed_data(), causal, relative),
                out->typed_data(), lse->typed_data(), scale, kv_heads);
}

ffi::Error PagedDecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v, S32x2 page_table,
                                S32x1 lengths, S32x2 q_positions, ffi::Result<F32x4> out, ffi::Result<F32x3> lse,
                                float scale, bool causal, bool relative) {
  return PagedAttention(pool, q, k, v, nullptr, nullptr, page_table, lengths, q_positions, out, lse, scale, causal,
                        relative);
}

ffi::Error QuantizedPagedDecodeAttention(ffi::ThreadPool pool, F32x4 q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                         ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, S32x2 page_table,
                                         S32x1 lengths, S32x2 q_positions, ffi::Result<F32x4> out,
                                         ffi::Result<F32x3> lse, float scale, bool causal, bool relative) {
  return PagedAttention(pool, q, k, v, &k_scale, &v_scale, page_table, lengths, q_positions, out, lse, scale, causal,
                        relative);
}

}  // namespace

// What every handler's binding ends with: lengths [B], q_positions [B, T]
// (after the cache operands), out [B, T, Hq, D], lse [B, T, Hq] and the
// attributes scale, causal and relative.
template <typename Binding>
auto with_queries(Binding&& binding) {
  return std::move(binding)
      .template Arg<S32x1>()
      .template Arg<S32x2>()
      .template Ret<F32x4>()
      .template Ret<F32x3>()
      .template Attr<float>("scale")
      .template Attr<bool>("causal")
      .template Attr<bool>("relative");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssDecodeAttention, DecodeAttention,
                              with_queries(ffi::Ffi::Bind()
                                             .Ctx<ffi::ThreadPool>()
                                             .Arg<F32x4>()          // q [B, T, Hq, D]
                                             .Arg<ffi::AnyBuffer>()  // k [B, Hk, C, D]: f32, bf16 or f16
                                             .Arg<ffi::AnyBuffer>()));  // v [B, Hk, C, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssPagedDecodeAttention, PagedDecodeAttention,
                              with_queries(ffi::Ffi::Bind()
                                             .Ctx<ffi::ThreadPool>()
                                             .Arg<F32x4>()          // q [B, T, Hq, D]
                                             .Arg<ffi::AnyBuffer>()  // k_pages [P, S, Hk, D]: f32, bf16 or f16
                                             .Arg<ffi::AnyBuffer>()  // v_pages [P, S, Hk, D]
                                             .Arg<S32x2>()));  // page_table [B, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssQuantizedDecodeAttention, QuantizedDecodeAttention,
                              with_queries(ffi::Ffi::Bind()
                                             .Ctx<ffi::ThreadPool>()
                                             .Arg<F32x4>()          // q [B, T, Hq, D]
                                             .Arg<ffi::AnyBuffer>()  // k [B, Hk, C, D]: int8 or float8_e4m3fn
                                             .Arg<ffi::AnyBuffer>()  // v [B, Hk, C, D]
                                             .Arg<ffi::AnyBuffer>()  // k_scale [B, Hk, C, 1] float32
                                             .Arg<ffi::AnyBuffer>()));  // v_scale [B, Hk, C, 1] float32

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssQuantizedPagedDecodeAttention, QuantizedPagedDecodeAttention,
                              with_queries(ffi::Ffi::Bind()
                                             .Ctx<ffi::ThreadPool>()
                                             .Arg<F32x4>()          // q [B, T, Hq, D]
                                             .Arg<ffi::AnyBuffer>()  // k_pages [P, S, Hk, D]: int8 or float8_e4m3fn
                                             .Arg<ffi::AnyBuffer>()  // v_pages [P, S, Hk, D]
                                             .Arg<ffi::AnyBuffer>()  // k_scale pages [P, S, Hk, 1] float32
                                             .Arg<ffi::AnyBuffer>()  // v_scale pages [P, S, Hk, 1] float32
                                             .Arg<S32x2>()));  // page_table [B, N]

// A ring: window_start [B] (the first window position each row shows) after
// the cache operands, and the attributes sink and window (in positions).
template <typename Binding>
auto with_ring(Binding&& binding) {
  return with_queries(std::move(binding).template Arg<S32x1>())
      .template Attr<int64_t>("sink")
      .template Attr<int64_t>("window");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssRingDecodeAttention, RingDecodeAttention,
                              with_ring(ffi::Ffi::Bind()
                                          .Ctx<ffi::ThreadPool>()
                                          .Arg<F32x4>()          // q [B, T, Hq, D]
                                          .Arg<ffi::AnyBuffer>()  // k [B, Hk, slots, D]: f32, bf16 or f16
                                          .Arg<ffi::AnyBuffer>()));  // v [B, Hk, slots, D]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssQuantizedRingDecodeAttention, QuantizedRingDecodeAttention,
                              with_ring(ffi::Ffi::Bind()
                                          .Ctx<ffi::ThreadPool>()
                                          .Arg<F32x4>()          // q [B, T, Hq, D]
                                          .Arg<ffi::AnyBuffer>()  // k [B, Hk, slots, D]: int8 or float8_e4m3fn
                                          .Arg<ffi::AnyBuffer>()  // v [B, Hk, slots, D]
                                          .Arg<ffi::AnyBuffer>()  // k_scale [B, Hk, slots, 1] float32
                                          .Arg<ffi::AnyBuffer>()));  // v_scale [B, Hk, slots, 1] float32

// The instruction-set paths: their names ("baseline", "avx2", "avx512"),
// whether this CPU runs one, and the one in use.
extern "C" int JssIsaCount() { return kIsaCount; }
extern "C" const char* JssIsaName(int i) { return i >= 0 && i < kIsaCount ? kIsas[i].name : nullptr; }
extern "C" int JssIsaSupported(int i) { return i >= 0 && i < kIsaCount && kIsas[i].supported(); }
extern "C" const char* JssCurrentIsa() { return isa()->name; }
// Selects path i for calls from now on; returns 0, or -1 where the CPU lacks it.
extern "C" int JssSelectIsa(int i) {
  if (!JssIsaSupported(i)) return -1;
  current_isa.store(&kIsas[i], std::memory_order_release);
  return 0;
}
