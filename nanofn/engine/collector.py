"""The cyclic garbage collector's setting while an engine steps."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator


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


def freeze_while_alive(owner: object) -> Callable[[], None]:
    """Move every object alive now out of the cyclic collector's way while ``owner`` lives;
    return the function that gives them back (called at the latest when ``owner`` is
    collected or the interpreter exits).

    Frozen objects are skipped even by the collection at interpreter exit, so objects of
    extension modules that sit in reference cycles outlive their modules: nanobind's (triton
    3.9 and later, which transformers' model classes import through torch._dynamo) then
    print "nanobind: leaked ... instances" at the exit of every run.
    """
    gc.collect()
    gc.freeze()
    return weakref.finalize(owner, gc.unfreeze)
