"""tools/lm_results.steps_ratio on synthetic validation curves."""
import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "lm_results", os.path.join(os.path.dirname(__file__), "..", "tools", "lm_results.py"))
lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lm)

STEPS = [0, 100, 200, 300, 400]
LOSS = [5.0, 4.0, 3.0, 2.5, 2.0]


def test_interpolated_crossing():
    # 2.75 lies halfway between step 200 (3.0) and 300 (2.5): dense reaches it at 250
    r = lm.steps_ratio(STEPS, LOSS, 400, 2.75)
    assert r["dense_step"] == pytest.approx(250.0)
    assert r["ratio"] == pytest.approx(1.6)
    assert r["clamped"] is None


def test_dense_own_final_is_one():
    assert lm.steps_ratio(STEPS, LOSS, 400, 2.0)["ratio"] == pytest.approx(1.0)


def test_clamped_when_dense_never_reaches():
    r = lm.steps_ratio(STEPS, LOSS, 400, 1.5)
    assert r["clamped"] == "never" and r["ratio"] == pytest.approx(1.0)


def test_clamped_at_first_eval():
    r = lm.steps_ratio([60, 120], [4.0, 3.0], 240, 4.5)
    assert r["clamped"] == "first" and r["ratio"] == pytest.approx(4.0)


def test_first_crossing_wins_on_noisy_curve():
    # dense dips to 2.9 at 200, rises, then falls again: the first crossing counts
    r = lm.steps_ratio([0, 100, 200, 300, 400], [4.0, 3.2, 2.9, 3.1, 2.5], 400, 3.0)
    assert r["dense_step"] == pytest.approx(100 + 100 * (0.2 / 0.3))


def test_bad_input():
    with pytest.raises(ValueError, match="equal, non-empty"):
        lm.steps_ratio([0, 1], [1.0], 10, 1.0)
