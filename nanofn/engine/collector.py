"""The cyclic garbage collector's setting while an engine steps."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def fewer_gc_pauses() -> Iterator[None]:
    """The pure core makes many small immutable objects per step; with Python's default
    threshold (700) the cyclic collector runs several times a step and doubles the core's
    cost. Collect less often while generating, and restore the setting afterwards."""
    previous = gc.get_threshold()
    gc.set_threshold(20_000, *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
