"""``LLM``: offline generation, chat and beam search, as vLLM users know it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from nanofn.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanofn.engine.chat import render_chat
from nanofn.engine.collector import fewer_gc_pauses
from nanofn.engine.engine import Engine, PromptInput
from nanofn.engine.options import EngineOptions
from nanofn.engine.outputs import RequestOutput
from nanofn.state import InvalidRequest, SamplingParams

Message = Mapping[str, Any]


class LLM:
    """A model loaded from a local Hugging Face folder, ready to generate.

    ``options`` take vLLM's names (``max_model_len``, ``gpu_memory_utilization``,
    ``enable_prefix_caching``, ``generation_config``, ...; see ``EngineOptions``); an unknown
    one is an error naming it. ``trace="run.jsonl"`` records the run for ``nanofn replay``.

    Sampling defaults come from the model's ``generation_config.json`` as in vLLM
    (``generation_config="auto"``): ``generate()`` without params uses
    ``get_default_sampling_params()``; a ``SamplingParams`` given is used as it is.
    """

    def __init__(self, model: str, **options: Any):
        self.engine = Engine(EngineOptions.from_kwargs(model, **options))

    @property
    def llm_engine(self) -> Engine:
        """The engine (vLLM's name): ``add_request``, ``step``, ``abort_request``..."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The generation config's sampling defaults (vLLM's ``SamplingParams()`` when it sets
        none, or with ``generation_config="vllm"``)."""
        return self.engine.default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``. Give one
        ``SamplingParams`` for all prompts or one per prompt.
        """
        prompts = _as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_per_prompt(sampling_params, len(prompts))
        ids = self._add_all(prompts, params)
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages; a content may be
        a list of text parts) or several, through the tokenizer's chat template (or
        ``chat_template``). ``chat_template_kwargs`` go to the template (Qwen3's
        ``enable_thinking``, say); ``continue_final_message`` leaves the last message open
        for the model to go on with."""
        conversations = [[_text_content(m) for m in c] for c in _conversations(messages)]
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False "
                             "(the last message is continued, not answered)")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise TypeError(f"chat_template_kwargs must be a dict, got "
                            f"{type(chat_template_kwargs).__name__}")
        prompts = [render_chat(tokenizer, conversation,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message,
                               chat_template=chat_template, **dict(chat_template_kwargs or {}))
                   for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best continuations of each prompt, best first."""
        token_prompts = [self.engine.tokenize(p)[1] for p in _as_list(prompts)]
        engine = self.engine
        return beam_search(
            lambda batch, batch_params: self._run(self._add_all(batch, batch_params), False),
            token_prompts, params, engine.eos_token_ids, engine.max_model_len,
            lambda ids: engine.tokenizer.decode(list(ids), skip_special_tokens=True))

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------

    def _add_all(self, prompts: list[PromptInput], params: list[SamplingParams]) -> list[str]:
        """Queue every prompt, or none: a bad one is reported with its index and the ones
        queued before it are withdrawn."""
        ids: list[str] = []
        try:
            for index, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    ids.append(self.engine.add_request(prompt, p, stream=False))
                except ValueError as e:
                    raise type(e)(f"prompt {index}: {e}") from e
        except BaseException:
            self._settle(ids)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until the requests finish. Interrupted (or failing) anywhere, the call's
        requests are aborted and their work settled before the exception goes on: the LLM
        stays usable, with nothing of this call left."""
        try:
            return self._step_until_done(ids, use_tqdm)
        except BaseException:
            self._settle(ids)
            raise

    def _settle(self, ids: list[str]) -> None:
        """Abort an interrupted call's requests. An engine that cannot step any more (a
        tensor-parallel worker died) cannot settle them: the error that interrupted the call
        says why, and it is the one raised."""
        with contextlib.suppress(Exception):
            self.engine.abort_and_settle(ids)

    def _step_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        remaining = set(ids)
        progress = _Progress(len(ids), use_tqdm)
        with progress, fewer_gc_pauses():
            while remaining:
                start = time.perf_counter()
                result = self.engine.step(only_finished=True, decode_finished=False)
                progress.update(result, time.perf_counter() - start)
                for output in result.outputs:
                    finished[output.request_id] = output
                    remaining.discard(output.request_id)
        outputs = [finished[i] for i in ids]
        self.engine.decode_texts(outputs)  # now that the device has nothing left to do
        return outputs


@dataclass
class _Progress:
    """Requests done, and live prefill and decode throughput (tokens/s over recent steps)."""

    total: int
    enabled: bool
    bar: Any = None
    prefill: list[float] = field(default_factory=lambda: [0.0, 0.0])  # tokens, seconds
    decode: list[float] = field(default_factory=lambda: [0.0, 0.0])

    def __enter__(self) -> _Progress:
        if self.enabled:
            self.bar = tqdm(total=self.total, desc="Processed prompts", dynamic_ncols=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, result, seconds: float) -> None:
        if self.bar is None:
            return
        tokens = result.num_prefill_tokens + result.num_decode_tokens
        for counter, n in ((self.prefill, result.num_prefill_tokens),
                           (self.decode, result.num_decode_tokens)):
            if tokens:
                counter[0] += n
                counter[1] += seconds * n / tokens
        self.bar.set_postfix_str(f"prefill {_rate(self.prefill)} tok/s, "
                                 f"decode {_rate(self.decode)} tok/s", refresh=False)
        self.bar.update(sum(1 for o in result.outputs if o.finished))


def _rate(counter: list[float]) -> str:
    return f"{counter[0] / counter[1]:,.0f}" if counter[1] else "-"


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt or a list of them, as a list; what is neither is a ``TypeError``."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, a list of token ids, a dict or a list of "
                        f"those, got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt of token ids
        return [prompts]
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (str, Mapping,
                                                                             Sequence)):
            raise InvalidRequest(f"prompt {index}: a prompt must be a string, a list of token "
                                 f"ids or a dict, got {type(prompt).__name__}")
    return prompts


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams],
                       count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, Mapping) or not isinstance(params, Sequence):
        raise TypeError(f"sampling_params must be SamplingParams or a list of them, got "
                        f"{type(params).__name__}" + (" (SamplingParams(**d) makes one from a "
                                                      "dict)" if isinstance(params, Mapping)
                                                      else ""))
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts; give one, "
                         f"or one per prompt")
    return params


def _conversations(messages: Any) -> list[list[Message]]:
    """One conversation or a list of them, checked: each a list of ``{"role", "content"}``."""
    wrong = TypeError(f"messages must be a list of {{'role', 'content'}} dicts (or a list of "
                      f"such lists), got {type(messages).__name__}")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise wrong
    single = bool(messages) and isinstance(messages[0], Mapping)
    conversations = [list(messages)] if single else list(messages)
    for c, conversation in enumerate(conversations):
        if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation,
                                                                            Sequence):
            raise wrong
        for m, message in enumerate(conversation):
            where = f"message {m}" + (f" of conversation {c}" if not single else "")
            if not isinstance(message, Mapping):
                raise TypeError(f"{where} must be a dict, got {type(message).__name__}")
            missing = [key for key in ("role", "content") if key not in message]
            if missing:
                raise ValueError(f"{where} has no {' or '.join(map(repr, missing))}")
    return conversations


def _text_content(message: Message) -> dict[str, Any]:
    """The message with a content given as OpenAI text parts (``[{"type": "text", "text":
    ...}]``) joined into one string; other part types are an error naming them."""
    content = message["content"]
    if isinstance(content, str) or content is None:
        return dict(message)
    if not isinstance(content, Sequence) or not all(
            isinstance(part, Mapping) and part.get("type") == "text"
            and isinstance(part.get("text"), str) for part in content):
        raise ValueError(f"a message content must be a string or a list of "
                         f"{{'type': 'text', 'text': ...}} parts (nanofn reads text only), got "
                         f"{content!r}")
    return {**message, "content": "".join(part["text"] for part in content)}
