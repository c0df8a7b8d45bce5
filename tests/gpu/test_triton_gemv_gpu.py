"""The Triton GEMVs against torch on a CUDA GPU, in bf16 at Qwen3-0.6B's projection shapes, and the
engine's tokens with the GEMVs on and off (float32, greedy).

Errors are ``|out - ref| / |ref|`` over the whole output, the reference in float32 on the upcast
bf16 inputs; cuBLAS's bf16 result is held to the same bound. ``benchmark()`` prints device
times of cuBLAS and the GEMVs from CUDA graphs, asserting nothing; ``python3 THIS --sweep`` also
times a grid of launch configs (``--fp8``: of the FP8 GEMVs, on per-channel weights).
"""

from __future__ import annotations

import itertools
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch
import torch.nn.functional as F
import triton.testing

import nanofn.kernels.triton_fp8 as triton_fp8
import nanofn.kernels.triton_gemv as triton_gemv
import nanofn.kernels.triton_ops as triton_ops
from nanofn.kernels import linear, rms_norm_linear
from nanofn.kernels.fp8 import Fp8Weight, quantize_groups
from nanofn.kernels.triton_gemv import GemvConfig
from test_triton_ops_gpu import norm_weight, randn  # (this folder; bf16 inputs as here)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, INTERMEDIATE, EPS, VOCAB = 1024, 3072, 1e-6, 151936
DTYPE = torch.bfloat16
# name: (N, K) of each projection's weight
SHAPES = {"qkv": (4096, HIDDEN), "o_proj": (HIDDEN, 2048), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE)}
ROWS = [1, 2, 4, 8]
TOLERANCE = 1e-2  # relative, bf16 operands
L2_BYTES = 50 << 20  # the H100's L2: the benchmark cycles through more weight than this


def relative_error(out, expected):
    assert out.dtype == DTYPE and out.shape == expected.shape
    return ((out.float() - expected).norm() / expected.norm()).item()


def upcast(*tensors):
    return [t.float() if t is not None else None for t in tensors]


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name", SHAPES)
def test_gemv_matches_torch(name, rows):
    n, k = SHAPES[name]
    x, weight, bias = randn(rows, k, seed=rows), randn(n, k, seed=n, scale=0.03), randn(n, seed=1)

    out = triton_gemv.gemv(x, weight, bias)

    expected = linear(*upcast(x, weight, bias))
    assert relative_error(out, expected) < TOLERANCE
    assert relative_error(F.linear(x, weight, bias), expected) < TOLERANCE  # the bound holds cuBLAS


@pytest.mark.usefixtures("nan_filled_allocations")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name, gated", [("qkv", False), ("gate_up", False), ("gate_up", True)],
                         ids=["qkv", "gate_up", "gate_up-gated"])
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "add-and-norm"])
def test_rms_norm_gemv_matches_torch(name, gated, rows, add_residual):
    """Gated: the output is ``silu(gate) * up`` of the product."""
    n, k = SHAPES[name]
    x, weight = randn(rows, k, seed=rows, scale=3.0), randn(n, k, seed=3, scale=0.03)
    residual = randn(rows, k, seed=4) if add_residual else None
    scale = norm_weight(k, seed=5)

    out, summed = triton_gemv.rms_norm_gemv(x, scale, EPS, residual, weight, gated=gated)

    unfused, expected_summed = triton_ops.rms_norm_linear(  # the norm kernel, cuBLAS, SiLU kernel
        x, scale, EPS, residual, weight, gated=gated, gemv_max_rows=0, triton_gemm_max_rows=0)
    assert torch.equal(summed, expected_summed)
    expected, _ = rms_norm_linear(*upcast(x, scale), EPS, *upcast(residual, weight), gated=gated)
    assert relative_error(out, expected) < TOLERANCE
    assert relative_error(unfused, expected) < TOLERANCE


