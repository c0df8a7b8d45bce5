"""What the kernels' launch heuristics need to know about the device."""

import functools

import torch

# An H100's SMs: what a heuristic assumes under the interpreter, so that it splits as there
H100_SMS = 132


@functools.cache
def num_sms(device: torch.device, elsewhere: int) -> int:
    """Streaming multiprocessors of a CUDA device; ``elsewhere`` under Triton's interpreter."""
    if device.type != "cuda":
        return elsewhere
    return torch.cuda.get_device_properties(device).multi_processor_count


FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attention_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why flash-attn-4's paged prefill cannot run on ``device`` in ``dtype``; ``None`` if it can.

    Paged KV needs SM 9.x-11.x (flash-attn-4 has no paged path on SM 8.x or 12.x). Importing
    ``flash_attn.cute`` loads the CuTe DSL, so only a CUDA device with such a GPU gets that far.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device and torch sees none"
    if dtype not in FLASH_DTYPES:
        return f"it computes in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10, 11):
        return (f"its paged KV cache needs SM 9.0 to 11.x (Hopper, Blackwell); this GPU is "
                f"SM {major}.{minor}")
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as error:  # an ImportError mostly; the CuTe DSL may fail otherwise too
        return (f"flash_attn.cute does not import ({type(error).__name__}: {error}); "
                f'pip install "nanofn[flash]"')
    return None


def fp8_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot compute with e4m3 values on ``device``; ``None`` if they
    can. Their FP8 products (``tl.dot`` on float8e4nv) and conversions (``cvt.rn.f16x2.e4m3x2``)
    need SM 8.9 (Ada) or later; the torch references run FP8 anywhere."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"the Triton kernels' e4m3 products and conversions need SM 8.9 or later (Ada, "
                f"Hopper, Blackwell); this GPU is SM {major}.{minor}")
    return None
