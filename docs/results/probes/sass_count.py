"""Count the SASS instructions per element of one AdamW kernel specialization, compiled on the CPU (no GPU needed).

The 8-bit and compact kernels are bound by instruction issue on large tensors (docs/step_benchmark.md), so the
instruction count per element is the number to drive down; this prints it, with the opcode histogram and the
memory instructions (vector widths), from the cubin Triton builds for the target.

    python docs/results/probes/sass_count.py 8bit fp32 --rows 1 --warps 1 [--cc 90] [--sass out.sass]
    python docs/results/probes/sass_count.py 8bit bf16 --variant rev:HEAD~3     # the kernel of an earlier commit

The static count covers the whole kernel, slow paths of the IEEE division and square root included; the main
path is printed separately (everything before the first subroutine).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
sys.path.insert(0, str(ROOT / "docs" / "results" / "probes"))

import kernel_variants  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from aot_check import SIGNATURE  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
INSN = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fmt", choices=["fp32", "compact", "8bit", "4bit"])
    ap.add_argument("param_dtype", choices=list(DTYPES))
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--cc", type=int, default=90, help="compute capability: 90 H100/H200, 80 A100, 75 T4")
    ap.add_argument("--uneven", action="store_true", help="the EVEN=False specialization (element masks)")
    ap.add_argument("--sass", type=Path, help="also write the disassembly here")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap (LaunchPlan maxnreg)")
    ap.add_argument("--nearest", action="store_true", help="16-bit parameters rounded to nearest")
    ap.add_argument("--grad-scale", action="store_true", help="gradients scaled first (gradient release's clip)")
    ap.add_argument(
        "--variant",
        default="shipped",
        help=f"a probe variant ({', '.join(kernel_variants.VARIANTS)}) or rev:<git revision> (the kernel of a commit)",
    )
    a = ap.parse_args()
    spec = dict(
        FMT=a.fmt,
        P_DTYPE=DTYPES[a.param_dtype],
        G_DTYPE=DTYPES[a.param_dtype],
        MAXIMIZE=False,
        STOCHASTIC_PARAM=a.param_dtype != "fp32" and not a.nearest,
        PER_TENSOR_STEP=False,
        ALIGNED=True,
        EVEN=not a.uneven,
        ROWS=a.rows,
        GRAD_SCALE=a.grad_scale,
    )
    if not a.variant.startswith("rev:") and a.variant not in kernel_variants.VARIANTS:
        ap.error(f"unknown variant {a.variant!r}")
    fn = kernel_variants.load(a.variant)
    spec = {k: v for k, v in spec.items() if k in fn.arg_names}  # an older revision's kernel lacks newer flags
    # the runtime arguments by name (another revision's kernel may name one differently: int32 then)
    runtime = {k: SIGNATURE.get(k, "i32") for k in fn.arg_names if k not in spec}
    src = triton.compiler.ASTSource(fn=fn, signature={**runtime, **{k: "constexpr" for k in spec}}, constexprs=spec)
    k = triton.compile(
        src, target=GPUTarget("cuda", a.cc, 32), options={"num_warps": a.warps, "enable_fp_fusion": False, **({"maxnreg": a.maxnreg} if a.maxnreg else {})}
    )
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(tool), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    if a.sass:
        a.sass.write_text(sass)
    ins = [m.group(1) for line in sass.splitlines() if (m := INSN.match(line))]
    first_ret = next((i for i, s in enumerate(ins) if s.split()[0].startswith("RET")), len(ins))
    main_path = ins[:first_ret]
    per_thread = a.rows * 256 / (a.warps * 32)

    def op(s: str) -> str:
        s = re.sub(r"^@!?U?P\w+\s+", "", s)
        return s.split()[0].split(".")[0]

    print(
        f"sm_{a.cc} {a.fmt} {a.param_dtype} tile {a.rows}x256, {a.warps} warp(s), {per_thread:g} elements/thread: "
        f"{len(ins)} SASS ({len(ins) / per_thread:.1f}/element), main path {len(main_path)} "
        f"({len(main_path) / per_thread:.1f}/element)"
    )
    print("resources:", " ".join(re.findall(r"REG:\d+|STACK:\d+", usage)))
    print(" ".join(f"{o}:{c}" for o, c in collections.Counter(map(op, main_path)).most_common(30)))
    print("memory:", dict(collections.Counter(re.findall(r"\b[LS]TG[.A-Z0-9]*", sass))))


if __name__ == "__main__":
    main()
