"""What a server step's outputs cost the host, beyond the engine's own step: the engine process
builds each streamed request's output (``Engine.step()``'s ``_output``), turns it into a delta
(``engine_process.encode``) and pickles the step's message; the server process unpickles it
and rebuilds each output (``engine_process.rebuild``). Random weights of ``--shape`` on the CPU,
``--requests`` streamed requests of ``--prompt-len`` tokens, timed after ``--decoded`` tokens
each (the engine's own step is left out: on a GPU it runs on the device meanwhile).

Usage: python benchmarks/experiments/server_outputs.py [--requests 256] [--prompt-len 512]
       [--decoded 200] [--shape qwen3-tiny]
"""

from __future__ import annotations

import argparse
import pickle
import random
import time

from nanofn import SamplingParams
from nanofn.engine.engine import Engine
from nanofn.engine.options import EngineOptions
from nanofn.model.tiny import random_weights_model
from nanofn.server.engine_process import dumps, encode, rebuild

REPEATS = 50


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decoded", type=int, default=200)
    ap.add_argument("--shape", default="qwen3-tiny")
    args = ap.parse_args()
    engine = Engine(EngineOptions.from_kwargs(str(random_weights_model(args.shape)),
                                              load_format="dummy", device="cpu",
                                              max_model_len=args.prompt_len + args.decoded + 64))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.6, max_tokens=args.decoded + 32, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request([rng.randrange(500) for _ in range(args.prompt_len)], params,
                           request_id=f"r{i}")
    while True:  # until the requests are in steady decode with --decoded tokens each
        outputs = engine.step().outputs
        if len(outputs) == args.requests and \
                len(outputs[0].outputs[0].token_ids) >= args.decoded:
            break
    before = {o.request_id: o for o in outputs}
    requests = [engine._requests[o.request_id] for o in outputs]
    now = [engine._output(r) for r in requests]

    built = _ms(lambda: [engine._output(r) for r in requests])
    deltas = [encode(o, before[o.request_id]) for o in now]
    encoded = _ms(lambda: [encode(o, before[o.request_id]) for o in now])
    message = dumps(("step", deltas))
    pickled = _ms(lambda: dumps(("step", deltas)))
    rebuilt = _ms(lambda: [rebuild(d, before[d[0]]) for d in pickle.loads(message)[1]])
    print(f"{args.requests} streamed requests, {args.prompt_len}-token prompts, "
          f"{len(now[0].outputs[0].token_ids)} tokens each, ms a step:")
    print(f"  engine process: outputs {built:.2f}, deltas {encoded:.2f}, pickle {pickled:.2f} "
          f"({len(message):,} bytes)")
    print(f"  server process: unpickle and rebuild {rebuilt:.2f}")


def _ms(work) -> float:
    start = time.perf_counter()
    for _ in range(REPEATS):
        work()
    return (time.perf_counter() - start) / REPEATS * 1e3


if __name__ == "__main__":
    main()
