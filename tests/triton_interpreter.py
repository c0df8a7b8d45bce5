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


@contextlib.contextmanager
def variant_recorder_process() -> Iterator[Callable[..., Any]]:
    """Yields ``run(function, *args, **kwargs)``, which calls a picklable ``function`` in a child
    where a kernel launch neither compiles nor runs: it adds the variant it would compile (the
    kernel's name and Triton's specialization key for an H100) to ``recorded_variants()``.
    Outputs stay as allocated, so the host code between launches must not read them; the one
    place a model does (the experts' ids, which pick the sorting's scatter indices) is filled
    with valid ids. The projections left to cuBLAS (``F.linear``, ``torch._scaled_mm``) only
    allocate their outputs too: at a large model's shapes a CPU would take minutes a step."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context,
                             initializer=prepare_recorder_process) as executor:
        yield lambda function, *args, **kwargs: executor.submit(
            function, *args, **kwargs).result(timeout=600)


_VARIANTS: set[tuple[str, str]] = set()


def recorded_variants() -> set[tuple[str, str]]:
    """In the recorder child: the variants its launches have met so far."""
    return set(_VARIANTS)


def prepare_recorder_process() -> None:
    """Set up the recorder child (see ``variant_recorder_process``)."""
    import dataclasses

    from triton.runtime.jit import JITFunction, compute_cache_key

    from nanofn.kernels import triton_moe, triton_ops

    prepare_compiler_process()

    def record(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", self.debug)
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        _, key_cache, _, _, binder = self.device_caches[0]
        _, specialization, options = binder(*args, **kwargs)
        _VARIANTS.add((self.fn.__name__, compute_cache_key(key_cache, specialization, options)))

    JITFunction.run = record
    torch.nn.functional.linear = lambda x, weight, bias=None: x.new_empty(
        *x.shape[:-1], weight.shape[0])
    torch._scaled_mm = lambda a, b, *args, out_dtype=None, **kwargs: a.new_empty(
        a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)
    JITFunction.__getitem__ = lambda self, grid: functools.partial(self.run, grid=grid, warmup=False)

    def select_valid_experts(logits, top_k, *args, **kwargs):
        weights, ids = triton_moe.select_experts(logits, top_k, *args, **kwargs)
        return weights, ids.random_(0, logits.shape[-1])

    triton_ops.TRITON_KERNELS = dataclasses.replace(triton_ops.TRITON_KERNELS,
                                                    select_experts=select_valid_experts)
