"""Detokenization: incremental, with stop strings, for the sequences that need text as it
comes (``Detokenizer``), and once at the end for the others (``decode_output``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import ByteLevel, DecodeStream

from nanofn.state.params import SamplingParams

PROMPT_CONTEXT = 6  # prompt tokens fed to the stream first, so the first word spaces right


class Detokenizer:
    """Turns a sequence's tokens into text as they arrive and watches for stop strings.

    Needs a fast (``tokenizers``-backed) Hugging Face tokenizer, whose incremental
    ``DecodeStream`` handles characters split across tokens.

    Text that could still turn out to start a stop string is held back from ``visible_text``
    until it is certain, so streamed text never shows a stop string that is cut later.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.params = params
        self.text = ""
        self.stop_string: str | None = None  # the stop string that stopped it
        self._text_before_last_token = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(_context(self._backend, prompt_token_ids, params),
                                    params.skip_special_tokens)

    def add(self, token_id: int, may_stop: bool) -> bool:
        """Take one generated token; return True if the text now reaches a stop string. Stop
        strings are looked for only when the core's policy lets the sequence stop on this
        token (``nanofn.state.policy.may_stop``)."""
        if self.stopped:
            return True
        self._text_before_last_token = old_len = len(self.text)
        new_text = self._stream.step(self._backend, token_id)
        if not new_text:
            return False
        self.text += new_text
        if self.params.stop and may_stop:
            self._check_stop(old_len)
        return self.stopped

    def drop_last_token(self) -> None:
        """The last token was a stop token (end of sequence or a stop token id): its text is
        not part of the output unless ``include_stop_str_in_output``, as in vLLM."""
        if not self.params.include_stop_str_in_output:
            self.text = self.text[:self._text_before_last_token]

    def visible_text(self, finished: bool) -> str:
        if finished or self.stopped or not self._hold:
            return self.text
        return self.text[:max(0, len(self.text) - self._hold)]

    def _check_stop(self, old_len: int) -> None:
        """Look for a stop string that ends in the new text; cut the text at the first one."""
        search_from = max(0, old_len - self._hold)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return
        index, stop = min(hits)
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.stop_string = stop

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None


def decode_output(tokenizer: Any, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                  params: SamplingParams) -> str:
    """The text a ``Detokenizer`` fed ``output_token_ids`` one by one would hold (stop strings
    aside), decoded at once: the decode of the prompt's last tokens and the output, less that
    of the prompt's last tokens. The incremental decoder holds back a character split across
    tokens until it completes, and so never shows the tokens after the last complete one:
    those are left out here too. A byte-level decoder (Llama 3, Qwen) makes that exact; for
    other decoders, or a prompt that ends inside a character, the tokens are replayed through
    the incremental decoder."""
    backend = tokenizer.backend_tokenizer
    if isinstance(backend.decoder, ByteLevel):
        context = _context(backend, prompt_token_ids, params)
        skip = params.skip_special_tokens
        before = backend.decode(context, skip_special_tokens=skip)
        if not before.endswith(_INCOMPLETE):
            shown = list(output_token_ids)
            for _ in range(_MAX_HELD_BACK + 1):
                _drop_unknown_tail(backend, shown)  # they add no bytes, complete nothing
                whole = backend.decode(context + shown, skip_special_tokens=skip)
                if not whole.endswith(_INCOMPLETE) or not shown:
                    if whole.startswith(before):
                        return whole[len(before):]
                    break
                shown.pop()  # a character still incomplete at the end: held back
    replay = Detokenizer(tokenizer, prompt_token_ids, params)
    for token in output_token_ids:
        replay.add(token, may_stop=False)
    return replay.text


def _drop_unknown_tail(backend: Any, token_ids: list[int]) -> None:
    """Drop the ids at the end that the tokenizer does not know (a model's vocabulary is often
    larger than its tokenizer's): a run of them after a broken character would otherwise use
    up the tokens held back, and send the text to the slow replay."""
    while token_ids and backend.id_to_token(token_ids[-1]) is None:
        token_ids.pop()


def _context(backend: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
    """The prompt's last tokens that the output is decoded after (so that its first word
    spaces as it would in the prompt's company), cut so as to end on a whole character: a
    prompt of token ids may end inside one, which the output's text must not take in."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT:])
    while context and backend.decode(context, skip_special_tokens=params.skip_special_tokens
                                     ).endswith(_INCOMPLETE):
        context.pop()
    return context


_INCOMPLETE = "\ufffd"  # what decoding shows for bytes that are not (yet) a whole character
_MAX_HELD_BACK = 8  # tokens to drop from the end looking for a complete character, then replay
