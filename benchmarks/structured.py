"""Host cost of structured output per step: the matchers' bitmask for B constrained rows, and
their advance by one token, in microseconds per row (plus, on the device given, applying the
mask to [B, vocab] logits).

The tokenizer is a byte-level BPE of ``--vocab`` tokens trained on the Python standard library's
sources (no download); each row walks a JSON document of the benchmark's schema token by token.

    python benchmarks/structured.py [--vocab 32000] [--rows 1 8 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch

from nanofn.engine.structured import Grammars
from nanofn.runner.sampler import apply_token_bitmask
from nanofn.state.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
}, "required": ["name", "age", "tags"]}
DOCUMENT = json.dumps({"name": "Ada Lovelace, first programmer", "age": 36,
                       "tags": ["analytical engine", "notes", "bernoulli numbers"]},
                      separators=(",", ":"))


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eos|>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eos|>")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    tokenizer = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    tokens = tokenizer.encode(DOCUMENT)
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    print(f"vocabulary {vocab}, document of {len(tokens)} tokens")
    device = torch.device(args.device)
    for rows in args.rows:
        grammars = Grammars(tokenizer, vocab, (tokenizer.eos_token_id,))
        seq_ids = tuple(f"s{i}" for i in range(rows))
        for seq_id in seq_ids:
            grammars.add(seq_id, grammars.compile(seq_id, constraint))
        plan = _Plan(seq_ids)
        mask_s = advance_s = apply_s = 0.0
        logits = torch.randn(rows, vocab, device=device)
        for token in tokens:
            start = time.perf_counter()
            bitmask = grammars.bitmask(plan)
            mask_s += time.perf_counter() - start
            start = time.perf_counter()
            apply_token_bitmask(logits, torch.from_numpy(bitmask.rows).to(device),
                                torch.from_numpy(bitmask.bits).to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            apply_s += time.perf_counter() - start
            start = time.perf_counter()
            ended = [grammars.accept(seq_id, token) for seq_id in seq_ids]
            advance_s += time.perf_counter() - start
        steps = len(tokens)
        per_row = 1e6 / (steps * rows)
        print(f"{rows:4d} rows: mask {mask_s * per_row:7.1f} us/row/step, advance "
              f"{advance_s * per_row:6.1f} us/row/step, apply on {device.type} "
              f"{apply_s * 1e6 / steps:8.1f} us/step")
        assert not any(ended) and all(grammars.matchers[s].is_accepting() for s in seq_ids)


class _Plan:
    """What ``Grammars.bitmask`` reads of a plan."""

    def __init__(self, seq_ids: tuple[str, ...]):
        self.sampling_seq_ids = seq_ids


if __name__ == "__main__":
    main()
