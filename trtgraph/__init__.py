"""trtgraph: an ahead-of-time CUDA-graph compiler for LLM decoding in PyTorch."""

from . import startup as _startup  # noqa: F401  (its clock starts at the first `import trtgraph`)

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "Completion", "CompletionDelta", "Usage", "Timings", "__version__"]

_LAZY = {"LLM", "Completion", "CompletionDelta", "Usage", "Timings"}


def __getattr__(name):  # keep `import trtgraph` light: torch loads on first use of the API
    if name in _LAZY:
        from .runtime.serving import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from .runtime.serving.requests import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'trtgraph' has no attribute {name!r}")


def __dir__():  # the lazy names too (help(), tab completion)
    return sorted(set(globals()) | set(__all__))
