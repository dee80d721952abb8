// Rows written into a buffer in place, for XLA:CPU through the XLA FFI.
//
// XLA:CPU computes bfloat16 and float8 arrays in float32: before its fusion
// passes, every op on them, a dynamic-update-slice or a scatter included, is
// rewritten to convert the whole operand to float32 and back.  A one-row write
// into a donated bfloat16 cache then reads and writes the whole cache (32k
// rows of 8 heads x 64: 10-35 ms where float32 takes 13 us).  Bytes are bytes:
// JssWriteRows moves the written rows' bytes and nothing else, whatever the
// element type, into its operand 0, which its caller aliases to the result.
//
// Operands: buffer [*lead, S, *tail] (any element type), slots int32
// [*lead[:k], T] for some k <= len(lead), rows [*lead, T, *tail] of the
// buffer's type; the attribute tail_rank is len(tail).  Row t of every group
// of rows with leading index g goes to slot slots[g[:k], t] of the buffer's
// group g; a slot outside [0, S) drops its row.  Where two rows name one
// slot, the later one lands.  Leading dimensions prepended to all three
// (jax.vmap's broadcast_all) keep the meaning.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

int64_t product(ffi::Span<const int64_t> dims, size_t from, size_t to) {
  int64_t n = 1;
  for (size_t i = from; i < to; ++i) n *= dims[i];
  return n;
}

ffi::Error WriteRows(ffi::AnyBuffer buffer, ffi::Buffer<ffi::S32> slots, ffi::AnyBuffer rows,
                     ffi::Result<ffi::AnyBuffer> out, int64_t tail_rank) {
  const auto dims = buffer.dimensions();
  const auto row_dims = rows.dimensions();
  const auto slot_dims = slots.dimensions();
  const size_t rank = dims.size();
  if (tail_rank < 0 || static_cast<size_t>(tail_rank) >= rank || row_dims.size() != rank ||
      rows.element_type() != buffer.element_type()) {
    return ffi::Error::InvalidArgument("write rows: rows must match the buffer's rank and type around the slot axis");
  }
  const size_t axis = rank - 1 - static_cast<size_t>(tail_rank);
  if (slot_dims.size() == 0 || slot_dims.size() - 1 > axis) {
    return ffi::Error::InvalidArgument("write rows: slots must be [*lead[:k], T] with k at most the leading rank");
  }
  const size_t k = slot_dims.size() - 1;
  for (size_t i = 0; i < rank; ++i) {
    if (i != axis && row_dims[i] != dims[i]) {
      return ffi::Error::InvalidArgument("write rows: rows differ from the buffer off the slot axis");
    }
  }
  for (size_t i = 0; i < k; ++i) {
    if (slot_dims[i] != dims[i]) return ffi::Error::InvalidArgument("write rows: slots' leading dims differ");
  }
  const int64_t T = row_dims[axis];
  if (slot_dims[k] != T) return ffi::Error::InvalidArgument("write rows: one slot per row along the slot axis");
  const int64_t S = dims[axis];
  const int64_t groups = product(dims, 0, axis);
  const int64_t repeats = product(dims, k, axis);  // groups that share one row of slots
  const int64_t elements = buffer.element_count();
  const int64_t row_bytes = elements == 0 ? 0 : static_cast<int64_t>(buffer.size_bytes()) / elements *
                                                    product(dims, axis + 1, rank);
  char* target = static_cast<char*>(out->untyped_data());
  if (target != buffer.untyped_data()) std::memcpy(target, buffer.untyped_data(), buffer.size_bytes());  // not aliased
  const char* source = static_cast<const char*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* row_slots = slot + (g / repeats) * T;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = row_slots[t];
      if (s < 0 || s >= S) continue;
      std::memcpy(target + (g * S + s) * row_bytes, source + (g * T + t) * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssWriteRows, WriteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // buffer [*lead, S, *tail], aliased to the result
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [*lead[:k], T]
                                  .Arg<ffi::AnyBuffer>()         // rows [*lead, T, *tail]
                                  .Ret<ffi::AnyBuffer>()         // the buffer with the rows written
                                  .Attr<int64_t>("tail_rank"));
