"""A jitted function's Pallas kernels, compiled for NVIDIA GPUs by Triton's own compiler: no GPU needed.

Lowered for ``cuda``, each Pallas call becomes one custom call holding its Triton IR (MLIR bytecode) and launch
settings, which XLA compiles on the GPU (jaxlib 0.10; later jaxlibs compile it while lowering, through their CUDA
plugin).  :func:`triton_modules` reads those modules back as text; :func:`compile_for` hands one to the
``triton`` package with a GPU target, as XLA's compile would, and asks Triton's ``ptxas`` for the registers and
spills of the machine code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import jax
import pytest

XLA_TRITON_CALL = "__gpu$xla.gpu.triton"  # the module's Triton IR, compiled by XLA (jaxlib 0.10)
COMPILED_TRITON_CALL = "triton_kernel_call"  # the module compiled by jaxlib while lowering (later jaxlibs)

SHARED_MEMORY_PER_BLOCK = {80: 166912, 90: 232448}
"""The most shared memory one program may take: A100 (sm_80), H100 and H200 (sm_90)."""


def triton_call_count(stablehlo: str) -> int:
    """Pallas' Triton calls in a ``cuda`` lowering's text, in either form."""
    return stablehlo.count(f"@{XLA_TRITON_CALL}(") + stablehlo.count(f"@{COMPILED_TRITON_CALL}")


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas call's Triton IR as text, and the launch settings it is compiled with."""

    text: str
    warps: int
    stages: int


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What Triton made of a :class:`TritonModule` for one GPU architecture."""

    ptx: str
    shared_bytes: int
    registers: int
    spilled_bytes: int


def triton_modules(lowered: jax.stages.Lowered) -> list[TritonModule]:
    """The Triton modules of a ``cuda`` lowering whose Pallas calls XLA compiles (skips where jaxlib compiled them
    while lowering: their IR is not in the lowering then)."""
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    target = op.attributes["call_target_name"] if "call_target_name" in op.attributes else None
                    if target is not None and ir.StringAttr(target).value == XLA_TRITON_CALL:
                        calls.append(op.attributes["mhlo.backend_config"])
                    walk(op.operation)

    walk(module.operation)
    if not calls and COMPILED_TRITON_CALL in str(module):
        pytest.skip(f"this jaxlib ({jax.__version__}) compiled the kernel while lowering: no Triton IR to read")
    dialect.register_dialect(module.context)
    modules = []
    for config in calls:
        bytecode = ir.StringAttr(config["ir"]).value_bytes
        text = ir.Module.parse(bytecode, context=module.context).operation.get_asm(enable_debug_info=False)
        modules.append(TritonModule(text, ir.IntegerAttr(config["num_warps"]).value,
                                    ir.IntegerAttr(config["num_stages"]).value))
    return modules


def compile_for(module: TritonModule, arch: int) -> Compiled:
    """``module`` compiled by the ``triton`` package for ``sm_{arch}`` (80: A100, 90: H100 and H200)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ttir")
        with open(source, "w") as file:
            file.write(module.text)
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": module.warps, "num_stages": module.stages})
        ptx = kernel.asm["ptx"]
        ptx_path = os.path.join(folder, "kernel.ptx")
        with open(ptx_path, "w") as file:
            file.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([get_ptxas(arch).path, f"--gpu-name={gpu}", "-v", ptx_path, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert registers and spills, report
    return Compiled(ptx, int(kernel.metadata.shared), int(registers.group(1)),
                    int(spills.group(1)) + int(spills.group(2)))
