"""Static cost of the AdamW kernel on a GPU target, from the CPU: SASS instructions and registers per specialization.

Compiles the kernel ahead of time (Triton's wheel carries ptxas and cuobjdump) for ``--cc`` (90: H100/H200) at the
launch tile of the format (one 256-element row, one warp: ``launch.LAUNCH_CONFIG``), with fp32 and with bf16
parameters and gradients, and prints the number of SASS instructions of one program (``NOP`` and the trailing
self-branch left out) and its registers per thread. A proxy to compare two commits' kernels before a GPU is at hand
(run it with each checkout first on ``PYTHONPATH``), not a timing: the kernel is bound by memory on large tensors.

    PYTHONPATH=. python scripts/kernel_sass.py [--formats 8bit,4bit] [--cc 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parents[1]


def count(cubin: bytes) -> tuple[int, int]:
    """(SASS instructions but NOPs and the final self-branch, registers per thread) of a cubin."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        sass = subprocess.run([tools / "cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tools / "cuobjdump", "-res-usage", path], capture_output=True, text=True, check=True)
    lines = [x for x in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", x)]
    n = sum("NOP" not in x and "BRA `" not in x for x in lines)
    return n, int(re.search(r"REG:(\d+)", res.stdout).group(1))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="8bit,4bit", help="comma-separated state formats")
    ap.add_argument("--cc", type=int, default=90, help="compute capability of the target (75, 80, 90)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be compiled, not interpreted
    import apexw_hf
    from apexw_hf.engines.triton.kernels.adamw import _adamw_kernel

    sys.path.insert(0, str(ROOT))
    from tests.kernels.aot_check import SIGNATURE, _spec

    rows = []
    for fmt in args.formats.split(","):
        for dtype in ("fp32", "bf16"):
            spec = _spec(fmt, dtype, dtype, ROWS=1)
            sig = {**SIGNATURE, **{k: "constexpr" for k in spec}}
            src = triton.compiler.ASTSource(fn=_adamw_kernel, signature=sig, constexprs=spec)
            k = triton.compile(
                src, target=GPUTarget("cuda", args.cc, 32), options={"num_warps": 1, "enable_fp_fusion": False}
            )
            n, regs = count(k.asm["cubin"])
            rows.append({"format": fmt, "dtype": dtype, "sass": n, "registers": regs})
            print(
                f"sm_{args.cc} {fmt} p=g={dtype} tile 1x256, 1 warp: {n} SASS instructions, {regs} registers "
                f"({Path(apexw_hf.__file__).parent})",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
