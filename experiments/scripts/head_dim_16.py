"""Rerun the cases behind `linearize.ops.gla_window.triton.miscompiled_on_gpu`: the Lizard forward at a head dim of 16.

    python experiments/scripts/head_dim_16.py          # on a GPU (or under TRITON_INTERPRET=1)

Each case runs in its own process (an illegal address poisons the CUDA context), through the kernel
itself: a `Config` override makes `testing.compare_forward` call `lizard_attention_triton` directly,
past `supports`, which sends these shapes to the PyTorch op. Prints the relative error of y
against float64 and whether it is within the bf16 tolerance, or the error the process died of.
docs/kernels.md ("Known limitations") has the H200's answers.
"""

import subprocess
import sys

CASES = ["F=32, D=16", "F=32, D=16, split=False", "F=32, D=32", "F=64, D=16", "F=16, D=16",
         "F=32, D=16, dtype=torch.float32", "F=32, D=16, tma=False, chunks_first=False", "F=32, D=16, window=64"]

CASE = """
import sys, torch
from linearize.ops.gla_window.testing import Case, compare_forward, within_tolerance
spec = eval(f"dict(dict(L=300, window=8, sinks=2, dtype=torch.bfloat16, split=True), {sys.argv[1]})")
case = Case(**spec)
out = compare_forward(case, "cuda" if torch.cuda.is_available() else "cpu")
print(sys.argv[1], within_tolerance(case, out["errors"]), out["errors"]["y"])
"""


def main() -> None:
    for spec in CASES:
        proc = subprocess.run([sys.executable, "-c", CASE, spec], capture_output=True, text=True, check=False)
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        print(proc.stdout.strip() if proc.returncode == 0 else f"{spec}: {errors[-1][:200] if errors else proc.returncode}",
              flush=True)


if __name__ == "__main__":
    main()
