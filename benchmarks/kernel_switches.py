"""The benchmark scripts' ``--no-gemv``, ``--gemv-max-rows`` and ``--no-overlap``: a kernel
feature off (or set otherwise) for the rest of the process, for a before/after in one run on
one machine. The engine has no option for them, each being its default wherever it can run."""

from __future__ import annotations


def projections_on_cublas() -> None:
    """Every projection on cuBLAS (the Triton GEMVs of nanofn/kernels/triton_gemv.py off)."""
    gemv_up_to(0)


def gemv_up_to(rows: int) -> None:
    """The projections of at most ``rows`` tokens on the GEMVs, the others on cuBLAS: the
    runner's kernel choice wrapped in ``with_gemv_max_rows``."""
    from nanofn.kernels.triton_ops import with_gemv_max_rows
    from nanofn.runner import model_runner

    choose_kernels = model_runner.choose_kernels
    model_runner.choose_kernels = lambda *args: with_gemv_max_rows(choose_kernels(*args), rows)


def launches_in_sequence() -> None:
    """No kernel launched overlapped with the one ahead (nanofn/kernels/triton_overlap.py)."""
    from nanofn.kernels import triton_overlap

    triton_overlap.overlaps = lambda device: False
