"""Compile every specialization of the AdamW kernel (and of gradient release's two norm kernels) for a GPU target on
the CPU and check the PTX.

Run as a script (without TRITON_INTERPRET): ``python tests/kernels/aot_check.py 75``. Prints one line per
specialization and exits non-zero if any PTX holds a hardware bf16 conversion (``cvt.rn.bf16``, absent before
sm_80), FMA contraction (any fused multiply-add but the 4-bit ``v`` warp's three per element, written as ``tl.fma``),
an approximate division, square root or reciprocal, or any flush-to-zero instruction.
"""

import itertools
import re
import sys
import time

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from apexw_hf.engines.triton.kernels.adamw import _adamw_kernel
from apexw_hf.engines.triton.kernels.release_norm import BLOCK, SUMSQ_GROUP, _grad_sumsq_kernel, _release_norm_kernel

SIGNATURE = {
    "cstart_ptr": "*i32",
    "gfirst_ptr": "*i32",
    "addr_ptr": "*i64",
    "state_ptr": "*i64",
    "numel_ptr": "*i64",
    "tkey_ptr": "*i32",
    "tstep_ptr": "*i32",
    "num_work": "i32",
    "num_tensors": "i32",
    "first_program": "i32",
    "mixed_step": "i32",
    **{
        k: "fp32"
        for k in ("step_size", "inv_bc2_sqrt", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "decay", "eps")
    },
    "gscale_ptr": "*fp32",
    "nf_ptr": "*i32",
    "tidx_ptr": "*i32",
    "serial": "i32",
}
DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
FORMATS = ("fp32", "compact", "8bit", "4bit")
# Every instruction of the update and of the 8-bit and 4-bit codes must round as IEEE does on subnormals too: no
# flush-to-zero, no approximate math, no contraction into FMA (the reference has no fused multiply-add; the 4-bit v
# code of format version 3 is integer work), checked by fma_problems.
BAD = [r"cvt\.rn\.bf16", r"\.approx\.", r"div\.full", r"\.ftz\."]
FMA = re.compile(r"\bfma\.[a-z0-9.]+")


def fma_problems(ptx: str) -> list[str]:
    """Any fused multiply-add: a contraction the launch forbids."""
    found = FMA.findall(ptx)
    return [f"{len(found)} fused multiply-adds ({sorted(set(found))}), none expected"] if found else []


REQUIRED = [r"sqrt\.rn\.f32", r"div\.rn\.f32"]
# (rows, warps) of launch.LAUNCH_CONFIG, and a larger tile
TILES = [(1, 1), (4, 4), (8, 8)]


def _spec(fmt, p, g, **kw):
    spec = dict(
        FMT=fmt,
        P_DTYPE=DTYPES[p],
        G_DTYPE=DTYPES[g],
        MAXIMIZE=False,
        STOCHASTIC_PARAM=p != "fp32",
        PER_TENSOR_STEP=False,
        ALIGNED=True,
        EVEN=True,
        ROWS=8,
        GRAD_SCALE=False,
        SKIP_NONFINITE=True,
    )
    spec.update(kw)
    return spec


def specializations():
    """(constexprs, num_warps): every format x param dtype x grad dtype on the fast path (whole blocks, aligned), the
    launch tiles, and the other paths: element-wise (unaligned, partial blocks), rounding to nearest, maximize, per
    tensor steps, the gradients scaled first (gradient release's clip; each gradient dtype, the launch tile), and the
    kernel without its non-finite check (benchmarks only)."""
    for fmt, p, g in itertools.product(FORMATS, DTYPES, DTYPES):
        yield _spec(fmt, p, g), 8
    for fmt, g in itertools.product(FORMATS, DTYPES):
        yield _spec(fmt, "bf16", g, ROWS=1, GRAD_SCALE=True), 1
    for fmt, (rows, warps) in itertools.product(FORMATS, TILES):
        yield _spec(fmt, "bf16", "bf16", ROWS=rows), warps
        yield _spec(fmt, "fp32", "fp32", ROWS=rows), warps
    for fmt in FORMATS:
        yield (
            _spec(
                fmt,
                "bf16",
                "bf16",
                MAXIMIZE=True,
                STOCHASTIC_PARAM=False,
                PER_TENSOR_STEP=True,
                ALIGNED=False,
                EVEN=False,
            ),
            8,
        )
        yield _spec(fmt, "fp16", "fp32", STOCHASTIC_PARAM=False, EVEN=False), 8
        yield _spec(fmt, "bf16", "fp32", STOCHASTIC_PARAM=False, ROWS=1), 1  # nearest, whole blocks
        yield _spec(fmt, "bf16", "bf16", ALIGNED=False, ROWS=1), 1  # whole blocks, unaligned
        yield _spec(fmt, "bf16", "bf16", ROWS=1, SKIP_NONFINITE=False), 1  # the benchmark's kernel without the check