def test_gemvs_replay_from_a_cuda_graph():
    n, k = SHAPES["qkv"]
    x, residual, weight = randn(2, k, seed=6), randn(2, k, seed=7), randn(n, k, seed=8, scale=0.03)
    scale = norm_weight(k, seed=9)

    def run():
        return (triton_gemv.gemv(x, weight),
                *triton_gemv.rms_norm_gemv(x, scale, EPS, residual, weight, gated=True),
                *triton_gemv.rms_norm_gemv(x, scale, EPS, residual, weight))

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for tensor, seed in ((x, 12), (residual, 13)):
        tensor.copy_(randn(*tensor.shape, seed=seed))
    graph.replay()

    for out, expected in zip(outs, run()):  # eager, on the new inputs
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.fixture(scope="module")
def float32_prompts(tiny_qwen3):
    g = torch.Generator().manual_seed(3)
    return tiny_qwen3, [torch.randint(3, 380, (n,), generator=g).tolist() for n in (2, 33, 70, 11, 50)]


def greedy_outputs(model_dir, prompts, logprobs: int | None = None, **options) -> list[list]:
    """The greedy float32 outputs of one sequence at a time (graph of 1), then of two (graph of
    2), four (graph of 4) and five (graph of 8) together: GEMVs up to ``GEMV_MAX_ROWS``
    sequences, cuBLAS beyond (``logprobs``: the top tokens' a position; ``options``: more of
    ``LLM``'s, e.g. ``quantization``)."""
    from nanofn import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)
    with LLM(str(model_dir), dtype="float32", gpu_memory_utilization=0.3, max_model_len=512,
             max_num_seqs=8, **options) as llm:
        batches = [[p] for p in prompts[:3]] + [prompts[:2], prompts[:4], prompts]
        outs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                for batch in batches]
        return [[o.outputs[0] for o in out] for out in outs]


def greedy_batches(model_dir, prompts, **options) -> list[list[list[int]]]:
    """``greedy_outputs``' tokens."""
    return [[o.token_ids for o in batch] for batch in greedy_outputs(model_dir, prompts, **options)]


