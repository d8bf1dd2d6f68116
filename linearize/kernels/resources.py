"""Registers, spilled bytes and shared memory of a Triton kernel compiled for an NVIDIA GPU, on any machine.

Triton compiles to a cubin without a GPU (its wheel ships ptxas and cuobjdump); only loading one needs
the device. Register spills, the usual reason a tile configuration is slow, can so be checked on a CPU:

    python -m linearize.kernels.resources

prints them for STILL's backward key kernel at the shapes the models use.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def resources(kernel, types: dict[str, str], constants: dict, *, num_warps: int = 4, num_stages: int = 3,
              arch: int = 90) -> dict[str, int]:
    """{registers (per thread), spilled (stack bytes per thread), shared (bytes)} of `kernel` compiled for
    sm_`arch`: `types` gives each runtime argument's Triton type ("*bf16", "i32", "fp32"), `constants`
    each constexpr's value."""
    missing = [name for name in kernel.arg_names if name not in types and name not in constants]
    if missing:
        raise ValueError(f"no type or value for {', '.join(missing)}")
    signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"registers": int(registers), "spilled": int(stack), "shared": compiled.metadata.shared}


def still_key_kernel_types(dtype: str) -> dict[str, str]:
    """`still_triton._bwd_dkv_kernel`'s argument types for q, k, v and features in `dtype` ("bf16", "fp32")."""
    tile, f32 = f"*{dtype}", "*fp32"
    return {"Q": tile, "K": tile, "V": tile, "FQ": tile, "FK": tile, "FOLD": "*i32", "VALID": "*i8", "DN": f32,
            "GDN": f32, "DDEN": f32, "DMAX": f32, "M": f32, "ARG": "*i32", "DK": f32, "DV": f32, "DFK": tile,
            "L": "i32", "H": "i32", "HKV": "i32", "scale": "fp32"}


def main() -> None:
    import torch

    from . import still_triton

    print("STILL's backward key kernel (d k, d v, d fk) for sm_90, as launched:")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for d in (64, 128):
            launch = still_triton.key_kernel_launch(dtype, d, d)
            tiles = {"BM": launch["BM"], "BN": launch["BN"]}
            found = resources(still_triton._bwd_dkv_kernel, still_key_kernel_types(name),
                              {"D": d, "F": d, "DT": still_triton.DOT_DTYPES[dtype]} | tiles,
                              num_warps=launch["num_warps"], num_stages=launch["num_stages"])
            print(f"  {name} d={d} {tiles}: {found}")


if __name__ == "__main__":
    main()