def release_norm_specializations():
    """(signature, constexprs) of the release norm kernel: with and without clipping, each estimate, each dtype of
    the rounded coefficient."""
    for lo, (squared, use_share, has_prev, clip) in itertools.product(
        ("fp32", "bf16", "fp16"),
        [
            (False, False, False, False),
            (False, False, False, True),
            (False, False, True, True),
            (False, True, True, True),
            (True, True, True, True),
        ],
    ):
        signature = {
            "parts_ptr": "*fp32",
            "n": "i32",
            "cum_ptr": "*fp32",
            "k": "i32",
            "prev_cum_ptr": "*fp32",
            "prev_norm_ptr": "*fp32",
            "max_norm": "fp32",
            "coef_ptr": "*fp32",
            "coef_lo_ptr": f"*{lo}",
        }
        spec = dict(SQUARED=squared, USE_SHARE=use_share, HAS_PREV=has_prev, CLIP=clip, BLOCK=BLOCK)
        yield signature, spec


def grad_sumsq_specializations():
    """(signature, constexprs, warps) of the release's sum-of-squares kernel: each gradient dtype, the tiles of
    launch.LAUNCH_CONFIG (1 x 256 and 4 x 256), aligned or not."""
    signature = {
        "cstart_ptr": "*i32",
        "gfirst_ptr": "*i32",
        "addr_ptr": "*i64",
        "numel_ptr": "*i64",
        "num_work": "i32",
        "num_tensors": "i32",
        "out_ptr": "*fp32",
    }
    for g, rows, aligned in itertools.product(("fp32", "bf16", "fp16"), (1, 4), (True, False)):
        yield signature, dict(G_DTYPE=DTYPES[g], ROWS=rows, ALIGNED=aligned, GROUP=SUMSQ_GROUP), rows


def main(cc: int) -> int:
    failures = 0
    for signature, spec, warps in grad_sumsq_specializations():
        t0 = time.time()
        src = triton.compiler.ASTSource(
            fn=_grad_sumsq_kernel, signature={**signature, **{k: "constexpr" for k in spec}}, constexprs=spec
        )
        k = triton.compile(
            src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "enable_fp_fusion": False}
        )
        bad = [b for b in BAD if re.search(b, k.asm["ptx"], re.M)] + fma_problems(k.asm["ptx"])
        failures += bool(bad)
        name = f"grad_sumsq g={spec['G_DTYPE']} rows={spec['ROWS']} aligned={spec['ALIGNED']}"
        print(f"sm_{cc} {name}: {'FAIL ' + str(bad) if bad else 'ok'} ({time.time() - t0:.1f} s)", flush=True)
    for signature, spec in release_norm_specializations():
        t0 = time.time()
        src = triton.compiler.ASTSource(
            fn=_release_norm_kernel, signature={**signature, **{k: "constexpr" for k in spec}}, constexprs=spec
        )
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": 1, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        bad = [b for b in BAD if re.search(b, ptx, re.M)] + fma_problems(ptx)
        bad += [f"missing {r}" for r in REQUIRED if spec["CLIP"] and not re.search(r, ptx)]
        failures += bool(bad)
        name = f"release_norm lo={signature['coef_lo_ptr']} " + " ".join(f"{k}={v}" for k, v in spec.items())
        print(f"sm_{cc} {name}: {'FAIL ' + str(bad) if bad else 'ok'} ({time.time() - t0:.1f} s)", flush=True)
    for spec, warps in specializations():
        t0 = time.time()
        src = triton.compiler.ASTSource(
            fn=_adamw_kernel, signature={**SIGNATURE, **{k: "constexpr" for k in spec}}, constexprs=spec
        )
        k = triton.compile(
            src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "enable_fp_fusion": False}
        )
        ptx = k.asm["ptx"]
        bad = [b for b in BAD if re.search(b, ptx, re.M)]
        bad += fma_problems(ptx)
        bad += [f"missing {r}" for r in REQUIRED if not re.search(r, ptx)]
        failures += bool(bad)
        name = (
            f"{spec['FMT']} p={spec['P_DTYPE']} g={spec['G_DTYPE']} max={spec['MAXIMIZE']} "
            f"sr={spec['STOCHASTIC_PARAM']} per_tensor={spec['PER_TENSOR_STEP']} aligned={spec['ALIGNED']} "
            f"even={spec['EVEN']} tile={spec['ROWS']}x{warps}"
            + (" grad_scale" if spec["GRAD_SCALE"] else "")
            + ("" if spec["SKIP_NONFINITE"] else " no_nonfinite_check")
        )
        print(f"sm_{cc} {name}: {'FAIL ' + str(bad) if bad else 'ok'} ({time.time() - t0:.1f} s)", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(1 if main(int(sys.argv[1]) if len(sys.argv) > 1 else 75) else 0)
