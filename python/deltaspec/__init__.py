"""deltaspec: Qwen3.5 / Qwen3.6 hybrid models from GGUF on ggml, with speculative decoding."""

from .errors import DeltaspecError
from .model import Model

__all__ = ["Model", "DeltaspecError"]
__version__ = "0.1.0"
