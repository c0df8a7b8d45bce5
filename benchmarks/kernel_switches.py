"""The benchmark scripts' ``--no-gemv``, ``--gemv-max-rows``, ``--no-partial-sums`` and
``--no-overlap``: a kernel
feature off (or set otherwise) for the rest of the process, for a before/after in one run on
one machine. The engine has no option for them, each being its default wherever it can run."""

from __future__ import annotations

import argparse
from dataclasses import fields


def add_model_and_switches(parser: argparse.ArgumentParser) -> None:
    """The scripts' shared arguments: the model (a folder, or ``--random-weights SHAPE``) and
    the kernel switches below."""
    parser.add_argument("model", nargs="?")
    parser.add_argument("--random-weights")
    parser.add_argument("--no-gemv", action="store_true",
                        help="every projection on cuBLAS (the Triton GEMVs off), for a before/after")
    parser.add_argument("--gemv-max-rows", type=int,
                        help="projections of at most this many tokens on the GEMVs, for a sweep")
    parser.add_argument("--no-partial-sums", action="store_true",
                        help="the GEMMs of nanofn/kernels/triton_gemm.py off (cuBLAS instead), for a "
                             "before/after")
    parser.add_argument("--no-overlap", action="store_true",
                        help="kernels launched one after another (programmatic dependent launch off)")


def model_with_switches(args: argparse.Namespace) -> str:
    """Apply the switches ``args`` asks for; returns the model's folder (a random-weight
    checkpoint is built once)."""
    from nanofn.model.tiny import random_weights_model
    from nanofn.kernels.triton_ops import with_triton_gemm_max_rows

    if args.no_gemv:
        projections_on_cublas()
    if args.gemv_max_rows is not None:
        gemv_up_to(args.gemv_max_rows)
    if args.no_partial_sums:
        _wrap_kernels(lambda kernels: with_triton_gemm_max_rows(kernels, 0))
    if args.no_overlap:
        launches_in_sequence()
    return str(args.model or random_weights_model(args.random_weights))


def load_options(args: argparse.Namespace) -> dict[str, str]:
    """``LLM`` options for the model ``model_with_switches`` gives: random weights (a preset's
    config alone) are made on the device."""
    return {} if args.model else {"load_format": "dummy"}


def llm_options(extra: list[str]) -> dict:
    """``--key=value`` arguments as LLM options (ints, floats and true/false understood), e.g.
    ``--quantization=fp8 --kv-cache-dtype=fp8``; any other argument is an error."""
    from nanofn.engine.options import EngineOptions

    known = {f.name for f in fields(EngineOptions)}
    options = {}
    for arg in extra:
        key, sep, value = arg.removeprefix("--").partition("=")
        key = key.replace("-", "_")
        if not arg.startswith("--") or not sep or key not in known:
            raise SystemExit(f"{arg!r} is not --OPTION=VALUE with an LLM option")
        options[key] = _parsed(value)
    return options


def _parsed(value: str) -> int | float | bool | str:
    for parse in (int, float, {"true": True, "false": False}.__getitem__):
        try:
            return parse(value)
        except (ValueError, KeyError):
            continue
    return value


def projections_on_cublas() -> None:
    """Every projection on cuBLAS (the Triton GEMVs of nanofn/kernels/triton_gemv.py off)."""
    gemv_up_to(0)


def gemv_up_to(rows: int) -> None:
    """The projections of at most ``rows`` tokens on the GEMVs, the others on cuBLAS: the
    runner's kernel choice wrapped in ``with_gemv_max_rows``."""
    from nanofn.kernels.triton_ops import with_gemv_max_rows

    _wrap_kernels(lambda kernels: with_gemv_max_rows(kernels, rows))


def _wrap_kernels(wrap) -> None:
    """The runner's kernel choice, then ``wrap`` applied to it."""
    from nanofn.runner import model_runner

    choose_kernels = model_runner.choose_kernels
    model_runner.choose_kernels = lambda *args: wrap(choose_kernels(*args))


def launches_in_sequence() -> None:
    """No kernel launched overlapped with the one ahead (nanofn/kernels/triton_overlap.py)."""
    from nanofn.kernels import triton_overlap

    triton_overlap.overlaps = lambda device: False