def test_engine_tokens_are_the_same_with_the_gemvs_on_and_off(float32_prompts, monkeypatch):
    """Greedy float32 decoding of one sequence (graph of 1), of two (graph of 2), of four
    (graph of 4) and of five (graph of 8, cuBLAS either way) gives the same tokens with the
    projections on the GEMVs (the default, up to GEMV_MAX_ROWS tokens) as with them all on
    cuBLAS."""
    from nanofn.runner import model_runner

    launches = []
    launch = triton_gemv._launch
    monkeypatch.setattr(triton_gemv, "_launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    with_gemvs = greedy_batches(*float32_prompts)
    assert launches
    choose_kernels = model_runner.choose_kernels
    monkeypatch.setattr(model_runner, "choose_kernels",
                        lambda *a, **kw: triton_ops.without_gemv(choose_kernels(*a, **kw)))
    launches.clear()
    assert greedy_batches(*float32_prompts) == with_gemvs
    assert not launches


# ---------------------------------------------------------------------------------------------
# Benchmark


def _weights(n, k, seed, fp8: bool = False):
    """Copies of a random ``[n, k]`` weight filling twice the L2, so that every call in a timed
    graph reads its weight from device memory, as a model's layers do (``fp8``: quantized per
    channel, as ``quantization="fp8"`` does at load)."""
    copies = max(1, -(-2 * L2_BYTES // (n * k * (1 if fp8 else 2))))
    weight = randn(n, k, seed=seed, scale=0.03)
    if fp8:
        return [Fp8Weight(*quantize_groups(weight, k), k) for _ in range(copies)]
    return [weight.clone() for _ in range(copies)]


def _graph_us(call, weights, rep_ms: int = 10) -> float:
    """Median device microseconds of ``call(weight)`` per call, replayed from a CUDA graph that
    cycles through ``weights``."""
    cycle = itertools.cycle(weights)
    return triton.testing.do_bench_cudagraph(lambda: call(next(cycle)), rep=rep_ms,
                                             return_mode="median") * 1e3


def benchmark() -> None:
    """cuBLAS against the GEMVs at the four projections, then the fused GEMVs against the
    unfused pair (Triton's small kernel, then cuBLAS or the GEMV), and the LM head."""
    print("| projection | N x K | rows | cuBLAS us | GEMV us | GEMV GB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weights = _weights(n, k, seed=0)
        for rows in ROWS:
            x = randn(rows, k, seed=rows)
            cublas = _graph_us(lambda w: F.linear(x, w), weights)
            gemv = _graph_us(lambda w: triton_gemv.gemv(x, w), weights)
            print(f"| {name} | {n} x {k} | {rows} | {cublas:.2f} | {gemv:.2f} | "
                  f"{n * k * 2 / gemv / 1e3:,.0f} | {cublas / gemv:.2f}x |")
    print("\n| fused | rows | small kernels + cuBLAS us | small kernels + GEMV us | fused GEMV us |")
    print("|---|---|---|---|---|")
    for name, gated in (("qkv", False), ("gate_up", False), ("gate_up", True)):
        n, k = SHAPES[name]
        weights, scale = _weights(n, k, seed=2), norm_weight(k, seed=3)
        activate = triton_ops.silu_and_mul if gated else (lambda out: out)
        for rows in ROWS:
            x, residual = randn(rows, k, seed=rows), randn(rows, k, seed=rows + 1)

            def unfused(w, project):
                normed, _ = triton_ops.rms_norm(x, scale, EPS, residual)
                return activate(project(normed, w))

            times = [_graph_us(lambda w: unfused(w, F.linear), weights),
                     _graph_us(lambda w: unfused(w, triton_gemv.gemv), weights),
                     _graph_us(lambda w: triton_gemv.rms_norm_gemv(x, scale, EPS, residual, w,
                                                                   gated=gated), weights)]
            label = f"residual + rms_norm + {name}" + (" + silu_and_mul" if gated else "")
            print(f"| {label} | {rows} | " + " | ".join(f"{t:.2f}" for t in times) + " |")
    weights = [randn(VOCAB, HIDDEN, seed=4, scale=0.03)]  # 311 MB: no copies needed
    for rows in ROWS:
        x = randn(rows, HIDDEN, seed=5)
        cublas = _graph_us(lambda w: F.linear(x, w), weights)
        gemv = _graph_us(lambda w: triton_gemv.gemv(x, w), weights)
        print(f"LM head {VOCAB} x {HIDDEN}, {rows} rows: cuBLAS {cublas:.1f} us, GEMV {gemv:.1f} "
              f"us ({VOCAB * HIDDEN * 2 / gemv / 1e3:,.0f} GB/s), {cublas / gemv:.2f}x")


SWEEP_ROWS = [1]
GATED = "gated"  # a norm before the projection and the activation after it
# (label, prologue, weight shape) of each swept kernel
SWEEP_KERNELS = [*((name, triton_gemv.PLAIN, shape) for name, shape in SHAPES.items()),
                 *((f"residual + rms_norm + {name}", triton_gemv.NORM, SHAPES[name])
                   for name in ("qkv", "gate_up")),
                 ("residual + rms_norm + gate_up + silu_and_mul", GATED, SHAPES["gate_up"])]
# ``--sweep --moe``: Qwen3-30B-A3B's attention projections and router instead (hidden 2,048)
MOE_SWEEP_KERNELS = [("residual + rms_norm + qkv", triton_gemv.NORM, (5120, 2048)),
                     ("o_proj", triton_gemv.PLAIN, (2048, 4096)),
                     ("residual + rms_norm + router", triton_gemv.NORM, (128, 2048)),
                     ("router", triton_gemv.PLAIN, (128, 2048))]


def _sweep_configs(k: int, prologue: int) -> list[GemvConfig]:
    """1-16 outputs a program, 4 or 8 warps, all of K in one step (up to 4,096 columns) or, but
    with a norm, 1,024 columns a step."""
    norm = prologue in (triton_gemv.NORM, GATED)
    whole = min(triton.next_power_of_2(k), k if norm else 4096)
    block_ks = sorted({whole} if norm else {whole, min(whole, 1024)})
    return [GemvConfig(n, b, w) for b in block_ks for n in (1, 2, 4, 8, 16) for w in (4, 8)]


def _call(prologue: int, rows: int, n: int, k: int, fp8: bool = False):
    """``call(weight, config)`` running the kernel of ``prologue`` on random inputs of ``rows``
    (``fp8``: the FP8 one, on an ``Fp8Weight``)."""
    x = randn(rows, k, seed=rows)
    if prologue in (triton_gemv.NORM, GATED):
        residual, scale = randn(rows, k, seed=rows + 1), norm_weight(k, seed=3)
        if fp8:
            return lambda w, c: triton_fp8.fp8_rms_norm_gemv(x, scale, EPS, residual, w,
                                                             gated=prologue == GATED, config=c)
        return lambda w, c: triton_gemv.rms_norm_gemv(x, scale, EPS, residual, w, config=c,
                                                      gated=prologue == GATED)
    if fp8:
        return lambda w, c: triton_fp8.fp8_gemv(x, w, config=c)
    return lambda w, c: triton_gemv.gemv(x, w, config=c)


def _compile(cases) -> None:
    """Run each ``(prologue, rows, n, k, config, fp8)`` once, filling Triton's on-disk cache
    (in a worker process)."""
    for prologue, rows, n, k, config, fp8 in cases:
        _call(prologue, rows, n, k, fp8)(_weights(n, k, 1, fp8)[0], config)
    torch.cuda.synchronize()


def sweep(kernels=SWEEP_KERNELS, workers: int = 12, fp8: bool = False) -> None:
    """Time every config of ``_sweep_configs`` for each of ``kernels`` and row count of
    ``SWEEP_ROWS``; print the best three of each next to ``gemv_config``'s choice. The kernels
    compile first in ``workers`` processes at once."""
    cases = list({(prologue, rows, n, k, config, fp8): (prologue, rows, n, k, config, fp8)
                  for _, prologue, (n, k) in kernels for rows in SWEEP_ROWS
                  for config in _sweep_configs(k, prologue)}.values())
    context = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        list(pool.map(_compile, [cases[i::workers] for i in range(workers)]))
    print("\n| kernel | rows | default config: us | best configs: us |")
    print("|---|---|---|---|")
    for name, prologue, (n, k) in kernels:
        weights = _weights(n, k, seed=0, fp8=fp8)
        for rows in SWEEP_ROWS:
            call = _call(prologue, rows, n, k, fp8)
            timed = sorted((_graph_us(lambda w: call(w, c), weights, 5), c)
                           for c in _sweep_configs(k, prologue))
            configure = triton_fp8.fp8_gemv_config if fp8 else triton_gemv.gemv_config
            default = (configure(n // 2, k, rows, triton_gemv.NORM, gated=True)
                       if prologue == GATED else configure(n, k, rows, prologue))
            default_us = _graph_us(lambda w: call(w, None), weights)
            best = ", ".join(f"{tuple(c)}: {t:.2f}" for t, c in timed[:3])
            print(f"| {name} | {rows} | {tuple(default)}: {default_us:.2f} | {best} |")


if __name__ == "__main__":
    if "--moe" not in sys.argv and "--fp8" not in sys.argv:
        benchmark()
    if "--sweep" in sys.argv:
        sweep(MOE_SWEEP_KERNELS if "--moe" in sys.argv else SWEEP_KERNELS,
              fp8="--fp8" in sys.argv)
