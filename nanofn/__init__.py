"""nanofn: an LLM inference engine whose scheduling core is a pure function."""

from nanofn.state.params import SamplingParams

__all__ = ["SamplingParams"]
