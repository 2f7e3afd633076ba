"""Which code produced a result: the source tree's git commit, for the records that benchmarks and runs store.

A copied tree may carry no git history, or stale history (a GPU host's copy of the working tree was seen to report an
older commit than its files), so the caller's ``APEXW_COMMIT`` always wins, with ``APEXW_DIRTY`` saying whether the
tree had uncommitted changes ("unknown" when not given).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_commit() -> tuple[str | None, bool | str | None]:
    """``(commit, dirty)`` of the source tree: the full hash and whether tracked files differ from it.

    ``APEXW_COMMIT`` (and ``APEXW_DIRTY``, default ``"unknown"``) override git; without either, ``(None, None)``.
    """
    if os.environ.get("APEXW_COMMIT"):
        return os.environ["APEXW_COMMIT"], os.environ.get("APEXW_DIRTY", "unknown")
    commit = _git("rev-parse", "HEAD")
    if not commit or len(commit) != 40:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, None if status is None else bool(status)


def describe_source() -> str:
    """:func:`source_commit` for a line of text: the short hash, marked where tracked files had changed, or
    ``"unknown commit"``."""
    commit, dirty = source_commit()
    if commit is None:
        return "unknown commit"
    return f"{commit[:7]}{' (uncommitted changes)' if dirty is True else ''}"
