"""Exceptions raised for bad model files and bad parameters.

One class per failure kind so callers can catch exactly what they mean; every message names the
file, metadata key, tensor or parameter at fault and what was expected.
"""

from __future__ import annotations


class DeltaspecError(Exception):
    """Base class of every error deltaspec raises on purpose."""


class ModelFileNotFoundError(DeltaspecError, FileNotFoundError):
    """The model path does not exist or is not a regular file."""


class NotAGGUFError(DeltaspecError, ValueError):
    """The file does not start with the GGUF magic or has an unsupported GGUF version."""


class TruncatedFileError(DeltaspecError, ValueError):
    """The file ends before its header, metadata, tensor table or tensor data does."""


class UnsupportedArchitectureError(DeltaspecError, ValueError):
    """`general.architecture` is not one deltaspec runs (qwen35)."""


class MissingMetadataError(DeltaspecError, KeyError):
    """A required metadata key is absent."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class HyperParameterError(DeltaspecError, ValueError):
    """Metadata values are absurd or inconsistent with each other."""


class MissingTensorError(DeltaspecError, KeyError):
    """A tensor the graph needs is not in the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TensorShapeError(DeltaspecError, ValueError):
    """A tensor has a shape other than the hyper-parameters imply."""


class UnsupportedTensorTypeError(DeltaspecError, ValueError):
    """A tensor is stored in a ggml type deltaspec cannot use where it appears."""


class ConversionError(DeltaspecError, ValueError):
    """A Hugging Face checkpoint folder cannot be converted to GGUF (missing or unsupported parts)."""


class CorruptFileError(DeltaspecError, ValueError):
    """The GGUF header, metadata or tensor table cannot be parsed (values out of range)."""


class TokenizerError(DeltaspecError, ValueError):
    """The `tokenizer.ggml.*` metadata describe a vocabulary deltaspec cannot tokenize with."""


class ChatTemplateError(DeltaspecError, ValueError):
    """A chat template is missing, does not compile, rejects the messages (`raise_exception`), or the
    messages handed to it are malformed."""


class EngineError(DeltaspecError, RuntimeError):
    """The native engine could not set a validated model up: the device is missing from this build
    or cannot start, memory ran out, or the file changed after it was validated."""


class GrammarError(DeltaspecError, ValueError):
    """A grammar, JSON schema or response_format that cannot constrain generation (the message says why)."""
