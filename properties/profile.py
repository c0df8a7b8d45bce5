"""How hard the property suite tries: ``NANOFN_HYPOTHESIS=quick|default|long`` (default:
``default``, the counts CI runs). Each test names its default number of examples; a profile
scales it, and the state machine's steps per example with it (``long``: ten times the
examples and twice the steps, some 10**5 checked steps for the state machine)."""

from __future__ import annotations

import os

PROFILES = {"quick": (0.1, 1), "default": (1, 1), "long": (10, 2)}


def _profile() -> tuple[float, int]:
    name = os.environ.get("NANOFN_HYPOTHESIS") or "default"
    if name not in PROFILES:
        raise ValueError(f"NANOFN_HYPOTHESIS={name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[name]


def examples(default: int) -> int:
    """The number of examples for a test that runs ``default`` of them by default."""
    return max(1, round(default * _profile()[0]))


def steps(default: int) -> int:
    """The state machine's steps per example."""
    return default * _profile()[1]


def coverage_floor(default: int) -> int:
    """How often a test must have met what one of its properties checks, for a count that
    its default examples reach several times over: ``default``, scaled like the examples, and
    no floor under ``quick`` (too few examples to count on any)."""
    scale = _profile()[0]
    return round(default * scale) if scale >= 1 else 0
