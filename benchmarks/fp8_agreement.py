"""FP8 against bf16 on a random-weight shape: two engines with the same dummy weights (the FP8 one
quantized at load, with an FP8 KV cache), their greedy tokens and their log-probabilities along
the same sequences.

Usage: python benchmarks/fp8_agreement.py --random-weights qwen3-0.6b [--prompts 32]
       [--prompt-len 256] [--tokens 64] [--json PATH]

Both engines generate greedily from the same random prompts; then each scores the bf16
engine's sequences (prompt and generated tokens) with prompt log-probabilities and its own top
token at every position (``prompt_logprobs=1``): reported are the sequences whose greedy tokens
are equal, the mean position of the first difference, the share of positions where the two
engines' top tokens agree along the same sequence, and the largest and mean difference of a
token's log-probability. (Dummy weights draw matrices in the parameters' order, an FP8
projection from the draw of its bf16 twin: ``init_dummy_weights``.) Random weights give flat
distributions, whose top-2 gaps are small: agreement here is a lower bound for a trained model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from nanofn import LLM, SamplingParams
from nanofn.model.tiny import random_weights_model

CONFIGS = {"bf16": {}, "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-weights", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = random_weights_model(args.random_weights)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    generated, scored = {}, {}
    for name, options in CONFIGS.items():
        with LLM(model, load_format="dummy", max_model_len=4096, **options) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                   use_tqdm=False)
            generated[name] = [list(o.outputs[0].token_ids) for o in outputs]
            sequences = [p + g for p, g in zip(prompts, generated.get("bf16", generated[name]))]
            scored[name] = score(llm, sequences)
    result = compare(generated, scored)
    result.update(shape=args.random_weights, prompts=args.prompts, prompt_len=args.prompt_len,
                  tokens=args.tokens)
    print(f"{args.random_weights}: FP8 weights and KV against bf16, {args.prompts} prompts of "
          f"{args.prompt_len} tokens, {args.tokens} greedy tokens each")
    print(f"  greedy tokens equal in {result['equal_sequences']} of {args.prompts} sequences; "
          f"first difference at token {result['mean_first_difference']:.1f} on average")
    print(f"  along bf16's sequences: top tokens agree at {result['top_token_agreement']:.1%} "
          f"of positions; token log-probability differs by {result['max_logprob_error']:.3f} "
          f"at most, {result['mean_logprob_error']:.4f} on average")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def score(llm: LLM, sequences: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per sequence and position (the first has none): the token's log-probability under
    ``llm`` and ``llm``'s most likely token there."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    scores = []
    for sequence, output in zip(sequences, outputs):
        rows = []
        for token, position in zip(sequence[1:], output.prompt_logprobs[1:]):
            top = min(position, key=lambda t: position[t].rank)
            rows.append((position[token].logprob, top))
        scores.append(rows)
    return scores


def compare(generated: dict, scored: dict) -> dict:
    """The figures the module's docstring lists, from each engine's tokens and scores."""
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(generated["bf16"], generated["fp8"])]
    pairs = [(a, b) for x, y in zip(scored["bf16"], scored["fp8"]) for a, b in zip(x, y)]
    errors = [abs(a[0] - b[0]) for a, b in pairs]
    return {"equal_sequences": sum(x == y for x, y in zip(generated["bf16"], generated["fp8"])),
            "mean_first_difference": sum(firsts) / len(firsts),
            "top_token_agreement": sum(a[1] == b[1] for a, b in pairs) / len(pairs),
            "max_logprob_error": max(errors), "mean_logprob_error": sum(errors) / len(errors)}


if __name__ == "__main__":
    main()
