"""deltaspec: Qwen3.5 / Qwen3.6 hybrid models from GGUF on ggml, with speculative decoding."""

from .batch_invariance import batch_invariant
from .errors import DeltaspecError
from .grammar import Grammar

__all__ = ["Model", "Llama", "LlamaGrammar", "Drafter", "DeltaspecError", "Grammar", "batch_invariant"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Model needs the native extension; importing it lazily lets the converter, the tokenizer and
    # `deltaspec convert` work from a source tree where _core has not been built.
    if name == "Model":
        from .model import Model

        return Model
    if name in ("Llama", "LlamaGrammar"):  # llama-cpp-python's class names (deltaspec.llama)
        from . import llama

        return getattr(llama, name)
    if name == "Drafter":
        from .dflash import Drafter

        return Drafter
    raise AttributeError(f"module 'deltaspec' has no attribute {name!r}")
