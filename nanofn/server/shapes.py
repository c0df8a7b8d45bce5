"""OpenAI's response shapes: whole completions and chat completions, streamed chunks and
their server-sent events, logprobs and usage."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from nanofn.engine.outputs import RequestOutput
from nanofn.server.chat_output import ChatOutput
from nanofn.state import SamplingParams


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Shape:
    """OpenAI's response shapes for one call."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool,
                 params: SamplingParams, body: dict, decode: Callable[[list[int]], str],
                 chat_output: ChatOutput | None = None):
        self.id, self.created, self.model, self.chat = response_id, created, model, chat
        self.chat_output = chat_output or ChatOutput()  # a chat's messages: reasoning, tools
        self.n = params.n
        self.echo = bool(body.get("echo", False)) and not chat
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
            for c in final.outputs:
                text = self.prompt_text(final) + c.text if self.echo else c.text
                choice: dict[str, Any] = {"index": self.choice_index(p, c.index),
                                          "logprobs": self._logprobs(c, 0),
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

    def delta_choices(self, prompt_index: int, output: RequestOutput, sent: dict) -> list:
        """The choices of a streamed chunk: each completion's text since the last chunk
        (``sent``: per completion, the text and tokens sent and whether it is done)."""
        choices = []
        for c in output.outputs:
            text_sent, tokens_sent, done = sent.get(c.index, (0, 0, False))
            if done:
                continue
            text = c.text[text_sent:]
            if self.echo and c.index not in sent:
                text = self.prompt_text(output) + text
            if not text and len(c.token_ids) == tokens_sent and c.finish_reason is None:
                continue  # nothing new; a token with no text yet (held back) still gets a chunk
            sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
            choice: dict[str, Any] = {"index": self.choice_index(prompt_index, c.index),
                                      "logprobs": self._logprobs(c, tokens_sent),
                                      "finish_reason": _finish_reason(c.finish_reason)}
            if self.chat:
                choice["delta"], choice["finish_reason"] = self.chat_output.delta(
                    c.index, c.text, choice["finish_reason"])
            else:
                choice["text"] = text
            choices.append(choice)
        return choices

    def usage(self, finals: list) -> dict:
        prompt = sum(len(f.prompt_token_ids) for f in finals if f is not None)
        completion = sum(len(c.token_ids) for f in finals if f is not None for c in f.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _logprobs(self, c, start: int) -> dict | None:
        if c.logprobs is None:  # not asked for
            return None
        entries = list(zip(c.token_ids[start:], c.logprobs[start:]))
        if self.chat:
            return {"content": [{
                "token": top[token].decoded_token, "logprob": top[token].logprob,
                "bytes": list((top[token].decoded_token or "").encode()),
                "top_logprobs": [{"token": lp.decoded_token, "logprob": lp.logprob,
                                  "bytes": list((lp.decoded_token or "").encode())}
                                 for lp in self._top(top)]}
                for token, top in entries]}
        return {"tokens": [top[token].decoded_token for token, top in entries],
                "token_logprobs": [top[token].logprob for token, top in entries],
                "top_logprobs": [{lp.decoded_token: lp.logprob for lp in self._top(top)}
                                 for _, top in entries],
                "text_offset": []}

    def _top(self, entry: dict) -> list:
        """The ``num_top`` most likely tokens of a position's entry (which also holds the
        sampled token, whatever its rank), best first."""
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        return [lp for lp in ranked if lp.rank <= self.num_top][:self.num_top]


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
