"""The one AdamW update kernel: every tensor of a parameter group in one launch, state format chosen at compile time.

Per element, in fp32 with only IEEE-rounded operations (launch with ``enable_fp_fusion=False``; division and
square root are the correctly rounded ``div_rn`` / ``sqrt_rn``), exactly as
:func:`apexw_hf.reference.adamw_step_ref_`::

    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p * (1 - lr * wd) - (m / (sqrt(v) * (1 / sqrt(1 - beta2**t)) + eps)) * (lr / (1 - beta1**t))

One program handles one chunk of ``ROWS * 256`` consecutive elements of one tensor, as a ``[ROWS, 256]`` tile (a row is
one 8-bit quantization block, or two 4-bit blocks). Each program finds its (tensor, chunk) from the tensors'
first-chunk numbers (a short search, started from a table with one entry per WORK_GROUP programs, so no per-chunk list
takes device memory); the address table gives each tensor's parameter, gradient and state pointers (a gradient address
of 0 marks a tensor that does not step now).
Random bits for stochastic rounding come from the counter-based hash of (seed, tensor index, step, stream, element),
computed in the kernel from a per-tensor key and ``mix32(step)`` (mixed on the host), so nothing but that number
changes from step to step.

A row of the tile whose new ``v`` holds a NaN or an infinity is not written at all (``reference.nonfinite_blocks``,
``SKIP_NONFINITE``): the row's maximum of ``v``'s bits (the one the 8-bit and 4-bit scales take) masks the stores,
and the program adds the rows it skipped to the optimizer's counters last (:func:`_count_skipped`).

Formats (``FMT``): ``"fp32"`` moments stored exactly; ``"compact"`` bf16 moments written with stochastic rounding;
``"8bit"`` uint8 minifloat codes (format version 3) with one scale per 256 elements and moment (bf16 for ``m``, an
fp32 envelope for ``v``); ``"4bit"`` both moments' 4-bit codes in one byte per element (``exp_avg_mv``, format
version 4), one fp32 scale per 128 elements and moment. bf16/fp16
parameters are rounded stochastically (``STOCHASTIC_PARAM``) or to nearest. With 8-bit or 4-bit state, a bf16
parameter is rounded with the top 16 bits of the moments' random word (``reference.param_stream``), so the kernel
hashes one word per element.
"""

import triton
import triton.language as tl

from ._quant import (
    dequant_m,
    dequant_m_words,
    dequant_mv4,
    dequant_mv4_words,
    dequant_v,
    dequant_v_words,
    quant_m,
    quant_mv4,
    quant_v,
    row_max_bits,
)
from ._rounding import (
    GOLDEN,
    STREAM_MV,
    STREAM_P,
    bf16_bits_to_f32,
    f32_to_bf16_bits_nearest,
    f32_to_bf16_bits_stochastic,
    f32_to_bf16_hi_nearest,
    f32_to_bf16_hi_stochastic,
    f32_to_f16_stochastic,
    mix32,
    pack_bf16_hi,
    stream_key,
    uniform_bits,
    unpack_bf16,
)

QBLOCK = tl.constexpr(256)
QBLOCK4 = tl.constexpr(128)  # elements per 4-bit block: two to a row of the tile

# Rows of the address table (int64 [NUM_ADDR_ROWS, T]). With 4-bit state ADDR_M holds exp_avg_mv and ADDR_V is 0.
ADDR_PARAM, ADDR_GRAD, ADDR_M, ADDR_V, ADDR_M_SCALE, ADDR_V_SCALE = (tl.constexpr(i) for i in range(6))
NUM_ADDR_ROWS = 6


