"""The Triton kernels a process compiles while a block of code runs.

A process compiles a kernel the first time it launches it in a new variant: other constexprs
(a tile picked by size), or integer arguments that Triton specializes (1, or divisible by 16)
falling otherwise. From Triton's disk cache that takes milliseconds; compiled afresh, seconds on
a GPU host, during which the GPU waits. A benchmark's measured run, or a server once it is
ready, should compile nothing: on an H100 the first Qwen3-30B-A3B standard workload on a fresh
machine spent ~2.9 s of its prefill steps compiling what its warm-up had not met
(benchmarks/RESULTS.md, thirty-third session).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from triton import knobs


@dataclass
class Compilations:
    """The kernels compiled (or loaded from Triton's disk cache), in order, and the seconds
    that took in all."""

    kernels: list[str] = field(default_factory=list)
    seconds: float = 0.0


@contextmanager
def counting_compilations() -> Iterator[Compilations]:
    """Yields a ``Compilations`` that gathers the kernels this process compiles until the block
    ends, through Triton's JIT hooks (hooks set before are still called, and set again after)."""
    found = Compilations()
    runtime = knobs.runtime
    earlier_start, earlier_end = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    started: list[float] = []

    def on_start(**hook_args: Any) -> Any:
        started.append(time.perf_counter())
        # (a true answer tells Triton to skip the compilation)
        return earlier_start(**hook_args) if earlier_start else None

    def on_end(**hook_args: Any) -> Any:
        found.seconds += time.perf_counter() - started.pop()
        found.kernels.append(hook_args["fn"].name)
        return earlier_end(**hook_args) if earlier_end else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_start, on_end
    try:
        yield found
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = earlier_start, earlier_end
