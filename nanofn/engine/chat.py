"""Conversations as prompts, through a tokenizer's chat template (for ``LLM.chat`` and the
server)."""

from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, conversation: list[dict], **template_options: Any) -> dict:
    """A conversation as a prompt: the text the tokenizer's chat template makes of it
    (``template_options`` go to ``apply_chat_template``) and its token ids (the template
    writes the special tokens itself)."""
    text = tokenizer.apply_chat_template(conversation, tokenize=False, **template_options)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
