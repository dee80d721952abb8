"""The native kernel's sources compile cleanly on every path, the ones this machine does not run included.

``setup.py`` builds the kernel optionally: where the build fails, the install
goes on and attention stays pure JAX, so a source that stopped compiling
would show as skipped native tests rather than a failure.  Here the sources
are compiled (parsed and every template instantiated, no code generated)
with warnings as errors, jaxlib's FFI headers as system headers: as this
machine's build compiles them, and with ``JSS_PORTABLE``, the generic path
that every non-x86 target (aarch64) builds instead of the x86 ones.
"""

import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import jax.ffi
import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = sorted(CSRC.glob("*.cc"))  # every source the extension builds (setup.py lists them)
ATTENTION_SOURCES = sorted(CSRC.glob("decode_attention*.cc"))  # the kernel's dispatch and one source per path


@pytest.fixture(scope="module")
def cxx() -> list[str]:
    """The C++ compiler a build would use: ``$CXX``, else the first of c++, g++ and clang++ on the PATH."""
    if os.environ.get("CXX"):
        return shlex.split(os.environ["CXX"])
    found = next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)
    if found is None:
        pytest.skip("no C++ compiler on this machine, so the native kernel is not built here either")
    return [found]


def compile_command(cxx: list[str], *options: str) -> list[str]:
    """A C++17 compile of the kernel with jaxlib's FFI headers as system headers, then ``options``."""
    return [*cxx, "-std=c++17", "-isystem", jax.ffi.include_dir(), *options]


@pytest.mark.parametrize("defines", [[], ["-DJSS_PORTABLE"]], ids=["this-machine", "portable"])
def test_kernel_sources_compile_without_warnings(cxx, defines):
    command = compile_command(cxx, "-fsyntax-only", "-fopenmp-simd", "-Wall", "-Wextra", "-Werror", *defines,
                              *map(str, SOURCES))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{shlex.join(command)}\n{done.stderr[-4000:]}"


def preprocess(cxx: list[str], *sources: Path) -> dict[str, str]:
    """``sources`` after the preprocessor, one after another, by build: ``"this-machine"`` and ``"portable"``
    (``-DJSS_PORTABLE``)."""
    return {
        name: "".join(subprocess.run(compile_command(cxx, "-E", "-P", *defines, str(source)), capture_output=True,
                                     text=True, check=True).stdout for source in sources)
        for name, defines in (("this-machine", []), ("portable", ["-DJSS_PORTABLE"]))
    }


def test_portable_build_holds_the_generic_path_alone(cxx):
    """With JSS_PORTABLE the preprocessed kernel has the generic path and none of the x86 ones or intrinsics."""
    assert [source.name for source in ATTENTION_SOURCES] == [
        f"decode_attention{path}.cc" for path in ("", "_avx2", "_avx512", "_baseline", "_generic")]
    preprocessed = preprocess(cxx, *ATTENTION_SOURCES)
    portable = preprocessed["portable"]
    assert "namespace jss::attention::generic {" in portable
    assert not any(marker in portable for marker in ("attention::baseline", "attention::avx2", "attention::avx512",
                                                     "avx2::", "avx512::", "_mm_", "_mm256_"))
    if platform.machine() in ("x86_64", "AMD64"):  # the build for this machine holds the x86 paths instead
        for path in ("baseline", "avx2", "avx512"):
            assert f"namespace jss::attention::{path} {{" in preprocessed["this-machine"]
        assert "attention::generic" not in preprocessed["this-machine"]


def test_portable_crc_has_no_x86_instructions(cxx):
    """Without x86 the CRC goes bit by bit (callers then use zlib); with it, it folds by carry-less multiplication."""
    preprocessed = preprocess(cxx, CSRC / "crc32.cc")
    assert "_mm_clmulepi64_si128" not in preprocessed["portable"] and "BitwiseCrc" in preprocessed["portable"]
    if platform.machine() in ("x86_64", "AMD64"):
        assert "FoldedCrc" in preprocessed["this-machine"]
