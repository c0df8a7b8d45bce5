"""Reasoning in a chat model's output, as vLLM's ``--reasoning-parser``s read it: the thinking
block goes to the message's ``reasoning_content`` (and ``reasoning``), the rest to ``content``.

``split(text, final) -> (reasoning, content)`` works as the tool parsers' ``parse``: on the
whole text so far, each part only growing while the output streams (a partial ``</think>`` is
held back until the next text decides).
"""

from __future__ import annotations

import re

from nanofn.server.tool_parsers import TOOL_CALL_START, safe_end

THINK_START, THINK_END = "<think>", "</think>"
# Qwen3.5 may call a tool from inside its thinking block, without closing it first.
_CALL_IN_THINKING = re.compile(r"<tool_call>\s*<function[\s=]")
_FUNCTION_OPEN = "<function"


class Qwen3ReasoningParser:
    """Qwen3's and Qwen3.5's ``<think>...</think>``. Qwen3.5's template (and Qwen3's thinking
    models') opens the block in the prompt, so the output shows only ``</think>``; older ones
    let the model write ``<think>`` first: both read the same. As in vLLM, an output without
    ``</think>`` is all reasoning (cut short while thinking), unless it calls a tool in Qwen3.5's
    way (``<tool_call><function=...``), which ends the reasoning there.

    ``thinks_first=False`` says the output does not start inside a thinking block: thinking is
    off (``enable_thinking=False``, or a prompt that closes the block), or the request's output
    is constrained from its first token (the grammar writes no reasoning unless it starts with
    ``<think>``). Then only an output that starts with ``<think>`` has reasoning."""

    def __init__(self, thinks_first: bool):
        self.thinks_first = thinks_first

    def split(self, text: str, final: bool) -> tuple[str, str]:
        opened = text.lstrip()
        if opened.startswith(THINK_START):
            text = opened[len(THINK_START):]
        elif not final and THINK_START.startswith(opened):
            return "", ""  # nothing yet, or the start of a <think>
        elif not self.thinks_first:
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            return text[:end], text[end + len(THINK_END):]
        call = _CALL_IN_THINKING.search(text)
        if call is not None:
            return text[:call.start()], text[call.start():]
        return (text if final else text[:self._undecided_start(text)]), ""

    @staticmethod
    def _undecided_start(text: str) -> int:
        """Where the reasoning text that could still turn out to end it begins: a partial
        ``</think>``, or a ``<tool_call>`` that a ``<function`` may yet follow."""
        start = min(safe_end(text, THINK_END), safe_end(text, TOOL_CALL_START))
        call = text.rfind(TOOL_CALL_START)
        if call >= 0 and _FUNCTION_OPEN.startswith(text[call + len(TOOL_CALL_START):].lstrip()):
            start = min(start, call)
        return start


# vLLM's parser names
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
