"""Prompts made ready for the engine in the server's process: checked against the limits,
chat-templated and tokenized. The engine gets token ids (and the text, for ``echo``), so it
never tokenizes between its steps.

A big request is templated and tokenized on a worker thread, which keeps the event loop
serving everyone else: the Rust tokenizer's batch calls release the interpreter lock while they
work (its single-text ``encode`` does not: measured, a thread tokenizing 1 MB of text with it
stalled the loop for 1.4 s). ``encode_batch_fast`` also skips the characters' offsets: on a
6 MB prompt it took 3.2 s against 8 s, and the loop's longest wait fell from 130 ms to 25 ms
(freeing the 5 M tokens' encoding, which needs the lock). A prompt too long for
``max_model_len`` is refused once its token count is known, before its ids become Python
objects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from tokenizers import Tokenizer

from nanofn.server.chat_output import ChatOptions
from nanofn.server.limits import ServerLimits
from nanofn.server.requests import APIError, chat_prompt
from nanofn.state import SamplingParams

# A body larger than this has its prompts made on a worker thread (a smaller one costs less
# than the thread's hop: ~0.1 ms, and up to 5 ms waiting for the lock when the loop is busy).
OFF_LOOP_BYTES = 4096

T = TypeVar("T")


class PromptMaker:
    """The engine prompts of the API's requests, for one tokenizer and the server's limits."""

    def __init__(self, tokenizer: Any, max_model_len: int, limits: ServerLimits,
                 chat_options: ChatOptions):
        self.tokenizer = tokenizer
        self.chat_options = chat_options
        self.max_model_len = max_model_len
        self.max_chars_per_token = limits.max_chars_per_token
        self.max_n = limits.max_n
        # A private copy of the Rust tokenizer, as ``tokenizer.encode`` uses it (no truncation
        # or padding): transformers resets those on the shared one at each call, which would
        # clash with this one's calls on other threads.
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens",
                                                          False))

    async def completion(self, prompts: list, params: SamplingParams,
                         off_loop: bool) -> list[dict]:
        """The engine prompts of a completion's prompts (strings, or dicts of token ids)."""
        self._check_sequences(params.n, len(prompts))
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_chars(len(prompt), "prompt")
        most = self._most_tokens(params)

        def make() -> list[dict]:
            return [self._tokenized(p, True, most, "prompt") if isinstance(p, str) else
                    self._checked_ids(p, most) for p in prompts]
        return await _run(off_loop, make)

    async def chat(self, body: dict, params: SamplingParams | None, off_loop: bool,
                   tools: list[dict] | None = None, param: str = "messages") -> dict:
        """The engine prompt of a chat request's ``messages`` and ``tools`` (``params`` None:
        no length limit, for /tokenize)."""
        if params is not None:
            self._check_sequences(params.n, 1)
        self._check_chars(conversation_chars(body.get("messages")), param)
        prompt = await _run(off_loop, chat_prompt, self.tokenizer, body, self.chat_options,
                            tools)
        most = None if params is None else self._most_tokens(params)
        if most is not None and len(prompt["prompt_token_ids"]) > most:
            raise self._too_many_tokens(len(prompt["prompt_token_ids"]), param)
        return prompt

    async def text(self, text: str, add_special_tokens: bool, off_loop: bool) -> list[int]:
        """``text``'s token ids, however many (for /tokenize)."""
        self._check_chars(len(text), "prompt")
        return await _run(off_loop, self._encode, text, add_special_tokens, None, "prompt")

    def _check_sequences(self, n: int, num_prompts: int) -> None:
        """A request may start at most ``max_n`` sequences: ``n`` of each prompt."""
        if n * num_prompts <= self.max_n:
            return
        if num_prompts == 1:
            raise APIError(400, f"n must be at most {self.max_n} on this server (--max-n), got "
                                f"{n}", param="n")
        raise APIError(400, f"{num_prompts} prompts with n={n} make {n * num_prompts} sequences;"
                            f" this server takes at most {self.max_n} a request (--max-n)",
                       param="prompt")

    def _most_tokens(self, params: SamplingParams) -> int | None:
        """A prompt of more tokens cannot be served (the engine truncates one that asks)."""
        return self.max_model_len if params.truncate_prompt_tokens is None else None

    def _check_chars(self, chars: int, param: str) -> None:
        most = self.max_model_len * self.max_chars_per_token
        if chars > most:
            raise APIError(400, f"the prompt is {chars:,} characters: more than max_model_len "
                                f"{self.max_model_len} tokens hold at this server's bound of "
                                f"{self.max_chars_per_token} characters a token "
                                f"(--max-chars-per-token)", param=param)

    def _tokenized(self, text: str, add_special_tokens: bool, most: int | None,
                   param: str) -> dict:
        return {"prompt": text,
                "prompt_token_ids": self._encode(text, add_special_tokens, most, param)}

    def _encode(self, text: str, add_special_tokens: bool, most: int | None,
                param: str) -> list[int]:
        try:
            encoding = self.backend.encode_batch_fast([text],
                                                      add_special_tokens=add_special_tokens)[0]
        except TypeError:  # what the tokenizer says of a string it cannot encode
            raise APIError(400, f"{param} is not valid Unicode text (it holds a lone "
                                f"surrogate)", param=param) from None
        if most is not None and len(encoding) > most:
            raise self._too_many_tokens(len(encoding), param)
        return encoding.ids

    def _checked_ids(self, prompt: dict, most: int | None) -> dict:
        if most is not None and len(prompt["prompt_token_ids"]) > most:
            raise self._too_many_tokens(len(prompt["prompt_token_ids"]), "prompt")
        return prompt

    def _too_many_tokens(self, tokens: int, param: str) -> APIError:
        return APIError(400, f"the prompt is {tokens:,} tokens, more than max_model_len "
                             f"{self.max_model_len}", param=param)


def conversation_chars(messages: Any) -> int:
    """The characters of a chat's text contents (its prompt has at least as many); what is
    not a well-formed message counts for nothing here (``chat_prompt`` refuses it)."""
    if not isinstance(messages, list):
        return 0
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return chars


async def _run(off_loop: bool, function: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(function, *args) if off_loop else function(*args)
