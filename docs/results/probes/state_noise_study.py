"""How much noise stochastic rounding leaves in the 8-bit moments: the shipped codes (format version 2), the codes of
version 1, and candidate formats.

Each element's input (g for m, g**2 for v) is held constant at levels spread over four decades below its block's
maximum; the moment runs 3,000 AdamW updates (beta1 = 0.9 for m, beta2 = 0.999 for v) and is re-encoded after each,
as in training; printed: the relative standard deviation (and mean) of the decoded moment around its exact value, per
decade of value / block max. Candidate codes are unsigned minifloats eEmM on the block-normalized value (scale =
block absmax rounded up to bf16, as shipped), chosen between neighbouring codes by a table search with 16 random bits.

    python docs/results/probes/state_noise_study.py [--steps 3000]
    python docs/results/probes/state_noise_study.py --sass   # instruction cost of the codecs on sm_90, compiled on the CPU
    python docs/results/probes/state_noise_study.py --train  # small trainings (tests/optim/test_convergence.py's), 5 seeds

This is a CPU study for the 8-bit format's design (docs/results/step_benchmark/step_h200_2026-11-30.notes.md):
minifloat codes are cheaper to encode in the kernel than the root-companded codes of version 1, and this measures
what they cost in precision. ``--train`` steps every variant with ``reference.adamw_step_ref_`` per tensor (the
engines run only the shipped codes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from apexw_hf import reference as ref  # noqa: E402


def minifloat_table(e_bits: int, m_bits: int) -> torch.Tensor:
    """Every value <= 1 of an unsigned minifloat with e_bits exponent and m_bits mantissa bits (1.0 = top binade)."""
    bias = 2**e_bits - 1
    vals = {0.0}
    vals.update(2.0 ** (1 - bias) * m / 2**m_bits for m in range(1, 2**m_bits))
    for e in range(1, 2**e_bits):
        vals.update(v for m in range(2**m_bits) if (v := 2.0 ** (e - bias) * (1 + m / 2**m_bits)) <= 1.0)
    return torch.tensor(sorted(vals), dtype=torch.float32)


def table_code(y: torch.Tensor, table: torch.Tensor, u16: torch.Tensor) -> torch.Tensor:
    """Index into the increasing ``table`` for ``y`` in [0, 1]: the largest entry at most ``y`` or the next one,
    chosen with the 16 random bits ``u16`` so that the decoded value is ``y`` on average (version 1's rule)."""
    lo = (torch.searchsorted(table, y.contiguous(), right=True) - 1).clamp(0, table.numel() - 2)
    qlo, qhi = table[lo], table[lo + 1]
    return lo + ((u16.to(torch.float32) * 2.0**-16 * (qhi - qlo)) < (y - qlo)).long()


def table_codec(table: torch.Tensor):
    def quant(v, bits):
        vb = ref._blocks(v)
        scale, inv = ref._scale(vb)
        idx = table_code(ref._normalized(vb, inv), table, ref._blocks(bits) & 0xFFFF)
        return torch.where((vb > 0) & (idx == 0), torch.ones_like(idx), idx), scale

    def dequant(idx, scale):
        return (table[idx] * scale.float()[:, None]).reshape(-1)

    return quant, dequant


def sass_cost() -> None:
    """SASS instructions per element (sm_90, one warp per 256-element block) of the 8-bit coding: decode, one EMA
    update and encode of v alone, then of both moments with their random word (the coding part of the 8-bit kernel);
    each with the shipped codes and with minifloat codes (encoded with integer work on the fp32 bits)."""
    import re
    import subprocess
    import tempfile

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from apexw_hf.engines.triton.kernels._quant import block_scale, dequant_m, dequant_v, normalized, quant_m, quant_v
    from apexw_hf.engines.triton.kernels._rounding import GOLDEN, bf16_bits_to_f32, uniform_bits

    @triton.jit
    def shipped(g_ptr, c_ptr, s_ptr, bits_ptr):
        offs = tl.program_id(0) * 256 + tl.arange(0, 256)[None, :]
        mask = offs < 1 << 30
        v = dequant_v(tl.load(c_ptr + offs), tl.load(s_ptr + tl.program_id(0) + tl.arange(0, 1)))
        v = v * 0.999 + tl.load(g_ptr + offs) * 0.001
        c, sb = quant_v(v, mask, tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True))
        tl.store(c_ptr + offs, c)
        tl.store(s_ptr + tl.program_id(0) + tl.arange(0, 1), sb)

    @triton.jit
    def e4m4(g_ptr, c_ptr, s_ptr, bits_ptr):
        offs = tl.program_id(0) * 256 + tl.arange(0, 256)[None, :]
        mask = offs < 1 << 30
        codes = tl.load(c_ptr + offs).to(tl.uint32)
        normal = ((codes + 1792) << 19).to(tl.float32, bitcast=True)  # code >= 16: 2**(E-15) * (1 + m/16)
        y = tl.where(codes >= 16, normal, codes.to(tl.float32) * (2.0**-18))  # below: code * 2**-18
        v = y * bf16_bits_to_f32(tl.load(s_ptr + tl.program_id(0) + tl.arange(0, 1)))[:, None]
        v = v * 0.999 + tl.load(g_ptr + offs) * 0.001
        sb, inv = block_scale(v, mask)
        y = normalized(v, inv)
        r16 = tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True) & 0xFFFF
        cn = ((y.to(tl.uint32, bitcast=True) + (r16 << 3)) >> 19) - 1792  # stochastic: 16 random bits below m
        cs = tl.floor(y * (2.0**18) + r16.to(tl.float32) * (2.0**-16)).to(tl.uint32)
        c = tl.where(y >= 2.0**-14, cn, cs)
        c = tl.where((v > 0) & (c == 0), 1, c)
        tl.store(c_ptr + offs, c.to(tl.uint8))
        tl.store(s_ptr + tl.program_id(0) + tl.arange(0, 1), sb)

    @triton.jit
    def both_shipped(g_ptr, mc_ptr, vc_ptr, ms_ptr, vs_ptr, key):
        """Both moments as shipped: decode, update, one random word, encode (the 8-bit kernel's coding part)."""
        b = tl.program_id(0)
        offs = b * 256 + tl.arange(0, 256)[None, :]
        mask = offs < 1 << 30
        srow = b + tl.arange(0, 1)
        g = tl.load(g_ptr + offs)
        m = dequant_m(tl.load(mc_ptr + offs), tl.load(ms_ptr + srow))
        v = dequant_v(tl.load(vc_ptr + offs), tl.load(vs_ptr + srow))
        m = m * 0.9 + g * 0.1
        v = v * 0.999 + (g * g) * 0.001
        bits = uniform_bits(offs.to(tl.uint32) * GOLDEN, key.to(tl.uint32))
        cm, sm = quant_m(m, mask, bits)
        cv, sv = quant_v(v, mask, bits)
        tl.store(mc_ptr + offs, cm)
        tl.store(vc_ptr + offs, cv)
        tl.store(ms_ptr + srow, sm)
        tl.store(vs_ptr + srow, sv)

    @triton.jit
    def both_minifloat(g_ptr, mc_ptr, vc_ptr, ms_ptr, vs_ptr, key):
        """The same with minifloat codes: m as sign + e4m3 (subnormals below 2**-14, code * 2**-17), v as e4m4
        (code * 2**-18 below 2**-14), both rounded stochastically by adding random bits below the kept mantissa."""
        b = tl.program_id(0)
        offs = b * 256 + tl.arange(0, 256)[None, :]
        mask = offs < 1 << 30
        srow = b + tl.arange(0, 1)
        g = tl.load(g_ptr + offs)
        cm = tl.load(mc_ptr + offs).to(tl.uint32)
        mag = cm & 127
        am = tl.where(mag >= 8, ((mag + 896) << 20).to(tl.float32, bitcast=True), mag.to(tl.float32) * (2.0**-17))
        m = tl.where(cm >= 128, -am, am) * bf16_bits_to_f32(tl.load(ms_ptr + srow))[:, None]
        cv = tl.load(vc_ptr + offs).to(tl.uint32)
        yv = tl.where(cv >= 16, ((cv + 1792) << 19).to(tl.float32, bitcast=True), cv.to(tl.float32) * (2.0**-18))
        v = yv * bf16_bits_to_f32(tl.load(vs_ptr + srow))[:, None]
        m = m * 0.9 + g * 0.1
        v = v * 0.999 + (g * g) * 0.001
        bits = uniform_bits(offs.to(tl.uint32) * GOLDEN, key.to(tl.uint32))
        rm, rv = bits >> 16, bits & 0xFFFF
        a = tl.abs(m)
        sbm, invm = block_scale(a, mask)
        y = normalized(a, invm)
        cn = ((y.to(tl.uint32, bitcast=True) + (rm << 4)) >> 20) - 896
        cs = tl.floor(y * (2.0**17) + rm.to(tl.float32) * (2.0**-16)).to(tl.uint32)
        c = tl.where(y >= 2.0**-14, cn, cs) | tl.where(m < 0, 128, 0)
        sbv, invv = block_scale(v, mask)
        y = normalized(v, invv)
        cn = ((y.to(tl.uint32, bitcast=True) + (rv << 3)) >> 19) - 1792
        cs = tl.floor(y * (2.0**18) + rv.to(tl.float32) * (2.0**-16)).to(tl.uint32)
        c2 = tl.where(y >= 2.0**-14, cn, cs)
        c2 = tl.where((v > 0) & (c2 == 0), 1, c2)
        tl.store(mc_ptr + offs, c.to(tl.uint8))
        tl.store(vc_ptr + offs, c2.to(tl.uint8))
        tl.store(ms_ptr + srow, sbm)
        tl.store(vs_ptr + srow, sbv)

    sig = {"g_ptr": "*fp32", "c_ptr": "*u8", "s_ptr": "*u16", "bits_ptr": "*i32"}
    sig2 = {"g_ptr": "*fp32", "mc_ptr": "*i8", "vc_ptr": "*u8", "ms_ptr": "*u16", "vs_ptr": "*u16", "key": "i32"}
    sig3 = {**sig2, "mc_ptr": "*u8"}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    probes = (
        ("v only: shipped 4th-root code", shipped, sig),
        ("v only: e4m4 minifloat code", e4m4, sig),
        ("m and v: shipped codes", both_shipped, sig2),
        ("m and v: e4m3 / e4m4 minifloats", both_minifloat, sig3),
    )
    for name, fn, signature in probes:
        src = triton.compiler.ASTSource(fn=fn, signature=signature)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "enable_fp_fusion": False})
        with tempfile.TemporaryDirectory() as d:
            Path(d, "k.cubin").write_bytes(k.asm["cubin"])
            sass = subprocess.run([str(tool), "-sass", str(Path(d, "k.cubin"))], capture_output=True, text=True).stdout
        ins = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
        main_path = ins[: next((i for i, line in enumerate(ins) if "RET" in line), len(ins))]
        print(f"{name:34s} {len(main_path) / 8:.1f} SASS instructions per element (main path)")


