"""Registers, spilled bytes and shared memory of a Triton kernel compiled for an NVIDIA GPU, on any machine.

Triton compiles to a cubin without a GPU (its wheel ships ptxas and cuobjdump); only loading one needs
the device. Register spills, the usual reason a tile configuration is slow, can so be checked on a CPU:

    python -m experiments.kernel_resources

prints them for STILL's backward key kernel at the shapes the models use, for its forward kernel's
tilings at the Llama-3-8B shape, and for Lizard's forward
at the Table 3 shapes (docs/kernels.md compares them with the H200's own report), for its window
d k / d v pass at the key-row blocks and warps the sweeps weighed, for its forward state pass beside
fla's (`chunk_fwd_kernel_h`, where fla is installed), for its fused backward chunk kernel at 4
and 8 warps, and for its features kernel and that kernel's backward at the Llama-3-8B shape.
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


def resources(kernel, types: dict[str, str], constants: dict, *, divisible=(), aligned: bool = True,
              num_warps: int = 4, num_stages: int = 3, max_registers: int | None = None,
              arch: int = 90) -> dict[str, int]:
    """{registers (per thread), spilled (stack bytes per thread), shared (bytes)} of `kernel` compiled for
    sm_`arch`: `types` gives each runtime argument's Triton type ("*bf16", "i32", "fp32"), `constants`
    each constexpr's value, `divisible` the integer arguments that are multiples of 16 at run time,
    `max_registers` ptxas's cap (maxnreg; what it cannot fit spills).

    As at launch, pointers are taken as 16-byte aligned (torch's allocations are) and `divisible`
    as multiples of 16: Triton specializes on both, and without them (`aligned=False`) the code needs
    more registers (the Lizard forward spills 1,136 bytes instead of the 72 its H200 run reported)."""
    missing = [name for name in kernel.arg_names if name not in types and name not in constants]
    if missing:
        raise ValueError(f"no type or value for {', '.join(missing)}")
    signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
    hinted = [name for name, kind in signature.items() if aligned and (kind.startswith("*") or name in divisible)]
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()},
                       attrs={(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in hinted})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": max_registers})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"registers": int(registers), "spilled": int(stack), "shared": compiled.metadata.shared}


def _still_backward_types(dtype: str) -> dict[str, str]:
    """The argument types STILL's two backward kernels share, q, k, v and features in `dtype`."""
    tile, f32 = f"*{dtype}", "*fp32"
    return {"Q": tile, "K": tile, "V": tile, "FQ": tile, "FK": tile, "FOLD": "*i32", "VALID": "*i8", "DN": f32,
            "GDN": f32, "DDEN": f32, "DMAX": f32, "M": f32, "ARG": "*i32", "L": "i32", "H": "i32", "HKV": "i32",
            "scale": "fp32"}


def still_key_kernel_types(dtype: str) -> dict[str, str]:
    """`still_triton._bwd_dkv_kernel`'s argument types for q, k, v and features in `dtype` ("bf16", "fp32")."""
    return _still_backward_types(dtype) | {"DK": "*fp32", "DV": "*fp32", "DFK": f"*{dtype}"}


def still_query_kernel_types(dtype: str) -> dict[str, str]:
    """`still_triton._bwd_dq_kernel`'s argument types for q, k, v and features in `dtype` ("bf16", "fp32")."""
    return _still_backward_types(dtype) | {"DQ": "*fp32", "DFQ": f"*{dtype}"}


def still_forward_types() -> dict[str, str]:
    """`still_triton._fwd_kernel`'s argument types for bf16 q, k, v and features, float32 parts."""
    f32 = "*fp32"
    return {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "FQ": "*bf16", "FK": "*bf16", "G": f32, "FOLD": "*i32",
            "VALID": "*i8", "Y": "*bf16", "YS": f32, "YL": f32, "M": f32, "LS": f32, "DEN": f32, "ARG": "*i32",
            "L": "i32", "H": "i32", "HKV": "i32", "scale": "fp32", "eps": "fp32"}


def still_forward(launch: dict, gate: bool, save: bool, features: int) -> dict[str, int]:
    """`still_triton._fwd_kernel` in bf16 at d = 128 (the Llama-3-8B shape, whose feature maps have 128
    features) under `launch` (`forward_launch`'s form: tiles, warps, stages), gated or not, saving the
    backward's parts or not."""
    import torch

    from linearize.ops.still import triton as still_triton

    constants = {"D": 128, "F": features, "DT": still_triton.DOT_DTYPES[torch.bfloat16], "BM": launch["BM"],
                 "BN": launch["BN"], "GATE": gate, "SAVE": save}
    return resources(still_triton._fwd_kernel, still_forward_types(), constants, divisible=("L",),
                     num_warps=launch["num_warps"], num_stages=launch["num_stages"])


def still_kernels(d: int, features: int, dtype) -> dict[str, dict[str, int]]:
    """STILL's three kernels as the dispatch launches them for head dim `d`, `features` per feature map and
    `dtype` operands (no GPU: `forward_launch`'s square tiles): the gated training forward that saves
    the backward's parts, the d q pass and the d k / d v pass."""
    import torch

    from linearize.ops.still import triton as still_triton

    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    shapes = {"D": d, "F": features, "DT": still_triton.DOT_DTYPES[dtype]}
    forward = still_triton.forward_launch(dtype, d, features, gate=True, save=True)
    block = still_triton.block_size(dtype, d, features)
    keys = still_triton.key_kernel_launch(dtype, d, features)
    forward_types = {**still_forward_types(), **{t: f"*{name}" for t in ("Q", "K", "V", "FQ", "FK", "Y")}}
    return {
        "forward": resources(still_triton._fwd_kernel, forward_types,
                             shapes | {"BM": forward["BM"], "BN": forward["BN"], "GATE": True, "SAVE": True},
                             divisible=("L",), num_warps=forward["num_warps"], num_stages=forward["num_stages"]),
        "d q": resources(still_triton._bwd_dq_kernel, still_query_kernel_types(name),
                         shapes | {"BM": block, "BN": block}, divisible=("L",)),
        "d k, d v": resources(still_triton._bwd_dkv_kernel, still_key_kernel_types(name),
                              shapes | {"BM": keys["BM"], "BN": keys["BN"]}, divisible=("L",),
                              num_warps=keys["num_warps"], num_stages=keys["num_stages"]),
    }


def lizard_forward_types() -> dict[str, str]:
    """`lizard_triton._fwd_kernel`'s argument types for bf16 operands (a scalar gate's float32 log g)."""
    tile, f32 = "*bf16", "*fp32"
    return {"FQ": tile, "FK": tile, "LG": f32, "QW": tile, "KW": tile, "V": tile, "SINKS": f32, "ALPHA": f32,
            "HS": tile, "HZ": f32, "Y": tile, "Y_GLA": tile, "Y_WIN": tile, "DEN": f32, "LSE": f32, "ROW_MAX": f32,
            "ARG": "*i32", "L": "i32", "H": "i32", "HKV": "i32", "NT": "i32", "window": "i32", "scale": "fp32",
            "eps": "fp32", "HEAD": "i32"}


def lizard_forward(constants: dict, warps: int, stages: int, aligned: bool = True,
                   max_registers: int | None = None) -> dict[str, int]:
    """`lizard_triton._fwd_kernel` with `constants` (F = D = 128, chunk 64 where its tiles come through
    tensor descriptors: constants["TMA"])."""
    from linearize.ops.gla_window import triton as lizard_triton

    types = lizard_forward_types()
    if constants["TMA"]:
        tile = "tensordesc<bf16[1,64,128]>"
        types |= {"FQ": tile, "FK": tile, "QW": tile, "KW": tile, "V": tile, "HS": "tensordesc<bf16[1,128,128]>"}
    return resources(lizard_triton._fwd_kernel, types, constants, aligned=aligned,
                     divisible=("L", "H", "HKV", "NT", "window"), num_warps=warps, num_stages=stages,
                     max_registers=max_registers)


def lizard_forward_constants(cfg, window: int) -> dict:
    """`lizard_triton._fwd_kernel`'s constexprs for `cfg` at Table 3's F = D = 128 (inference, the alpha
    mix, 4 sinks)."""
    import torch

    from linearize.ops.gla_window import triton as lizard_triton

    return {"F": 128, "D": 128, "BV": cfg.block_v, "BT": cfg.chunk, "NWB": -(-(window - 1) // cfg.chunk), "M": 4,
            "MP": 4, "VEC": False, "SAVE": False, "SPLIT": cfg.split, "NORM": True, "SHARED": False,
            "CF": cfg.chunk_axis_first, "TMA": cfg.tma, "DT": lizard_triton.DOT_DTYPES[torch.bfloat16],
            "KEEP_HEAD": False}


def programs_per_sm(found: dict, warps: int) -> int:
    """Programs of one kernel an H200 SM holds at once: 64K registers, 228 KB of shared memory, 1 KB
    of it reserved per program, at most 32 programs."""
    by_registers = 64 * 1024 // (found["registers"] * 32 * warps)
    return min(by_registers, 228 * 1024 // (found["shared"] + 1024), 32)


def lizard_window_dkv_types() -> dict[str, str]:
    """`lizard_triton._bwd_window_dkv_kernel`'s argument types for bf16 operands."""
    tile, f32 = "*bf16", "*fp32"
    return {"QW": tile, "KW": tile, "V": tile, "ALPHA": f32, "LSE": f32, "DY": tile, "dy_b": "i64", "dy_h": "i64",
            "DELTA": f32, "ARG": "*i32", "DM": f32, "DKW": tile, "DV_WIN": f32, "L": "i32", "H": "i32", "HKV": "i32",
            "window": "i32", "scale": "fp32"}


def lizard_window_dkv(rows: int, warps: int, stages: int, window: int = 128) -> dict[str, int]:
    """The window's d k / d v pass at Table 3's D = 128 (dy in the model's [B, L, H, D] layout, H = 32)
    with `rows` keys a program."""
    import torch

    from linearize.ops.gla_window import triton as lizard_triton

    constants = {"D": 128, "BW": rows, "NWB": -(-(window - 1) // rows), "DY_ROW": 32 * 128, "SHARED": False,
                 "CF": True, "DT": lizard_triton.DOT_DTYPES[torch.bfloat16]}
    return resources(lizard_triton._bwd_window_dkv_kernel, lizard_window_dkv_types(), constants,
                     divisible=("L", "H", "HKV", "window"), num_warps=warps, num_stages=stages)


def lizard_chunk_backward_types() -> dict[str, str]:
    """`lizard_triton._bwd_chunk_kernel`'s argument types for bf16 operands (a scalar gate's float32 log g)."""
    tile, f32 = "*bf16", "*fp32"
    return {"FQ": tile, "FK": tile, "LG": f32, "V": tile, "DEN": f32, "DY": tile, "dy_b": "i64", "dy_h": "i64",
            "DDEN": f32, "HS": tile, "HZ": f32, "HDS": tile, "HDZ": f32, "DV_WIN": f32, "DFQ": tile, "DFK": tile,
            "DV": tile, "DA": f32, "L": "i32", "H": "i32", "HKV": "i32", "NT": "i32"}


def lizard_chunk_backward(warps: int, stages: int, chunk: int = 64, grad_v: bool = True) -> dict[str, int]:
    """The fused backward's chunk kernel (d fq, d fk, d v) at Table 3's F = D = 128 (dy in the model's
    [B, L, H, D] layout, H = 32)."""
    import torch

    from linearize.ops.gla_window import triton as lizard_triton

    constants = {"F": 128, "D": 128, "BT": chunk, "DY_ROW": 32 * 128, "GRAD_V": grad_v, "CF": True,
                 "DT": lizard_triton.DOT_DTYPES[torch.bfloat16]}
    return resources(lizard_triton._bwd_chunk_kernel, lizard_chunk_backward_types(), constants,
                     divisible=("L", "H", "HKV", "NT"), num_warps=warps, num_stages=stages)


def lizard_state_pass(rows: int, columns: int, warps: int, stages: int) -> dict[str, int]:
    """The forward state pass (`lizard_triton._fwd_states_kernel`) at Table 3's F = D = 128, bf16, a
    scalar gate, 64-token chunks, `rows` x `columns` state blocks a program."""
    import torch

    from linearize.ops.gla_window import triton as lizard_triton

    tile, f32 = "*bf16", "*fp32"
    types = {"FK": tile, "LG": tile, "V": tile, "HS": tile, "HZ": f32, "S0": f32, "Z0": f32, "S_END": f32,
             "Z_END": f32, "L": "i32", "H": "i32", "HKV": "i32", "NT": "i32"}
    constants = {"F": 128, "D": 128, "BK": rows, "BV": columns, "BT": 64, "VEC": False, "CARRY": False,
                 "DT": lizard_triton.DOT_DTYPES[torch.bfloat16]}
    return resources(lizard_triton._fwd_states_kernel, types, constants, divisible=("L", "H", "HKV", "NT"),
                     num_warps=warps, num_stages=stages)


def fla_state_pass(rows: int, columns: int, warps: int, stages: int) -> dict[str, int] | None:
    """fla's `chunk_fwd_kernel_h` (what `chunk_simple_gla`'s forward runs for its states) at the same
    shapes, its gate in float32 as fla keeps it; None where fla is not installed."""
    try:
        from fla.ops.common.chunk_h import chunk_fwd_kernel_h
    except ImportError:
        return None
    kernel = chunk_fwd_kernel_h
    while not isinstance(kernel, triton.runtime.JITFunction):  # under fla's heuristics and autotuner
        kernel = kernel.fn
    types = {"k": "*bf16", "v": "*bf16", "h": "*bf16", "g": "*fp32", "g_gamma": "*fp32", "gk": "*fp32",
             "gv": "*fp32", "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i32", "split_offsets": "*i32", "T": "i32"}
    constants = {"H": 32, "K": 128, "V": 128, "BT": 64, "BS": 64, "BK": rows, "BV": columns, "USE_G": True,
                 "USE_G_GAMMA": False, "USE_GK": False, "USE_GV": False, "USE_INITIAL_STATE": False,
                 "STORE_FINAL_STATE": False, "IS_VARLEN": False, "STATE_V_FIRST": False}
    return resources(kernel, types, constants, divisible=("T",), num_warps=warps, num_stages=stages)


def features_kernel(weights: str, walk: bool, native: bool | None = None) -> dict[str, int]:
    """The features kernel (`features_triton._features_kernel`) for a prefill at the Llama-3-8B shape
    (32 query heads, 8 KV heads, d = 128, f = 64, RoPE), bf16 q and k, weights "bf16" or "fp32", a
    program a block of 64 tokens or walking several (`walk`); the product in one pass on bf16 operands
    (`native`, what bf16 weights take) or through 3xTF32 (what float32 weights take)."""
    from linearize.ops.features import triton as features_triton

    types = {name: "*bf16" for name in ("q", "k", "fq", "fk", "qw", "kw")} | {
        "w_q": f"*{weights}", "w_k": f"*{weights}", "cos": "*fp32", "sin": "*fp32", "L": "i32"}
    strides = ("sq_b", "sq_h", "sq_l", "sk_b", "sk_h", "sk_l", "sc_b", "sc_l")
    types |= {name: "i32" for name in strides}
    constants = {"H": 32, "N_REP": 4, "D": 128, "F": 64, "BL": features_triton.TOKENS_PER_PROGRAM, "ROPE": True,
                 "DOT": True, "NATIVE": weights == "bf16" if native is None else native, "WALK": walk}
    return resources(features_triton._features_kernel, types, constants, divisible=("L", *strides), num_warps=4)


def features_backward(grad_x: bool, columns: int) -> dict[str, int]:
    """The features kernel's backward (`features_triton._features_bwd_kernel`) at the Llama-3-8B shape
    (as `features_kernel`), float32 weights as they train, the weights' gradients alone (stage 1: q and k
    frozen) or with the inputs' (`grad_x`, stage 2), taking x and W `columns` columns at a time."""
    from linearize.ops.features import triton as features_triton

    types = {name: "*bf16" for name in ("q", "k", "dfq", "dfk", "dqw", "dkw")} | {
        name: "*fp32" for name in ("w_q", "w_k", "cos", "sin", "dq", "dk", "dw_q", "dw_k")} | {"L": "i32", "NB": "i32"}
    strides = ("sq_b", "sq_h", "sq_l", "sk_b", "sk_h", "sk_l", "sc_b", "sc_l")
    types |= {name: "i32" for name in strides}
    constants = {"H": 32, "N_REP": 4, "D": 128, "F": 64, "BL": features_triton.BWD_TOKENS_PER_PROGRAM, "BD": columns,
                 "ROPE": True, "GRAD_X": grad_x, "GRAD_W": True}
    return resources(features_triton._features_bwd_kernel, types, constants, divisible=("L", *strides),
                     num_warps=features_triton.BWD_WARPS)


def main() -> None:
    import torch

    from linearize.ops.still import triton as still_triton

    print("STILL's backward key kernel (d k, d v, d fk) for sm_90, as launched, the length a multiple of 16:")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for d in (64, 128):
            launch = still_triton.key_kernel_launch(dtype, d, d)
            tiles = {"BM": launch["BM"], "BN": launch["BN"]}
            found = resources(still_triton._bwd_dkv_kernel, still_key_kernel_types(name),
                              {"D": d, "F": d, "DT": still_triton.DOT_DTYPES[dtype]} | tiles, divisible=("L",),
                              num_warps=launch["num_warps"], num_stages=launch["num_stages"])
            print(f"  {name} d={d} {tiles}: {found}")

    print("STILL's forward kernel, bf16, d = 128, 64 and 128 features (the Llama-3-8B shape: 128), the wide tiles "
          "against square ones: a gated fresh prefill, a continued call (its parts saved, no gate) and a gated "
          "training pass:")
    square = {"BM": 32, "BN": 32, "num_warps": 4, "num_stages": 3}
    for features in (64, 128):
        for label, launch in (("wide (forward_launch on a GPU with the shared memory)", still_triton.WIDE_FORWARD),
                              ("square (block_size)", square)):
            for gate, save in ((True, False), (False, True), (True, True)):
                found = still_forward(launch, gate, save, features)
                print(f"  {features} features, {label}, gate={gate} save={save}: {found}")

    print("STILL's kernels at Gemma's head dim, d = 256 with 256 features (16 x 16 tiles), as launched: "
          "the dispatch takes them in 16 bits only")
    for dtype in (torch.bfloat16, torch.float32):
        for kernel, found in still_kernels(256, 256, dtype).items():
            print(f"  {dtype}, {kernel}: {found}")

    from linearize.ops.gla_window import triton as lizard_triton

    cfg = lizard_triton.Config.default(torch.bfloat16)
    window = 128
    print(f"Lizard's forward (inference), bf16, F = d = 128, w = {window}, 4 sinks, {cfg}:")
    constants = lizard_forward_constants(cfg, window)
    cap = cfg.forward_registers
    variants = {"as launched at Table 3 shapes": (constants, True, cap),
                "saving the backward's parts (training)": (constants | {"SAVE": True}, True, cap),
                "keeping the first rows' parts (a continued prefill)": (constants | {"KEEP_HEAD": True}, True, cap),
                "without the register cap": (constants, True, None),
                "without alignment hints": (constants, False, cap),
                "the heads first in the launch order": (constants | {"CF": False}, True, cap),
                "pointer loads instead of tensor descriptors (launched without the cap)": (constants | {"TMA": False},
                                                                                          True, None)}
    for label, (values, aligned, registers) in variants.items():
        found = lizard_forward(values, cfg.warps, cfg.forward_stages, aligned, registers)
        print(f"  {label}: {found}, {programs_per_sm(found, cfg.warps)} programs an SM")
    print(f"Lizard's window d k / d v pass, bf16, D = 128, w = {window}, by key rows a program and warps:")
    for rows, warps in ((cfg.window_dkv_block, cfg.warps), (64, 4), (64, 8)):
        print(f"  {rows} rows, {warps} warps: {lizard_window_dkv(rows, warps, cfg.stages, window)}")
    print("Lizard's forward state pass, bf16, F = d = 128, 64-token chunks, by block, warps and stages, and fla's "
          "chunk_fwd_kernel_h beside it (where fla is installed):")
    for rows, columns, warps, stages in ((cfg.state_block_k, cfg.state_block_v, cfg.state_warps, cfg.state_stages),
                                         (64, 64, 2, 2), (64, 64, 4, 3), (128, 32, 4, 3)):
        ours = lizard_state_pass(rows, columns, warps, stages)
        fla = fla_state_pass(rows, columns, warps, stages)
        print(f"  {rows} x {columns}, {warps} warps, {stages} stages: {ours}, {programs_per_sm(ours, warps)} programs "
              f"an SM" + ("" if fla is None else f"; fla: {fla}, {programs_per_sm(fla, warps)} programs an SM"))
    print(f"Lizard's fused backward chunk kernel (d fq, d fk, d v), bf16, F = d = 128, {cfg.chunk}-token chunks:")
    for warps in (4, 8):
        for grad_v in (True, False):
            found = lizard_chunk_backward(warps, cfg.stages, cfg.chunk, grad_v)
            print(f"  {warps} warps, {'with' if grad_v else 'without'} d v: {found}")
    from linearize.ops.features import triton as features_triton

    print("Lizard's features kernel, a prefill at the Llama-3-8B shape (d = 128, f = 64, RoPE), bf16 q and k, 4 warps:")
    variants = {"bf16 weights, one pass (as launched)": ("bf16", False, True),
                "bf16 weights through 3xTF32": ("bf16", False, False),
                "bf16 weights, one pass, walking blocks": ("bf16", True, True),
                "float32 weights, 3xTF32 (as launched)": ("fp32", False, False),
                "float32 weights, 3xTF32, walking blocks": ("fp32", True, False)}
    for label, (weights, walk, native) in variants.items():
        found = features_kernel(weights, walk, native)
        print(f"  {label}: {found}, {programs_per_sm(found, 4)} programs an SM")
    warps = features_triton.BWD_WARPS
    print(f"Its backward at that shape, float32 weights, {warps} warps, by the columns of x and W held at once:")
    for grad_x, stage in ((False, "stage 1, the weights' gradients"), (True, "stage 2, the inputs' too")):
        for columns in (features_triton.BWD_COLUMNS, 128):
            found = features_backward(grad_x, columns)
            print(f"  {stage}, {columns} columns: {found}, {programs_per_sm(found, warps)} programs an SM")


if __name__ == "__main__":
    main()
