"""Published INT4 checkpoints (AutoAWQ, GPTQ, compressed-tensors) -> (q, z, s) -> GGUF blocks / MatMulNBits, exact.

    scheme.py      quantization_config -> Scheme (refuses what cannot be imported exactly)
    unpack.py      per-format unpacking to Int4 (codes, zero points, scales; pure numpy)
    checkpoint.py  the checkpoint directory: tensors by GGUF name, streamed one at a time
    store.py       GGUF storage of an Int4 (Q4_0 / Q4_1 / Q5_0 / F16) with exactness statistics
    onnx_view.py   the ONNX exporter's view: MatMulNBits with the checkpoint's groups and zero points
    convert.py     convert(src, out): GGUF or ONNX, atomic; ConvertReport
    converted.py   --model DIR: convert once into the models cache, keyed by the checkpoint's content hash
"""

from .checkpoint import Int4Checkpoint, is_int4_checkpoint
from .convert import ConvertReport, convert

__all__ = ["ConvertReport", "Int4Checkpoint", "convert", "is_int4_checkpoint"]


class _CallableModule(__import__("types").ModuleType):
    """`edgerun.convert(src, out, ...)` calls convert.convert: the package is the public function too
    (importing a subpackage binds its name on the parent, so a plain function of that name could not stay)."""

    def __call__(self, *args, **kwargs) -> ConvertReport:
        return convert(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
