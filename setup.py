"""Builds the optional native CPU library (attention, row writes, CRC-32, owned copies); the metadata is in setup.cfg.

The kernel (``csrc/decode_attention.cc``) includes the XLA FFI headers that
jaxlib ships (``jax.ffi.include_dir()``).  The build is optional: without a
C++17 compiler (or where it fails) the install goes on and attention runs in
pure JAX.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

UNIX_FLAGS = ["-std=c++17", "-O3", "-fopenmp-simd", "-Wno-psabi", "-g0"]  # no debug info: the wheel ships code only


class BuildWithFfiHeaders(build_ext):
    """Adds jaxlib's FFI headers and the compiler's flags, or skips the optional kernel."""

    def build_extensions(self) -> None:
        try:
            import jax.ffi
        except ImportError as error:
            print(f"warning: not building the native attention kernel ({error}); attention stays pure JAX")
            self.extensions = []
            return
        for extension in self.extensions:
            extension.include_dirs.append(jax.ffi.include_dir())
            if self.compiler.compiler_type == "unix":
                extension.extra_compile_args += UNIX_FLAGS
        super().build_extensions()


setup(
    ext_modules=[Extension("jax_session_state._core._decode_attention",
                           ["csrc/decode_attention.cc", "csrc/write_rows.cc", "csrc/crc32.cc", "csrc/owned_copy.cc"],
                           depends=["csrc/decode_attention_isa.h", "csrc/decode_attention_vectors.h",
                                    "csrc/decode_attention_elements.h", "csrc/decode_attention_tiles.h",
                                    "csrc/decode_attention_prefetch.h", "csrc/decode_attention_row_reader.h",
                                    "csrc/decode_attention_sse2_int8.h", "csrc/decode_attention_softmax.h"],
                           language="c++", optional=True)],
    cmdclass={"build_ext": BuildWithFfiHeaders},
)
