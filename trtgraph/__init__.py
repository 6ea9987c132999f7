"""trtgraph: an ahead-of-time CUDA-graph compiler for LLM decoding in PyTorch."""

__version__ = "0.1.0"
