"""``--no-gemv`` of the benchmark scripts: every projection on cuBLAS, for a before/after of the
Triton GEMVs (nanofn/kernels/triton_gemv.py) in one run on one machine."""

from __future__ import annotations


def projections_on_cublas() -> None:
    """Wrap the runner's kernel choice in ``without_gemv``, for the rest of this process: the
    engine has no option for it, the GEMVs being its default wherever Triton runs."""
    from nanofn.kernels.triton_ops import without_gemv
    from nanofn.runner import model_runner

    choose_kernels = model_runner.choose_kernels
    model_runner.choose_kernels = lambda *args: without_gemv(choose_kernels(*args))
