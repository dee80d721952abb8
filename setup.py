"""Builds the optional native CPU library (attention, row writes, CRC-32, owned copies); the metadata is in setup.cfg.

The kernel (``csrc/decode_attention.cc``) includes the XLA FFI headers that
jaxlib ships (``jax.ffi.include_dir()``).  The build is optional: without a
C++17 compiler (or where it fails) the install goes on and attention runs in
pure JAX.

The attention kernel's instruction-set paths are sources of their own
(``csrc/decode_attention_<path>.cc``), and the sources compile in parallel, one
per core: the paths are most of the build.
"""

import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -O3, as the kernel's speed was measured with (a cheaper -O2 with loop peeling compiled in a third
# of the time but was checked on one path only).  No debug info: the wheel ships code only.
UNIX_FLAGS = ["-std=c++17", "-O3", "-fopenmp-simd", "-Wno-psabi", "-g0"]

# Longest compile first, so that the parallel build ends with the short ones.
SOURCES = [f"csrc/decode_attention_{path}.cc" for path in ("avx512", "avx2", "baseline", "generic")] + [
    "csrc/decode_attention.cc", "csrc/write_rows.cc", "csrc/owned_copy.cc", "csrc/crc32.cc"]
KERNEL_PARTS = ["chunks", "isa", "vectors", "elements", "tiles", "prefetch", "row_reader", "sse2_int8", "softmax"]


def compile_in_parallel(compiler, jobs: int) -> None:
    """Makes ``compiler.compile`` compile its sources in ``jobs`` threads, each source by the compiler's own method.

    The sources start in ``SOURCES``' order, longest first (setuptools hands them over sorted by name, which
    would start the SSE2 path last and leave one core idle at the end); the objects keep the order given.
    """
    compile_serially = compiler.compile

    def compile_sources(sources, *args, **kwargs):
        rank = {source: i for i, source in enumerate(SOURCES)}
        start_order = sorted(sources, key=lambda source: rank.get(source, len(rank)))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            objects = dict(zip(start_order, pool.map(lambda source: compile_serially([source], *args, **kwargs),
                                                     start_order)))
            return [path for source in sources for path in objects[source]]

    compiler.compile = compile_sources


class BuildWithFfiHeaders(build_ext):
    """Adds jaxlib's FFI headers and the compiler's flags and compiles in parallel, or skips the optional kernel."""

    def build_extensions(self) -> None:
        try:
            import jax.ffi
        except ImportError as error:
            print(f"warning: not building the native attention kernel ({error}); attention stays pure JAX")
            self.extensions = []
            return
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        print(f"building the native CPU library (decode attention once per instruction set, row writes, CRC-32, "
              f"owned copies): {len(SOURCES)} C++ sources, {jobs} at a time")
        for extension in self.extensions:
            extension.include_dirs.append(jax.ffi.include_dir())
            if self.compiler.compiler_type == "unix":
                extension.extra_compile_args += UNIX_FLAGS
        compile_in_parallel(self.compiler, jobs)
        super().build_extensions()


setup(
    ext_modules=[Extension("jax_session_state._core._decode_attention", SOURCES,
                           depends=[f"csrc/decode_attention_{part}.h" for part in KERNEL_PARTS],
                           language="c++", optional=True)],
    cmdclass={"build_ext": BuildWithFfiHeaders},
)
