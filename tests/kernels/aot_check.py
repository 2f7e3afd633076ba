"""Compile every specialization of the AdamW kernel for a GPU target on the CPU and check the PTX.

Run as a script (without TRITON_INTERPRET): ``python tests/kernels/aot_check.py 75``. Prints one line per
specialization and exits non-zero if any PTX holds a hardware bf16 conversion (``cvt.rn.bf16``, absent before
sm_80), FMA contraction, an approximate division, or an approximate square root outside the 8-bit code search.
"""

import itertools
import re
import sys
import time

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from apexw_hf.kernels.adamw import _adamw_kernel

SIGNATURE = {
    "cstart_ptr": "*i32",
    "gfirst_ptr": "*i32",
    "addr_ptr": "*i64",
    "numel_ptr": "*i64",
    "tkey_ptr": "*i32",
    "tstep_ptr": "*i32",
    "num_work": "i32",
    "num_tensors": "i32",
    "step": "i32",
    **{
        k: "fp32"
        for k in ("step_size", "inv_bc2_sqrt", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "decay", "eps")
    },
}
DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
# Flush-to-zero is harmless only in floor (cvt.rmi), whose inputs here are >= 0: floor of a subnormal is +0 anyway,
# and in the 8-bit format's approximate roots, which only guess a code that one exact comparison then settles (a
# subnormal y guesses code 0, which is its code). The update itself must use the IEEE sqrt.rn and div.rn.
BAD = [r"cvt\.rn\.bf16", r"\bfma\.", r"div\.approx", r"div\.full", r"^(?!\s*(cvt\.rmi|sqrt\.approx)\.).*\.ftz\."]
BAD_OUTSIDE_8BIT = [r"sqrt\.approx"]
REQUIRED = [r"sqrt\.rn\.f32", r"div\.rn\.f32"]


def specializations():
    for fmt, p, g in itertools.product(("fp32", "compact", "8bit"), DTYPES, DTYPES):
        yield dict(
            FMT=fmt,
            P_DTYPE=DTYPES[p],
            G_DTYPE=DTYPES[g],
            MAXIMIZE=False,
            STOCHASTIC_PARAM=p != "fp32",
            PER_TENSOR_STEP=False,
            ALIGNED=True,
            EVEN=True,
            ROWS=8,
        )
    for fmt in ("fp32", "compact", "8bit"):
        yield dict(
            FMT=fmt,
            P_DTYPE=tl.bfloat16,
            G_DTYPE=tl.bfloat16,
            MAXIMIZE=True,
            STOCHASTIC_PARAM=False,
            PER_TENSOR_STEP=True,
            ALIGNED=False,
            EVEN=False,
            ROWS=8,
        )
        yield dict(
            FMT=fmt,
            P_DTYPE=tl.float16,
            G_DTYPE=tl.float32,
            MAXIMIZE=False,
            STOCHASTIC_PARAM=False,
            PER_TENSOR_STEP=False,
            ALIGNED=True,
            EVEN=False,
            ROWS=8,
        )


def main(cc: int) -> int:
    failures = 0
    for spec in specializations():
        t0 = time.time()
        src = triton.compiler.ASTSource(
            fn=_adamw_kernel, signature={**SIGNATURE, **{k: "constexpr" for k in spec}}, constexprs=spec
        )
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 8, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        bad = [b for b in BAD + (BAD_OUTSIDE_8BIT if spec["FMT"] != "8bit" else []) if re.search(b, ptx, re.M)]
        bad += [f"missing {r}" for r in REQUIRED if not re.search(r, ptx)]
        failures += bool(bad)
        name = (
            f"{spec['FMT']} p={spec['P_DTYPE']} g={spec['G_DTYPE']} max={spec['MAXIMIZE']} "
            f"sr={spec['STOCHASTIC_PARAM']} per_tensor={spec['PER_TENSOR_STEP']}"
        )
        print(f"sm_{cc} {name}: {'FAIL ' + str(bad) if bad else 'ok'} ({time.time() - t0:.1f} s)", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 75) else 0)