# Format version 1 of the 8-bit codes (before the minifloat codes of version 2), encoded as it was specified then:
# the largest code decoding to at most y, or the next one, chosen with 16 random bits (top 16 for m, low 16 for v).
_V1_M_TABLE = ref._q2(torch.arange(128, dtype=torch.float32))
_V1_V_TABLE = ref._q4(torch.arange(256, dtype=torch.float32))


def v1_quantize_m(m, bits):
    mb = ref._blocks(m)
    scale, inv = ref._scale(mb.abs())
    c = table_code(ref._normalized(mb.abs(), inv), _V1_M_TABLE, ref._blocks(bits) >> 16)
    c = torch.where(mb < 0, -c, c)
    return c.reshape(-1)[: m.numel()].to(torch.int8).view(m.shape), scale


def v1_quantize_v(v, bits):
    vb = ref._blocks(v)
    scale, inv = ref._scale(vb)
    c = table_code(ref._normalized(vb, inv), _V1_V_TABLE, ref._blocks(bits) & 0xFFFF)
    c = torch.where((vb > 0) & (c == 0), torch.ones_like(c), c)
    return c.reshape(-1)[: v.numel()].to(torch.uint8).view(v.shape), scale


CODECS = {
    "v2 (shipped: e4m3 / e4m4 minifloats)": (ref.quantize_m, ref.dequantize_m, ref.quantize_v, ref.dequantize_v),
    "v1 (root-companded codes)": (v1_quantize_m, ref.dequantize_m_v1, v1_quantize_v, ref.dequantize_v_v1),
}


