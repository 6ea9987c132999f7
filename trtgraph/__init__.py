"""trtgraph: an ahead-of-time CUDA-graph compiler for LLM decoding in PyTorch."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # keep `import trtgraph` light: torch loads on first use of LLM
    if name == "LLM":
        from .runtime.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .runtime.requests import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'trtgraph' has no attribute {name!r}")
