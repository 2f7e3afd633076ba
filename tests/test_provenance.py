"""The commit recorded with results: APEXW_COMMIT wins over git (a copied tree can carry stale history)."""

import re

from apexw_hf import provenance


def test_override_wins(monkeypatch):
    monkeypatch.setenv("APEXW_COMMIT", "a" * 40)
    monkeypatch.delenv("APEXW_DIRTY", raising=False)
    assert provenance.source_commit() == ("a" * 40, "unknown")
    monkeypatch.setenv("APEXW_DIRTY", "no")
    assert provenance.source_commit() == ("a" * 40, "no")


def test_from_git_or_nothing(monkeypatch):
    monkeypatch.delenv("APEXW_COMMIT", raising=False)
    commit, dirty = provenance.source_commit()
    if commit is None:  # an installed copy without git history
        assert dirty is None
    else:
        assert re.fullmatch(r"[0-9a-f]{40}", commit)
        assert dirty in (True, False, None)


def test_no_git(monkeypatch):
    monkeypatch.delenv("APEXW_COMMIT", raising=False)
    monkeypatch.setattr(provenance, "_git", lambda *args: None)
    assert provenance.source_commit() == (None, None)


def test_describe_source(monkeypatch):
    monkeypatch.setattr(provenance, "source_commit", lambda: ("b" * 40, True))
    assert provenance.describe_source() == "bbbbbbb (uncommitted changes)"
    monkeypatch.setattr(provenance, "source_commit", lambda: ("b" * 40, "unknown"))
    assert provenance.describe_source() == "bbbbbbb"
    monkeypatch.setattr(provenance, "source_commit", lambda: (None, None))
    assert provenance.describe_source() == "unknown commit"
