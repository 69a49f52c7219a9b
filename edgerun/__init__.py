"""edgerun: offline LLM runtime for edge boards.

    import edgerun
    rt = edgerun.load("smollm2-135m-instruct")
    print(rt.chat([{"role": "user", "content": "Hi!"}], max_tokens=64).text)
"""

import importlib

from . import config, errors
from .errors import EdgerunError
from .version import __version__

# The runtime and the quantizer load on first use: every submodule (edgerun.errors, the CLI's) imports this
# package first, and importing edgerun.runtime or edgerun.resolve costs ~0.5 s each (measured here) against
# ~1 ms for this package.


def load(*args, **kwargs):
    """Load a model (and drafter) into a Runtime. See edgerun.runtime.load."""
    from .runtime import load as _load

    return _load(*args, **kwargs)


def quantize(*args, **kwargs):
    """Quantize a float checkpoint (path or registry name) to an INT4 GGUF. See edgerun.resolve.quantize."""
    from .resolve import quantize as _quantize

    return _quantize(*args, **kwargs)


def __getattr__(name):
    if name == "convert":               # the package edgerun.convert is callable: edgerun.convert(src, out, exact=...)
        return importlib.import_module(".convert", __name__)
    if name in ("Runtime", "Completion"):
        from . import runtime

        return getattr(runtime, name)
    if name in ("Request", "Structure"):
        from . import request

        return getattr(request, name)
    if name in ("SamplingArgs", "SpeculativeArgs", "BackendArgs", "QuantArgs"):
        return getattr(config, name)
    raise AttributeError(f"module 'edgerun' has no attribute {name!r}")


__all__ = ["load", "quantize", "convert", "Runtime", "Completion", "EdgerunError", "errors",
           "SamplingArgs", "SpeculativeArgs", "BackendArgs", "QuantArgs"]
