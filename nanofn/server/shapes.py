"""OpenAI's response shapes: whole completions and chat completions, streamed chunks and
their server-sent events, logprobs and usage."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from nanofn.engine.outputs import CompletionOutput, Logprob, RequestOutput
from nanofn.server.chat_output import ChatOutput
from nanofn.server.requests import scores_prompt_only
from nanofn.state import SamplingParams

# JSON has no -inf (a token a grammar masks out has that logprob): vLLM's stand-in
LOWEST_LOGPROB = -9999.0


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclasses.dataclass
class Sent:
    """What a streamed completion has sent so far."""

    text: int = 0  # characters of its generated text
    tokens: int = 0
    text_offset: int = 0  # where its next token starts in the text sent (logprobs' text_offset)
    done: bool = False


class Shape:
    """OpenAI's response shapes for one call."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 params: SamplingParams, body: dict, decode: Callable[[list[int]], str],
                 chat_output: ChatOutput | None = None):
        self.id, self.created, self.model, self.chat = response_id, created, model, chat
        self.chat_output = chat_output or ChatOutput()  # a chat's messages: reasoning, tools
        self.n = params.n
        self.echo = bool(body.get("echo", False)) and not chat
        self.prompt_only = self.echo and scores_prompt_only(body)  # its one token is dropped
        self.decode = decode
        self.num_top = params.logprobs or 0  # the request's logprobs / top_logprobs

    def prompt_text(self, output: RequestOutput) -> str:
        """What ``echo`` puts first: the prompt as given, or its tokens decoded."""
        return output.prompt if output.prompt is not None else self.decode(
            output.prompt_token_ids)

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        return prompt_index * self.n + completion_index

    def whole(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for p, final in enumerate(finals):
            for c in map(self._shown, final.outputs):
                text = self.prompt_text(final) + c.text if self.echo else c.text
                choice: dict[str, Any] = {"index": self.choice_index(p, c.index),
                                          "logprobs": self._logprobs(final, c, self.echo, Sent()),
                                          "finish_reason": _finish_reason(c.finish_reason),
                                          "stop_reason": c.stop_reason}
                if self.chat:
                    choice["message"], choice["finish_reason"] = self.chat_output.message(
                        text, choice["finish_reason"])
                else:
                    choice["text"] = text
                    choice["prompt_logprobs"] = _prompt_logprobs(final)
                choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(finals)}

    def chunk(self, prompt_index: int, choices: list) -> dict:
        return {"id": self.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    def delta_choices(self, prompt_index: int, output: RequestOutput,
                      sent: dict[int, Sent]) -> list:
        """The choices of a streamed chunk: each completion's text since the last chunk
        (``sent``: per completion, what it has sent). With ``echo``, a completion's first chunk
        starts with the prompt (and its logprobs)."""
        choices = []
        for c in map(self._shown, output.outputs):
            echoed = self.echo and c.index not in sent
            progress = sent.setdefault(c.index, Sent())
            if progress.done:
                continue
            text = c.text[progress.text:]
            if echoed:
                text = self.prompt_text(output) + text
            elif not text and len(c.token_ids) == progress.tokens and c.finish_reason is None:
                continue  # nothing new; a token with no text yet (held back) still gets a chunk
            choice: dict[str, Any] = {"index": self.choice_index(prompt_index, c.index),
                                      "logprobs": self._logprobs(output, c, echoed, progress),
                                      "finish_reason": _finish_reason(c.finish_reason)}
            if self.chat:
                choice["delta"], choice["finish_reason"] = self.chat_output.delta(
                    c.index, c.text, choice["finish_reason"])
            else:
                choice["text"] = text
            progress.text, progress.tokens = len(c.text), len(c.token_ids)
            progress.done = c.finish_reason is not None
            choices.append(choice)
        return choices

    def usage(self, finals: list) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
        completion = sum(len(self._shown(c).token_ids) for f in finals if f is not None
                         for c in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _shown(self, c: CompletionOutput) -> CompletionOutput:
        """The completion as the response shows it: nothing generated when the call only
        scores its prompt."""
        if not self.prompt_only:
            return c
        return dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=None if c.logprobs is None else [])

    def _logprobs(self, output: RequestOutput, c: CompletionOutput, echoed: bool,
                  progress: Sent) -> dict | None:
        """The logprobs of the tokens not sent yet (``progress``; with ``echoed``, the prompt's
        first). Chat's: per token, itself and exactly its ``top_logprobs`` best."""
        if c.logprobs is None:  # not asked for
            return None
        positions = list(zip(c.token_ids[progress.tokens:], c.logprobs[progress.tokens:]))
        if self.chat:
            return {"content": [{**_chat_token(top[token]),
                                 "top_logprobs": [_chat_token(lp) for lp in self._top(top)]}
                                for token, top in positions]}
        if echoed:
            positions = list(zip(output.prompt_token_ids, output.prompt_logprobs)) + positions
        return self._completion_logprobs(positions, progress)

    def _completion_logprobs(self, positions: list, progress: Sent) -> dict:
        """A completion's ``tokens``, ``token_logprobs``, ``top_logprobs`` (the position's token
        and the ``logprobs`` best, as in vLLM) and ``text_offset`` (where each token's text
        starts in the choice's text: the lengths of the tokens before it added up, as in vLLM)
        of (token, entry) positions; the entry is None at the prompt's first token, which
        nothing before it scores."""
        tokens, values, tops, offsets = [], [], [], []
        for token, entry in positions:
            if entry is None:
                tokens.append(self.decode([token]))
                values.append(None)
                tops.append(None)
            else:
                tokens.append(entry[token].decoded_token)
                values.append(_finite(entry[token].logprob))
                # The position's token last: of two tokens with the same text, its value stays.
                tops.append({lp.decoded_token: _finite(lp.logprob)
                             for lp in [*self._top(entry), entry[token]]})
            offsets.append(progress.text_offset)
            progress.text_offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _top(self, entry: dict[int, Logprob]) -> list[Logprob]:
        """The ``num_top`` most likely tokens of a position's entry (which also holds the
        chosen token, whatever its rank), best first."""
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        return [lp for lp in ranked if lp.rank <= self.num_top][:self.num_top]


def _chat_token(lp: Logprob) -> dict:
    return {"token": lp.decoded_token, "logprob": _finite(lp.logprob),
            "bytes": list((lp.decoded_token or "").encode())}


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _prompt_logprobs(output: RequestOutput) -> list | None:
    """vLLM's ``prompt_logprobs`` of a completion choice: per prompt position (None for the
    first), token id -> its logprob, rank and text."""
    if output.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                          "decoded_token": lp.decoded_token} for token, lp in entry.items()}
            for entry in output.prompt_logprobs]


def _finish_reason(reason: str | None) -> str | None:
    return None if reason is None else "stop" if reason == "abort" else reason
