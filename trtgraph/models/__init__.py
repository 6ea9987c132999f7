"""Llama-family decoders in plain PyTorch and their checkpoint loading."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import CausalLM
from .loader import DTYPES, LoadedModel, load_model
from .tokenizer import load_tokenizer

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "CausalLM", "DTYPES", "LoadedModel", "load_model",
           "load_tokenizer"]
