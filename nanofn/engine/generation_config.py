"""Sampling defaults from a model's ``generation_config.json``, as vLLM takes them.

vLLM's ``generation_config="auto"`` (its default) reads the model folder's file and uses its
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``
(as ``max_tokens``) as the defaults of requests that do not set them; ``"vllm"`` ignores the
file; a folder reads that folder's file instead.
"""

from __future__ import annotations

import json
from os import PathLike
from pathlib import Path
from typing import Any

from nanofn.state import SamplingParams

# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def generation_defaults(choice: str | PathLike, model_dir: Path) -> dict[str, Any]:
    """The sampling fields the chosen generation config sets (``{}`` for ``"vllm"``, or for
    ``"auto"`` when the model folder has no such file). Raises ``ValueError`` naming the file
    and the field for a value ``SamplingParams`` would refuse."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        path = model_dir / FILE_NAME
        if not path.is_file():
            return {}
    else:
        path = Path(choice).expanduser() / FILE_NAME
        if not path.is_file():
            raise FileNotFoundError(f"generation_config {str(choice)!r}: {str(path)!r} does not "
                                    f"exist (give 'auto', 'vllm' or a folder holding "
                                    f"{FILE_NAME})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not valid JSON: {error}") from None
    defaults = {field: config[key] for key, field in SAMPLING_KEYS.items()
                if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: {error}") from None
    return defaults
