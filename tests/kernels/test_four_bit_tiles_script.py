"""scripts/four_bit_tiles.py (version 1 and 2 of the 4-bit kernel timed in one process on a GPU): what it accepts and
refuses before any GPU work."""

import pytest

from ..scripts import load_script


def _load():
    return load_script("four_bit_tiles")


def test_variants_parse_tiles_and_caps():
    tiles = _load()
    assert tiles.parse_variants("1x1, 2x2@72,4x4@64,") == [(1, 1, None), (2, 2, 72), (4, 4, 64)]


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "none given"),
        ("3x1", "ROWSxWARPS"),
        ("1x16", "ROWSxWARPS"),
        ("1x1@300", "not a register count in 24..255"),
        ("1x1@abc", "not a register count"),
    ],
)
def test_bad_variants_are_refused_with_what_is_allowed(text, says):
    with pytest.raises(SystemExit, match=says):
        _load().parse_variants(text)


def test_a_v1_folder_without_version_1_kernels_is_refused(tmp_path):
    (tmp_path / "apexw_hf").mkdir()
    with pytest.raises(SystemExit, match="has no kernels/launch.py"):
        _load().load_v1(tmp_path)


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    tiles = _load()
    # round 2 is slow for version 2, round 3 for version 1: the rounds' ratios are 1.0, 1.2 and 0.917 (median 1.0),
    # while the ratio of the two medians is 1.1 / 1.0
    assert tiles.paired_ratio([1.0, 1.2, 1.1], [1.0, 1.0, 1.2]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="2 rounds against 3"):
        tiles.paired_ratio([1.0, 1.0], [1.0, 1.0, 1.0])