@triton.jit
def _base(addr, start, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to element ``start`` of the tensor at ``addr`` (bf16 as uint16); per-element offsets stay int32."""
    if DTYPE == tl.bfloat16:
        ptr = addr.to(tl.pointer_type(tl.uint16)) + start
    else:
        ptr = addr.to(tl.pointer_type(DTYPE)) + start
    if ALIGNED:
        # The host checked that every base address is 16-byte aligned; start is a multiple of 256 elements.
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _words(ptr, ALIGNED: tl.constexpr):
    """``ptr`` as a pointer to uint32 words (16-byte aligned when ``ALIGNED``)."""
    wptr = ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
    if ALIGNED:
        wptr = tl.multiple_of(wptr, 16)
    return wptr


@triton.jit
def _load_f32(ptr, offs, mask, DTYPE: tl.constexpr, WORDS: tl.constexpr, ALIGNED: tl.constexpr, w2offs, w2mask):
    """Load a [R, 256] tile as fp32. With ``WORDS`` (whole blocks at aligned addresses) bf16 is read as uint32 words of
    two values and widened with one integer operation each (a shift, a mask): the 16-bit halves of a vector load are
    otherwise extracted one by one before the shift."""
    if DTYPE == tl.bfloat16 and WORDS:
        return unpack_bf16(tl.load(_words(ptr, ALIGNED) + w2offs, mask=w2mask, other=0))
    x = tl.load(ptr + offs, mask=mask, other=0)
    if DTYPE == tl.bfloat16:
        return bf16_bits_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def _store_f32_runs(ptr, x, rows, rest, keep):
    """Store an fp32 [R, 256] tile of whole rows (``rows * 256 < rest``) where ``keep`` ([R], the non-finite ``v``
    check) as two [R, 32, 4] halves.

    Each thread holds 8 consecutive elements of the tile, and a store of 8 fp32 per thread is given a layout of 4
    consecutive elements per thread (16 bytes, the widest access), reached through 8 shuffles per thread and their
    selects; each half is 4 consecutive elements per thread as it is, so nothing moves.
    """
    R: tl.constexpr = x.shape[0]
    lo, hi = tl.split(tl.permute(tl.reshape(x, (R, 32, 2, 4)), (0, 1, 3, 2)))
    offs = rows[:, None, None] * QBLOCK + tl.arange(0, 32)[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    mask = tl.broadcast_to((rows[:, None, None] * QBLOCK < rest) & keep[:, None, None], (R, 32, 4))
    tl.store(ptr + offs, lo, mask=mask)
    tl.store(ptr + offs + 4, hi, mask=mask)


@triton.jit
def _scaled(g, c, G_DTYPE: tl.constexpr):
    """``g * c`` as PyTorch multiplies a gradient tensor of ``G_DTYPE`` in place by the 0-d tensor ``c`` rounded to
    that dtype (gradient release's clip): both factors widened to fp32, one product rounded to nearest even in the
    gradient's dtype. ``g`` and the result are fp32 values of that dtype."""
    if G_DTYPE == tl.bfloat16:
        c = bf16_bits_to_f32(f32_to_bf16_bits_nearest(c))
        return bf16_bits_to_f32(f32_to_bf16_bits_nearest(g * c))
    elif G_DTYPE == tl.float16:
        c = c.to(tl.float16).to(tl.float32)
        return (g * c).to(tl.float16).to(tl.float32)
    else:
        return g * c


WORK_GROUP = tl.constexpr(64)


@triton.jit
def _find_chunk(pid, cstart_ptr, gfirst_ptr, num_tensors):
    """The (tensor, chunk) of program ``pid``: the largest t with ``cstart[t] <= pid`` (so a tensor without chunks is
    never chosen), searched between the tensors of this program's WORK_GROUP and of the next group's first program."""
    grp = pid // WORK_GROUP
    lo = tl.load(gfirst_ptr + grp)
    hi = tl.minimum(tl.load(gfirst_ptr + grp + 1) + 1, num_tensors)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(cstart_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo, pid - tl.load(cstart_ptr + lo)


@triton.jit
def _count_skipped(nf_ptr, tidx_ptr, t, serial, nbad):
    """Count ``nbad`` skipped blocks of tensor ``t``: ``nf[2 + tensor index] += nbad``; and the step ``serial`` once
    per step in ``nf[1]``, whichever program and launch of the step comes first (``nf[0]`` holds the serial of the
    last step that skipped something, swapped atomically). Programs without a non-finite gradient do nothing."""
    if nbad > 0:  # counts only: no ordering with other memory operations is needed
        tl.atomic_add(nf_ptr + 2 + tl.load(tidx_ptr + t), nbad, sem="relaxed")
        last = tl.atomic_xchg(nf_ptr, serial, sem="relaxed")
        tl.atomic_add(nf_ptr + 1, (last != serial).to(tl.int32), sem="relaxed")


@triton.jit(do_not_specialize=["num_work", "num_tensors", "first_program", "mixed_step", "serial"])
def _adamw_kernel(
    cstart_ptr,  # int32 [num_tensors + 1]: first chunk (program) of each tensor, then the total
    gfirst_ptr,  # int32 [num_work // WORK_GROUP + 2]: the tensor of program k * WORK_GROUP (clamped to the last)
    addr_ptr,  # int64 [6, num_tensors]: see ADDR_* (the kernel reads the parameter and gradient rows)
    state_ptr,  # int64 [4, num_tensors]: the state rows ADDR_M .. ADDR_V_SCALE (of addr_ptr's table, or another's)
    numel_ptr,  # int64 [num_tensors]
    tkey_ptr,  # int32 [num_tensors]: mix32(seed + GOLDEN * (tensor_index + 1))
    tstep_ptr,  # int32 [3, num_tensors]: step, step_size (fp32 bits), inv_bc2_sqrt (fp32 bits); PER_TENSOR_STEP only
    num_work,
    num_tensors,
    first_program,  # this launch's program k computes work item first_program + k (a launch may cover a range)
    mixed_step,  # mix32(step), the step's part of the random keys, mixed on the host (unused with PER_TENSOR_STEP)
    step_size,
    inv_bc2_sqrt,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    decay,
    eps,
    gscale_ptr,  # fp32 [1]: the factor the gradients are multiplied by first (GRAD_SCALE)
    nf_ptr,  # int32 [2 + tensors]: the optimizer's non-finite counters on this device (see _count_skipped)
    tidx_ptr,  # int32 [num_tensors]: each tensor's index in the optimizer (its counter is nf[2 + index])
    serial,  # the optimizer's step number, for the count of steps that skipped something
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    STOCHASTIC_PARAM: tl.constexpr,
    PER_TENSOR_STEP: tl.constexpr,
    ALIGNED: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    GRAD_SCALE: tl.constexpr,
    SKIP_NONFINITE: tl.constexpr,
):
    """One program updates one chunk (``ROWS`` x 256 elements) of one tensor: parameter, moments, scales, as the
    module docstring says. It stays one function of ~220 lines because every format's path is a compile-time branch
    of it (``FMT``) and the order of its loads and masked stores is what the memory pipeline sees; the arithmetic
    (quantization, rounding, random bits) is in the ``@triton.jit`` helpers it calls."""
    pid = tl.program_id(0) + first_program
    t, chunk = _find_chunk(pid, cstart_ptr, gfirst_ptr, num_tensors)
    g_addr = tl.load(addr_ptr + ADDR_GRAD * num_tensors + t)
    if g_addr != 0:
        numel = tl.load(numel_ptr + t)
        start = chunk.to(tl.int64) * (ROWS * QBLOCK)
        rest = tl.minimum(numel - start, ROWS * QBLOCK).to(tl.int32)
        rows = tl.arange(0, ROWS)
        cols = tl.arange(0, QBLOCK)
        offs = rows[:, None] * QBLOCK + cols[None, :]
        if EVEN:
            # Every tensor of the launch is whole 256-element blocks: the mask is constant along a row, so loads and
            # stores of consecutive elements become vector instructions.
            mask = tl.broadcast_to(rows[:, None] * QBLOCK < rest, (ROWS, QBLOCK))
        else:
            mask = offs < rest
        # Whole blocks at 16-byte aligned addresses: 16-bit and 8-bit data move as uint32 words (each thread then holds
        # 8 consecutive elements). Not with fp32 moments: their loads give each thread two runs of 4 elements, 128
        # apart, and 16-bit data loaded element-wise is redistributed to match with fewer shuffles.
        WORDS: tl.constexpr = EVEN and ALIGNED and FMT != "fp32"
        if WORDS:
            w2offs = rows[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :]
            w2mask = tl.broadcast_to(rows[:, None] * QBLOCK < rest, (ROWS, QBLOCK // 2))
        else:
            w2offs = offs
            w2mask = mask

        if PER_TENSOR_STEP:
            mixed_step = mix32(tl.load(tstep_ptr + t).to(tl.uint32, bitcast=True)).to(tl.int32, bitcast=True)
            step_size = tl.load(tstep_ptr + num_tensors + t).to(tl.float32, bitcast=True)
            inv_bc2_sqrt = tl.load(tstep_ptr + 2 * num_tensors + t).to(tl.float32, bitcast=True)
        NEED_P_BITS: tl.constexpr = STOCHASTIC_PARAM and (P_DTYPE != tl.float32)
        if FMT != "fp32" or NEED_P_BITS:
            tkey = tl.load(tkey_ptr + t).to(tl.uint32, bitcast=True)
            ustep = mixed_step.to(tl.uint32, bitcast=True)
            # Element index mod 2**32 times GOLDEN, as in reference.hash_uniform_bits.
            idx_golden = (start.to(tl.uint32) + offs.to(tl.uint32)) * GOLDEN

        p_addr = tl.load(addr_ptr + ADDR_PARAM * num_tensors + t)
        m_addr = tl.load(state_ptr + (ADDR_M - ADDR_M) * num_tensors + t)
        if FMT != "4bit":
            v_addr = tl.load(state_ptr + (ADDR_V - ADDR_M) * num_tensors + t)

        g = _load_f32(_base(g_addr, start, G_DTYPE, ALIGNED), offs, mask, G_DTYPE, WORDS, ALIGNED, w2offs, w2mask)
        if GRAD_SCALE:
            g = _scaled(g, tl.load(gscale_ptr), G_DTYPE)
        if MAXIMIZE:
            g = -g
        p_ptr = _base(p_addr, start, P_DTYPE, ALIGNED)
        p = _load_f32(p_ptr, offs, mask, P_DTYPE, WORDS, ALIGNED, w2offs, w2mask)
        if FMT == "4bit":
            # One scale per 128 elements and moment: blocks 2 * row and 2 * row + 1 of the chunk.
            srows = tl.arange(0, 2 * ROWS)
            bmask = srows * QBLOCK4 < rest  # blocks holding an element
            blk0 = chunk.to(tl.int64) * (2 * ROWS)
            # format version 4: both scales are fp32 (v's an envelope that the encoding reads back)
            ms_addr = tl.load(state_ptr + (ADDR_M_SCALE - ADDR_M) * num_tensors + t)
            ms_ptr = ms_addr.to(tl.pointer_type(tl.uint32)) + blk0
            vs_addr = tl.load(state_ptr + (ADDR_V_SCALE - ADDR_M) * num_tensors + t)
            vs_ptr = vs_addr.to(tl.pointer_type(tl.uint32)) + blk0
            msc = tl.load(ms_ptr + srows, mask=bmask, other=0).to(tl.float32, bitcast=True)
            vsc = tl.load(vs_ptr + srows, mask=bmask, other=0).to(tl.float32, bitcast=True)
            # Both moments' codes in one byte per element: one byte load and one byte store per element.
            mv_ptr = _base(m_addr, start, tl.uint8, ALIGNED)
            if EVEN and ALIGNED:
                # Whole rows at 16-byte aligned addresses: the codes are read as uint32 words, four to a word (see
                # _quant.dequant_mv4_words).
                woffs = rows[:, None] * (QBLOCK // 4) + tl.arange(0, QBLOCK // 4)[None, :]
                wmask = tl.broadcast_to(rows[:, None] * QBLOCK < rest, (ROWS, QBLOCK // 4))
                mvw_ptr = tl.multiple_of(m_addr.to(tl.pointer_type(tl.uint32)) + start // 4, 16)
                m, v = dequant_mv4_words(tl.load(mvw_ptr + woffs, mask=wmask, other=0), msc, vsc)
            else:
                m, v = dequant_mv4(tl.load(mv_ptr + offs, mask=mask, other=0), msc, vsc)
        elif FMT == "8bit":
            bmask = rows < (rest + QBLOCK - 1) // QBLOCK
            blk0 = start // QBLOCK
            ms_addr = tl.load(state_ptr + (ADDR_M_SCALE - ADDR_M) * num_tensors + t)
            ms_ptr = ms_addr.to(tl.pointer_type(tl.uint16)) + blk0
            # format version 3: the v scales are fp32 (an envelope that the encoding reads back)
            vs_addr = tl.load(state_ptr + (ADDR_V_SCALE - ADDR_M) * num_tensors + t)
            vs_ptr = vs_addr.to(tl.pointer_type(tl.uint32)) + blk0
            mc_ptr = _base(m_addr, start, tl.uint8, ALIGNED)
            vc_ptr = _base(v_addr, start, tl.uint8, ALIGNED)
            msc = tl.load(ms_ptr + rows, mask=bmask, other=0)
            vsc = tl.load(vs_ptr + rows, mask=bmask, other=0).to(tl.float32, bitcast=True)
            if EVEN and ALIGNED:
                # Whole blocks at 16-byte aligned addresses: the codes are read as uint32 words, four to a word, and
                # decoded two at a time (see _quant.dequant_m_words).
                woffs = rows[:, None] * (QBLOCK // 4) + tl.arange(0, QBLOCK // 4)[None, :]
                wmask = tl.broadcast_to(rows[:, None] * QBLOCK < rest, (ROWS, QBLOCK // 4))
                mw_ptr = tl.multiple_of(m_addr.to(tl.pointer_type(tl.uint32)) + start // 4, 16)
                vw_ptr = tl.multiple_of(v_addr.to(tl.pointer_type(tl.uint32)) + start // 4, 16)
                m = dequant_m_words(tl.load(mw_ptr + woffs, mask=wmask, other=0), msc)
                v = dequant_v_words(tl.load(vw_ptr + woffs, mask=wmask, other=0), vsc)
            else:
                m = dequant_m(tl.load(mc_ptr + offs, mask=mask, other=0), msc)
                v = dequant_v(tl.load(vc_ptr + offs, mask=mask, other=0), vsc)
        elif FMT == "compact":
            m_ptr = _base(m_addr, start, tl.bfloat16, ALIGNED)
            v_ptr = _base(v_addr, start, tl.bfloat16, ALIGNED)
            m = _load_f32(m_ptr, offs, mask, tl.bfloat16, WORDS, ALIGNED, w2offs, w2mask)
            v = _load_f32(v_ptr, offs, mask, tl.bfloat16, WORDS, ALIGNED, w2offs, w2mask)
        else:
            m_ptr = _base(m_addr, start, tl.float32, ALIGNED)
            v_ptr = _base(v_addr, start, tl.float32, ALIGNED)
            m = _load_f32(m_ptr, offs, mask, tl.float32, WORDS, ALIGNED, w2offs, w2mask)
            v = _load_f32(v_ptr, offs, mask, tl.float32, WORDS, ALIGNED, w2offs, w2mask)

        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        # the absmax of v for its scales (8-bit [ROWS], 4-bit [2 * ROWS]), which the check below reads too
        if FMT == "8bit":
            vmax = row_max_bits(v, mask)
            sbmask = bmask  # the blocks whose scales are stored
        elif FMT == "4bit":
            vmax = row_max_bits(tl.reshape(v, (2 * ROWS, QBLOCK4)), tl.reshape(mask, (2 * ROWS, QBLOCK4)))
            sbmask = bmask
        if SKIP_NONFINITE:
            # reference.nonfinite_blocks: a row of the tile (256 elements) whose new v holds a NaN or an infinity (a
            # NaN or infinite gradient, or one whose square overflows) is not written (its parameter, moments and
            # scales keep their values): the masks of every store below lose it. Loads do not wait for this; the
            # store masks stay constant along a row, so stores stay vector instructions.
            # [ROWS]: v >= 0 (or NaN), so its bits are at least inf's exactly when it is not finite: an integer maximum
            # of the bits, which the 8-bit and 4-bit scales take anyway
            if FMT == "8bit":
                vrow = vmax
            elif FMT == "4bit":
                vrow = tl.max(tl.reshape(vmax, (ROWS, 2)), axis=1)  # both blocks of a row
            else:  # no mask: past the tensor's end v is 0 (or NaN with a NaN grad_scale, as in the row's elements)
                vrow = tl.max(v.to(tl.uint32, bitcast=True), axis=1)
            ok_row = (vrow < 0x7F800000).to(tl.int32)
            smask = mask & (ok_row[:, None] != 0)
            w2smask = w2mask & (ok_row[:, None] != 0)
            if FMT == "8bit":
                sbmask = bmask & (ok_row != 0)
            elif FMT == "4bit":
                sbmask = bmask & (tl.reshape(tl.join(ok_row, ok_row), (2 * ROWS,)) != 0)  # both blocks of a row
        else:
            smask = mask
            w2smask = w2mask

        # The moments are stored first: they are final here, and nothing computed for them (predicates included) then
        # stays live across the branches of the IEEE square root and division below.
        if FMT == "fp32":
            tl.store(m_ptr + offs, m, mask=smask)
            tl.store(v_ptr + offs, v, mask=smask)
        else:
            # One random word per element rounds both moments (compact: top 16 bits m, low 16 bits v; 8bit: bits 0-5
            # m, bits 6-21 v; 4bit: bits 0-7 m, bits 8-23 v; the top 16 a bf16 parameter).
            bits_mv = uniform_bits(idx_golden, stream_key(tkey, ustep, STREAM_MV))
            if FMT == "compact":
                tl.store(m_ptr + offs, f32_to_bf16_bits_stochastic(m, bits_mv), mask=smask)
                tl.store(v_ptr + offs, f32_to_bf16_bits_stochastic(v, bits_mv << 16), mask=smask)
            elif FMT == "4bit":
                one = bmask.to(tl.uint32)[:, None]  # [2 * ROWS, 1], see quant_m
                cmv, sm, sv = quant_mv4(m, v, vmax, mask, bits_mv, one, vsc, beta2, EVEN)
                tl.store(mv_ptr + offs, cmv, mask=smask)
                tl.store(ms_ptr + srows, sm, mask=sbmask)
                tl.store(vs_ptr + srows, sv, mask=sbmask)
            else:
                # 1 for every row that is stored, a value the compiler cannot fold (see quant_m)
                one = bmask.to(tl.uint32)[:, None]
                cm, sm = quant_m(m, mask, bits_mv, one)
                cv, sv = quant_v(v, vmax, bits_mv, one, vsc, beta2)
                tl.store(mc_ptr + offs, cm, mask=smask)
                tl.store(vc_ptr + offs, cv, mask=smask)
                tl.store(ms_ptr + rows, sm, mask=sbmask)
                tl.store(vs_ptr + rows, sv, mask=sbmask)

        denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
        p = p * decay - tl.math.div_rn(m, denom) * step_size
        if P_DTYPE == tl.float32:
            if FMT == "4bit" and EVEN:
                # 33 fewer instructions per program (sm_90); the other formats keep the store their GPU timings used
                if SKIP_NONFINITE:
                    _store_f32_runs(p_ptr, p, rows, rest, ok_row != 0)
                else:
                    _store_f32_runs(p_ptr, p, rows, rest, rows >= 0)
            else:
                tl.store(p_ptr + offs, p, mask=smask)
        elif P_DTYPE == tl.bfloat16:
            if STOCHASTIC_PARAM and (FMT == "8bit" or FMT == "4bit"):
                bits_p = bits_mv
            elif STOCHASTIC_PARAM:
                bits_p = uniform_bits(idx_golden, stream_key(tkey, ustep, STREAM_P))
            if WORDS:
                if STOCHASTIC_PARAM:
                    pw = pack_bf16_hi(f32_to_bf16_hi_stochastic(p, bits_p))
                else:
                    pw = pack_bf16_hi(f32_to_bf16_hi_nearest(p))
                tl.store(_words(p_ptr, ALIGNED) + w2offs, pw, mask=w2smask)
            else:
                if STOCHASTIC_PARAM:
                    pb = f32_to_bf16_bits_stochastic(p, bits_p)
                else:
                    pb = f32_to_bf16_bits_nearest(p)
                tl.store(p_ptr + offs, pb, mask=smask)
        else:
            if STOCHASTIC_PARAM:
                bits_p = uniform_bits(idx_golden, stream_key(tkey, ustep, STREAM_P))
                ph = f32_to_f16_stochastic(p, bits_p)
            else:
                ph = p.to(tl.float16)
            tl.store(p_ptr + offs, ph, mask=smask)
        if SKIP_NONFINITE:
            # last: its branch and atomics then order nothing before them (loads would otherwise wait for it)
            # rows past the tensor's end count for nothing (with a NaN grad_scale their zeros become NaN)
            _count_skipped(nf_ptr, tidx_ptr, t, serial, tl.sum(((ok_row == 0) & (rows * QBLOCK < rest)).to(tl.int32)))
