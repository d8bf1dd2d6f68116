"""Fixes for running our kernels in Triton 3.6's interpreter (TRITON_INTERPRET=1) with numpy >= 2.

The interpreter keeps bfloat16 as raw uint16 bit patterns, and
  - turns 1-element arrays into loop bounds with int(array), which numpy >= 2.4 rejects;
  - multiplies those bit patterns as integers in tl.dot;
  - truncates float32 -> bfloat16 (and its round-to-nearest option mishandles a mantissa carry),
    where the GPU rounds to nearest even.
`patch()` makes it compute what the GPU computes; it touches nothing outside the interpreter.
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def patch() -> None:
    if getattr(interpreter, "_linearize_patched", False):
        return
    interpreter._linearize_patched = True

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patched_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched_lang_tensor

    convert_float = interpreter._convert_float

    def patched_convert_float(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _f32_to_bf16_bits(data)
        return convert_float(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = patched_convert_float

    create_dot = interpreter.InterpreterBuilder.create_dot

    def patched_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_bits_to_f32(a.data), tl.float32)
            b = interpreter.TensorHandle(_bf16_bits_to_f32(b.data), tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched_create_dot
