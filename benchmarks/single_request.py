"""Decode speed of one request alone: a 512-token prompt, 512 new tokens (ignore_eos).

Usage: python benchmarks/single_request.py (MODEL | --random-weights qwen3-0.6b) [--json PATH]
       [--trace DIR] [LLM options as --key=value, e.g. --enforce-eager=true --kernel-backend=torch]

Times generates of 1 token (the prefill; the median of 5, each on a prompt of its own) and one
of 513 tokens on another prompt of the same length; decode tok/s = 512 / (its time - the
prefill's). --trace profiles one more prefill with
torch.profiler: DIR gets its operator tables (host and device time) and a Chrome trace. The
floor is shared/tools/roofline.py's single-request figure (every decode step reads all weights
and the request's own K/V) at the rates of the device it runs on (``KNOWN_DEVICE_RATES``), or
of an H100 where they are not known. (Before 2026-11-29 it was the H100's on every device:
the figures measured on H200s until then are fractions of the H100's floor.)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from nanofn import LLM, SamplingParams
from nanofn.cli.bench import (DEFAULT_BANDWIDTH_GBPS, DEFAULT_TFLOPS, ModelDims,
                              bench_data_types, device_rates, floor)

from kernel_switches import (add_model_and_switches, llm_options,  # (benchmarks/)
                             load_options, model_with_switches)

PROMPT_LEN, NEW_TOKENS, PREFILL_REPEATS = 512, 512, 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_and_switches(ap)
    ap.add_argument("--json")
    ap.add_argument("--trace", help="a folder for a torch.profiler record of one more prefill")
    args, extra = ap.parse_known_args()
    options = {"max_model_len": 4096, **llm_options(extra)}
    model = model_with_switches(args)
    llm = LLM(model, **options, **load_options(args))
    vocab = llm.engine.text_config.vocab_size
    rng = random.Random(1)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(PROMPT_LEN)]
               for _ in range(2 + PREFILL_REPEATS)]
    llm.generate([prompts[0]], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    prefills = sorted(_time(llm, prompt, 1) for prompt in prompts[2:])
    prefill_s = prefills[len(prefills) // 2]
    total_s = _time(llm, prompts[1], NEW_TOKENS + 1)
    decode_tok_s = NEW_TOKENS / (total_s - prefill_s)
    dims = ModelDims.from_config(json.loads((Path(model) / "config.json").read_text()))
    types = bench_data_types(llm.engine.hf_config, llm.engine.options, llm.engine.runner.dtype)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rates = device_rates(device, None, None)
    floor_device = device if rates else "an H100"
    bandwidth, tflops = rates or (DEFAULT_BANDWIDTH_GBPS, DEFAULT_TFLOPS)
    floor_tok_s = NEW_TOKENS / floor(dims, [PROMPT_LEN], [NEW_TOKENS + 1],
                                     bandwidth_gbps=bandwidth, tflops=tflops,
                                     **types["floor_bytes"]).decode_s
    result = {"prefill_ms": prefill_s * 1e3, "prefills_ms": [t * 1e3 for t in prefills],
              "decode_tok_s": decode_tok_s,
              "floor_tok_s": floor_tok_s, "fraction_of_floor": decode_tok_s / floor_tok_s,
              "floor_device": floor_device,
              "options": options, "data_types": types["description"]}
    print(f"single request: prefill of {PROMPT_LEN} tokens {prefill_s * 1e3:.1f} ms (of "
          f"{', '.join(f'{t * 1e3:.1f}' for t in prefills)}), decode "
          f"{decode_tok_s:,.0f} tok/s ({decode_tok_s / floor_tok_s:.1%} of the floor "
          f"{floor_tok_s:,.0f} tok/s on {floor_device})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.trace:
        _trace_prefill(llm, prompts[0][::-1], Path(args.trace))


def _time(llm: LLM, prompt: list[int], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def _trace_prefill(llm: LLM, prompt: list[int], folder: Path) -> None:
    """Where the prefill's time goes: host operators by their own time, device kernels by
    theirs, and the timeline to open in Perfetto."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    folder.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as record:
        _time(llm, prompt, 1)
    table = record.key_averages()
    sections = [("host, by own time", "self_cpu_time_total")]
    if torch.cuda.is_available():
        sections.append(("device, by own time", "self_device_time_total"))
    text = "\n\n".join(f"{title}\n{table.table(sort_by=key, row_limit=30)}"
                        for title, key in sections)
    (folder / "prefill-ops.txt").write_text(text)
    record.export_chrome_trace(str(folder / "prefill-trace.json"))


if __name__ == "__main__":
    main()
