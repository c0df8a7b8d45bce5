"""The property suite's profiles scale every test's examples (and coverage floors)."""

from __future__ import annotations

import pytest

from properties.profile import coverage_floor, examples, steps


def test_profiles_scale_examples_and_steps(monkeypatch):
    monkeypatch.delenv("NANOFN_HYPOTHESIS", raising=False)
    assert (examples(300), steps(40), coverage_floor(50)) == (300, 40, 50)
    monkeypatch.setenv("NANOFN_HYPOTHESIS", "long")
    assert (examples(300), steps(40), coverage_floor(50)) == (3000, 80, 500)
    monkeypatch.setenv("NANOFN_HYPOTHESIS", "quick")
    assert examples(300) == 30 and examples(2) == 1 and coverage_floor(50) == 0
    monkeypatch.setenv("NANOFN_HYPOTHESIS", "longer")
    with pytest.raises(ValueError, match="NANOFN_HYPOTHESIS='longer'"):
        examples(300)
