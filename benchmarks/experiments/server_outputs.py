"""What a server step's outputs cost the host, beyond the engine's own step: the engine process
builds each streamed request's delta (``Engine.step_deltas()``'s ``_delta``: its new tokens
and text) and pickles the step's message; the server process unpickles it and makes each
whole output again (``outputs.apply_delta``). For comparison, the whole outputs that
``Engine.step()`` builds (``_output``). Random weights of ``--shape`` on the CPU,
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
from nanofn.engine.outputs import apply_delta
from nanofn.server.engine_process import dumps

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
    whole: dict = {}  # the server's view: each request's whole output
    cursors: list = []
    while True:  # until the requests are in steady decode with --decoded tokens each
        requests = list(engine._requests.values())
        cursors = [(r, r.sent_metrics, [s.sent for s in r.seqs]) for r in requests]
        deltas = engine.step_deltas().outputs
        before = dict(whole)
        whole.update((d[0], apply_delta(d, whole.get(d[0]))) for d in deltas)
        if len(deltas) == args.requests and \
                len(whole[deltas[0][0]].outputs[0].token_ids) >= args.decoded:
            break

    def step_deltas() -> list:  # each request's delta of the last step again
        for request, metrics, sent in cursors:
            request.sent_metrics = metrics
            for seq, cursor in zip(request.seqs, sent):
                seq.sent = cursor
        return [engine._delta(request) for request, _, _ in cursors]

    built = _ms(lambda: [engine._output(request) for request, _, _ in cursors])
    made = _ms(step_deltas)
    message = dumps(("step", step_deltas()))
    pickled = _ms(lambda: dumps(("step", step_deltas())))
    pickled -= made
    applied = _ms(lambda: [apply_delta(d, before[d[0]])
                           for d in pickle.loads(message)[1]])
    print(f"{args.requests} streamed requests, {args.prompt_len}-token prompts, "
          f"{len(whole[deltas[0][0]].outputs[0].token_ids)} tokens each, ms a step:")
    print(f"  engine process: deltas {made:.2f}, pickle {pickled:.2f} ({len(message):,} bytes) "
          f"(whole outputs, as step() builds them: {built:.2f})")
    print(f"  server process: unpickle and apply {applied:.2f}")


def _ms(work) -> float:
    start = time.perf_counter()
    for _ in range(REPEATS):
        work()
    return (time.perf_counter() - start) / REPEATS * 1e3


if __name__ == "__main__":
    main()
