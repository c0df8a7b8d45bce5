"""Running Triton kernels on CPU, through Triton's interpreter, from a pytest session; and
compiling them for an H100 on CPU, which the interpreter does not do.

``@triton.jit`` (Triton's own ``tl.sum`` and ``tl.zeros`` included) picks interpreter or compiler
from TRITON_INTERPRET when triton is first imported, and in a test session transformers imports
it long before any test module. So the kernels run in a spawned child process that starts with
the variable set, while the references run in the test process. A child that crashes (say, on a
write out of bounds) fails the test at once instead of hanging it.

The interpreter computes bf16 ``tl.dot`` wrongly: test in float32 and float16 here. Nor does it
type-check a kernel (a loop-carried variable that changes dtype runs there and fails to compile
on the GPU), so ``compiler_process`` runs the same host functions in a child whose launches
compile their kernels for SM 9.0, down to a cubin (Triton ships ptxas), and launch nothing.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any
from unittest import mock

import torch
import triton.runtime.interpreter


@contextlib.contextmanager
def interpreter_process() -> Iterator[Callable[..., Any]]:
    """Yields ``run(function, *args, **kwargs)``, which calls a picklable ``function`` in a child
    process whose Triton kernels run in the interpreter and returns its result."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=prepare_interpreter_process) as executor:
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            executor.submit(int).result()  # the first task starts the child, inheriting the variable
        yield lambda function, *args, **kwargs: executor.submit(function, *args, **kwargs).result(timeout=120)


@contextlib.contextmanager
def compiler_process() -> Iterator[Callable[..., Any]]:
    """Yields ``run(function, *args, **kwargs)``, which calls a picklable ``function`` (CPU tensors
    in, as in the interpreter) in a child process where each kernel launch compiles its kernel
    for an H100 instead, with overlapped launches on; an error in compiling fails the call."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=prepare_compiler_process) as executor:
        yield lambda function, *args, **kwargs: executor.submit(function, *args, **kwargs).result(timeout=300)


class _H100Target:
    """The part of Triton's active driver that compiling for a device reads."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def prepare_compiler_process() -> None:
    """Set up the compiler child: launches compile (``warmup``) for SM 9.0, overlap on."""
    from triton.runtime.jit import JITFunction

    from nanofn.kernels import triton_overlap

    torch.set_num_threads(1)
    triton.runtime.driver.set_active(_H100Target())
    JITFunction.__getitem__ = lambda self, grid: functools.partial(self.run, grid=grid, warmup=True)
    triton_overlap.overlaps = lambda device: True


def prepare_interpreter_process() -> None:
    """Set up the interpreter child: one thread, a fix for numpy 2.4, NaN-filled allocations."""
    torch.set_num_threads(1)

    # Triton 3.6's interpreter turns a loop bound read from memory into an int by calling ``int()``
    # on a one-element array, which numpy 2.4 refuses (triton-lang/triton#9171): use ``.item()``.
    patch_lang_tensor = triton.runtime.interpreter._patch_lang_tensor

    def patch_with_item_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    triton.runtime.interpreter._patch_lang_tensor = patch_with_item_index

    # Every float tensor the kernels' host code allocates starts as NaN: an unwritten output fails.
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    torch.empty = nan_empty
