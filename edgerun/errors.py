"""Typed errors. Every message says what was wrong and what was expected.

Library code raises these; only the CLI prints them (one line, exit code 2).
"""


class EdgerunError(Exception):
    """Base class of every error edgerun raises on purpose."""

    exit_code = 2


class InvalidArgument(EdgerunError, ValueError):
    """A parameter is out of range or of the wrong kind (sampling values, gamma, ...). param: the option's
    name where one is to blame (the HTTP answer names it)."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(EdgerunError):
    """A model name is not in the registry and is not a path to an existing model file."""


class ModelFormatError(EdgerunError):
    """A model file exists but is not a valid/complete model (truncated GGUF, not GGUF, bad ONNX dir)."""


class RegistryError(EdgerunError):
    """A manifest is invalid, or fetching/assembling a model's pieces failed."""


class ChecksumError(RegistryError):
    """An assembled model does not have the size or sha256 its manifest pins."""


class HubError(RegistryError):
    """A Hugging Face hub name cannot be fetched: gated, unreachable, no usable file, or a bad download."""


class ContextOverflow(EdgerunError):
    """A prompt (or prompt + generation) does not fit in the model's context window."""


class VocabMismatch(EdgerunError):
    """A drafter's vocabulary differs from its target's."""


class ProfileError(EdgerunError):
    """A device profile file is invalid (unknown key, wrong type) or cannot be found."""


class MemoryBudgetError(EdgerunError):
    """The models and KV cache would not fit the device's memory budget."""


class BackendError(EdgerunError):
    """The inference engine (llama.cpp, onnxruntime) failed or is not available."""


class QuantizationError(EdgerunError):
    """A quantization input or option is not supported (architecture, format, NaN weights, ...)."""


class ClusterError(EdgerunError):
    """An RPC worker is unreachable, busy, speaks another protocol, or was lost; or the build has no RPC."""


class StorageError(EdgerunError):
    """A file could not be written: the disk is full, the folder is read-only or not ours."""


class GrammarError(InvalidArgument):
    """A grammar from the caller is over a limit, or failed while the output was being generated."""
