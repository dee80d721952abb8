// Asking for K/V rows before they are read: cache lines ahead of a read in
// order (prefetch_lines), and a paged batch row's next tile, whose pages lie
// in any order, spread over this tile's work (SharePrefetch).
//
// A part of the per-ISA kernel: decode_attention_isa.h includes it once per
// instruction set, inside that set's namespace and target pragma, so it has
// no include guard and no #include (that would land inside the namespace);
// it uses decode_attention_tiles.h.

// Asks for the cache lines of bytes [0, bytes) from `elements` elements of
// E past p on into the L2 cache.  The address is worked out as an integer:
// near a buffer's end it may lie past it (a prefetch never faults).
template <typename E>
JSS_INLINE void prefetch_lines(const E* p, int64_t elements, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(elements) * sizeof(E);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(start + b), 0, 1);
}

// Share part of parts of the keys and values of a paged batch row's next
// tile, brought into the L2 cache a few lines at a time while this tile is
// read: pages lie in any order, where the CPU's prefetchers do not follow,
// and a burst of prefetches would wait for the core's few miss buffers
// (or be dropped) where, spread over the tile's work, they arrive while
// the FMAs run.  src is the row's first kv head: a run's rows of all its
// heads lie together, so each share is read in address order.
class SharePrefetch {
 public:
  // Nothing is asked for unless active (a paged pair with a next tile).
  // A quantized pair's row scales (a few lines per page) are asked for at once.
  SharePrefetch(const PairSource& src, const TileLayout& layout, int64_t part, int64_t parts, bool active)
      : src_(src), layout_(layout), part_(part), parts_(parts), runs_(active ? layout.count : 0) {
    for (int64_t r = 0; r < runs_; ++r) lines_ += (bytes_end(r) - bytes_begin(r) + 63) / 64;
    start_run(0);
    if (!src.quantized()) return;
    for (int64_t r = 0; r < runs_; ++r) {
      const int64_t span = layout.rows[r] * src.scale_stride * static_cast<int64_t>(sizeof(float));
      const char *k_scale = reinterpret_cast<const char*>(src.k_scale + layout.scale[r]),
                 *v_scale = reinterpret_cast<const char*>(src.v_scale + layout.scale[r]);
      for (int64_t byte = share_begin(span); byte < share_end(span); byte += 64) {
        __builtin_prefetch(k_scale + byte, 0, 1);
        __builtin_prefetch(v_scale + byte, 0, 1);
      }
    }
  }
  int64_t lines() const { return lines_; }
  // Asks for up to n more lines of K and of V.
  void issue(int64_t n) {
    for (; n > 0 && run_ < runs_; --n) {
      while (byte_ >= end_) {
        start_run(run_ + 1);
        if (run_ >= runs_) return;
      }
      __builtin_prefetch(src_.k + layout_.offset[run_] + byte_, 0, 1);
      __builtin_prefetch(src_.v + layout_.offset[run_] + byte_, 0, 1);
      byte_ += 64;
    }
  }

 private:
  // This part's bytes of a span of the given bytes, from a cache line's start.
  int64_t share_begin(int64_t bytes) const { return bytes * part_ / parts_ / 64 * 64; }
  int64_t share_end(int64_t bytes) const { return bytes * (part_ + 1) / parts_; }
  int64_t bytes_begin(int64_t r) const { return share_begin(layout_.rows[r] * src_.row_stride); }
  int64_t bytes_end(int64_t r) const { return share_end(layout_.rows[r] * src_.row_stride); }
  void start_run(int64_t r) {
    run_ = r;
    if (r < runs_) byte_ = bytes_begin(r), end_ = bytes_end(r);
  }
  const PairSource& src_;
  const TileLayout& layout_;
  int64_t part_, parts_, runs_, lines_ = 0, run_ = 0, byte_ = 0, end_ = 0;
};
