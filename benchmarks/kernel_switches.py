"""The benchmark scripts' ``--no-gemv`` and ``--no-overlap``: a kernel feature off for the rest
of the process, for a before/after in one run on one machine. The engine has no option for
them, each being its default wherever it can run."""

from __future__ import annotations


def projections_on_cublas() -> None:
    """Every projection on cuBLAS (the Triton GEMVs of nanofn/kernels/triton_gemv.py off):
    the runner's kernel choice wrapped in ``without_gemv``."""
    from nanofn.kernels.triton_ops import without_gemv
    from nanofn.runner import model_runner

    choose_kernels = model_runner.choose_kernels
    model_runner.choose_kernels = lambda *args: without_gemv(choose_kernels(*args))


def launches_in_sequence() -> None:
    """No kernel launched overlapped with the one ahead (nanofn/kernels/triton_overlap.py)."""
    from nanofn.kernels import triton_overlap

    triton_overlap.overlaps = lambda device: False