class RefAdamW8bit(torch.optim.Optimizer):
    """AdamW with 8-bit state stepped per tensor by ``reference.adamw_step_ref_``, with the codec swapped in for the
    step: the study's way to train with a code the engines do not run (fp32 parameters only)."""

    def __init__(self, params, codec, lr, weight_decay, seed=0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.codec, self.seed = codec, seed

    @torch.no_grad()
    def step(self):
        names = ("quantize_m", "dequantize_m", "quantize_v", "dequantize_v")
        saved = [getattr(ref, n) for n in names]
        for n, f in zip(names, self.codec):
            setattr(ref, n, f)
        try:
            for group in self.param_groups:
                for i, p in enumerate(group["params"]):
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        m_dtype = torch.int8 if self.codec[0] is v1_quantize_m else torch.uint8
                        nb = ref.num_blocks(p.numel())
                        st.update(step=0, exp_avg=torch.zeros_like(p, dtype=m_dtype),
                                  exp_avg_sq=torch.zeros_like(p, dtype=torch.uint8),
                                  exp_avg_scale=torch.zeros(nb, dtype=torch.bfloat16),
                                  exp_avg_sq_scale=torch.zeros(nb, dtype=torch.bfloat16))  # fmt: skip
                    st["step"] += 1
                    s = ref.StepScalars.make(lr=group["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                                             weight_decay=group["weight_decay"], step=st["step"])  # fmt: skip
                    ref.adamw_step_ref_(p, p.grad, st, fmt="8bit", scalars=s, seed=self.seed, tensor_index=i,
                                        step=st["step"])  # fmt: skip
        finally:
            for n, f in zip(names, saved):
                setattr(ref, n, f)


def train_study(seeds=range(5)) -> None:
    """Final losses of the convergence tests' two small trainings (longer) with torch AdamW and with 8-bit state in
    each code version, stepped by the reference (so the code under study is the one that runs)."""
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "optim"))
    from test_convergence import _teacher_student, _tiny_llama

    makers = {"torch AdamW": lambda params, seed: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)}
    for name, codec in CODECS.items():
        makers[f"8-bit {name}"] = lambda params, seed, codec=codec: RefAdamW8bit(params, codec, 3e-3, 0.01, seed)
    for task, fn, steps in (("teacher-student MLP", _teacher_student, 300), ("tiny Llama", _tiny_llama, 120)):
        base = None
        for name, make in makers.items():
            losses = [fn(s, lambda ps, s=s, make=make: make(ps, s), steps=steps) for s in seeds]
            mean, sd = statistics.fmean(losses), statistics.stdev(losses)
            base = base or losses
            diffs = [a - b for a, b in zip(losses, base)]
            paired = f"  paired diff vs torch {statistics.fmean(diffs):+.4f} +- {statistics.stdev(diffs):.4f}"
            print(f"{task:20s} {name:44s} final loss {mean:.4f} +- {sd:.4f}{paired}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--sass", action="store_true", help="print the codecs' instruction cost instead")
    ap.add_argument("--train", action="store_true", help="small trainings with each v code instead")
    args = ap.parse_args()
    if args.sass:
        sass_cost()
        return
    if args.train:
        train_study()
        return
    blocks = 64
    n = ref.BLOCK * blocks
    level = torch.logspace(-4, 0, ref.BLOCK).repeat(blocks)  # |value| / block max of each element, constant input
    decades = [(1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 1e-1), (1e-1, 1.01)]
    print("relative std (mean) of the decoded moment after each update, by value / block max:",
          "  ".join(f"[{a:g},{b:g})" for a, b in decades))  # fmt: skip
    formats = {}
    for name, (qm, dqm, qv, dqv) in CODECS.items():
        formats[f"v  {name}"] = (qv, dqv, 0.999)
        formats[f"m  {name}"] = (qm, dqm, 0.9)
    for e, m in ((5, 3), (3, 5)):
        t = minifloat_table(e, m)
        formats[f"v  table minifloat e{e}m{m} ({t.numel()} codes)"] = (*table_codec(t), 0.999)
    for name, (quant, dequant, beta) in formats.items():
        # m: alternating signs, so the sign path is exercised; v: g**2 levels
        target = level * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0) if name.startswith("m") else level
        codes, scale = quant(target, ref.hash_uniform_bits(n, 1, "cpu"))
        for t in range(1, args.steps + 1):
            x = dequant(codes, scale).reshape(-1) * beta + target * (1 - beta)
            codes, scale = quant(x, ref.hash_uniform_bits(n, ref.stream_key(0, 0, t, ref.STREAM_MV), "cpu"))
        rel = (dequant(codes, scale).reshape(-1) / target - 1).view(blocks, ref.BLOCK)
        cols = level.view(blocks, ref.BLOCK)[0]
        cells = []
        for a, b in decades:
            r = rel[:, (cols >= a) & (cols < b)]
            cells.append(f"{r.std().item():.4f} ({r.mean().item():+.4f})")
        print(f"{name:48s}", "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
