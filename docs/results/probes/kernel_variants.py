"""Probe variants of the AdamW kernel, for measuring what limits it: NOT shippable numerics.

Each variant is the shipped kernel source (``apexw_hf/engines/triton/kernels/adamw.py``) with a few expressions
replaced and its relative imports made absolute, written to ``<tmp>/apexw_kernel_variants/_variant_<name>.py`` (Triton
reads a kernel's source from its file) and imported from there. ``docs/results/probes/sass_count.py --variant`` counts
its instructions on the CPU; ``docs/results/probes/issue_probe.py`` times it on a GPU through the normal launch plan.

Variants:
    shipped      the kernel as it is.
    rev:<REV>    the kernel of a git revision (``git show REV:apexw_hf/...``: the kernels package and the random
                 streams it imports, written to ``<tmp>/apexw_kernel_variants/apexw_rev_<commit>/``), for before/after
                 counts.
    approx_math  the update's IEEE square root and division replaced by the approximate hardware ones (tl.sqrt,
                 ``/``): the cost of correct rounding, including the per-element slow-path branches ptxas emits.
    plain_store  fp32 parameters of 4-bit launches stored as the other formats store them (one ``tl.store`` of the
                 tile; the compiler shuffles it into 512-byte runs per instruction) instead of ``_store_f32_runs``
                 (32 consecutive bytes per thread, two 16-byte stores): same bits, another memory access pattern.
    runs_store   the other way round: 8-bit launches with fp32 parameters store them with ``_store_f32_runs``.
    row_scale4   4-bit block scales reduced over whole 256-element rows (one full-warp reduction per moment, the
                 8-bit kernel's) and used for both 128-element halves: WRONG numerics, timing only: the cost of the
                 two half-warp reductions per moment.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "apexw_hf" / "engines" / "triton" / "kernels"

VARIANTS: dict[str, list[tuple[str, str]]] = {
    "shipped": [],
    "approx_math": [
        ("denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps", "denom = tl.sqrt(v) * inv_bc2_sqrt + eps"),
        ("tl.math.div_rn(m, denom)", "(m / denom)"),
    ],
    "plain_store": [('if FMT == "4bit" and EVEN:', "if False:")],
    "runs_store": [('if FMT == "4bit" and EVEN:', 'if (FMT == "4bit" or FMT == "8bit") and EVEN:')],
    "row_scale4": [],
}
# Replacements in kernels/_quant.py (the variant's adamw module then imports its own copy of _quant).
QUANT_VARIANTS: dict[str, list[tuple[str, str]]] = {
    "row_scale4": [
        (
            "    msb, minv = block_scale(a, mask, not EVEN)\n    vsb, vinv = block_scale(v, mask, not EVEN)",
            "    msb, minv = _probe_row_scale(a, mask, not EVEN)\n    vsb, vinv = _probe_row_scale(v, mask, not EVEN)",
        )
    ],
}
_PROBE_ROW_SCALE = """

@triton.jit
def _probe_row_scale(a, mask, MASKED: tl.constexpr):
    R2: tl.constexpr = a.shape[0]
    s, inv = block_scale(tl.reshape(a, (R2 // 2, 256)), tl.reshape(mask, (R2 // 2, 256)), MASKED)
    return tl.reshape(tl.join(s, s), (R2,)), tl.reshape(tl.join(inv, inv), (R2,))
"""


def load_revision(rev: str):
    """The ``_adamw_kernel`` of git revision ``rev`` of this repository."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    pkg = f"apexw_rev_{commit[:12]}"
    folder = Path(tempfile.gettempdir()) / "apexw_kernel_variants"
    (folder / pkg / "kernels").mkdir(parents=True, exist_ok=True)
    (folder / pkg / "__init__.py").write_text("")
    (folder / pkg / "_random.py").write_text(git("show", f"{commit}:apexw_hf/_random.py"))
    try:  # the kernels' folder since issue 28, else the one before
        where = "apexw_hf/engines/triton/kernels"
        names = git("ls-tree", "--name-only", f"{commit}:{where}").split()
    except subprocess.CalledProcessError:
        where = "apexw_hf/kernels"
        names = git("ls-tree", "--name-only", f"{commit}:{where}").split()
    for path in names:
        if path.endswith(".py"):
            src = git("show", f"{commit}:{where}/{path}").replace("from ....", "from ..")  # _random, one level up
            (folder / pkg / "kernels" / path).write_text(src)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    return importlib.import_module(f"{pkg}.kernels.adamw")._adamw_kernel


def load(name: str):
    """The ``_adamw_kernel`` of variant ``name`` (the shipped one for ``shipped``, a git revision's for
    ``rev:<REV>``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if name.startswith("rev:"):
        return load_revision(name[4:])
    if name == "shipped":
        from apexw_hf.engines.triton.kernels.adamw import _adamw_kernel

        return _adamw_kernel
    src = _replaced(KERNELS / "adamw.py", VARIANTS[name], name)
    folder = Path(tempfile.gettempdir()) / "apexw_kernel_variants"
    folder.mkdir(exist_ok=True)
    if name in QUANT_VARIANTS:
        qsrc = _replaced(KERNELS / "_quant.py", QUANT_VARIANTS[name], name) + _PROBE_ROW_SCALE
        qpath = folder / f"_variant_{name}_quant.py"
        if not qpath.exists() or qpath.read_text() != qsrc:
            qpath.write_text(qsrc)
        src = src.replace("from apexw_hf.engines.triton.kernels._quant import", f"from _variant_{name}_quant import")
    path = folder / f"_variant_{name}.py"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    return importlib.import_module(f"_variant_{name}")._adamw_kernel


def _replaced(path: Path, replacements, name: str) -> str:
    """The source of ``path`` with ``replacements`` made (each must occur once), imported from outside the package."""
    src = path.read_text()
    for old, new in replacements:
        if src.count(old) != 1:
            raise RuntimeError(f"variant {name!r}: {old!r} occurs {src.count(old)} times in {path.name}")
        src = src.replace(old, new)
    # the variant is imported from outside the package
    return src.replace("from ._", "from apexw_hf.engines.triton.kernels._")
