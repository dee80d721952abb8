// A copy of an array into the buffer XLA:CPU allocated for it, on huge pages where Linux gives them.
//
// XLA:CPU takes its buffers from malloc.  Where transparent huge pages go only to memory that asks
// (madvise mode, the default of many distributions), a fresh buffer faults in 4 KiB pages as it is
// first written: copying 64 MiB from the host into one took 28 ms, 6 ms where malloc asked for huge
// pages.  numpy asks for its large arrays; XLA does not.  JssOwnedCopy asks for the destination's
// whole 2 MiB pages (MADV_HUGEPAGE, advice only: an error changes nothing) before it copies the
// operand's bytes into it, so an array read from a checkpoint lands in buffers the runtime owns (a
// donated step reuses them) for the price of one copy.

#include <cstdint>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The whole 2 MiB pages inside [data, data + size) may be backed by huge pages once written.
void AskForHugePages(void* data, size_t size) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + size) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)size;
#endif
}

ffi::Error OwnedCopy(ffi::AnyBuffer source, ffi::Result<ffi::AnyBuffer> out) {
  if (source.size_bytes() != out->size_bytes() || source.element_type() != out->element_type()) {
    return ffi::Error::InvalidArgument("owned copy: the result must have the operand's type and size");
  }
  AskForHugePages(out->untyped_data(), out->size_bytes());
  std::memcpy(out->untyped_data(), source.untyped_data(), source.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JssOwnedCopy, OwnedCopy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // the array, anywhere the CPU reads
                                  .Ret<ffi::AnyBuffer>());  // its copy, in a buffer XLA allocated
