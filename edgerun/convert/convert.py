"""`edgerun convert SRC OUT`: a published INT4 checkpoint -> GGUF (llama.cpp) or an ONNX directory, exactly.

Streams tensor by tensor (a few tensors in memory at a time); the output appears only when complete.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ..version import __version__
from ..errors import InvalidArgument, QuantizationError
from ..formats.arch import hf_name, tensor_shape
from ..formats.gguf import KV, TensorPlan, source_kv, write_gguf
from ..onnx.export import export_onnx
from ..onnx.layout import read_config
from ..util.atomic import check_destination
from .checkpoint import Int4Checkpoint
from .store import StoreStat, choose_type, store
from .onnx_view import CheckpointView
from .unpack import Int4

log = logging.getLogger(__name__)

# llama.cpp file types (LLAMA_FTYPE_MOSTLY_*) of the dominant linear storage
_FILE_TYPE = {"q4_0": 2, "q4_1": 3, "q5_0": 8}


@dataclass
class ConvertReport:
    out: str
    kind: str                        # "gguf" | "onnx"
    source: str
    scheme: str                      # e.g. "awq/gemm"
    group_size: int
    zero_point: str                  # "symmetric" | "asymmetric"
    storage: dict = field(default_factory=dict)     # stored type -> number of INT4 tensors
    n_blocks: int = 0                # blocks of 32 of the INT4 tensors stored in blocks (F16 ones not counted)
    n_exact: int = 0
    max_rel_err: float = 0.0         # max |dw| / s over every INT4 tensor
    f16_tensors: list = field(default_factory=list)  # INT4 tensors that had to be stored as F16 (act-order)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    tensors: list = field(default_factory=list)

    @property
    def exact_share(self) -> float:
        return 1.0 if self.n_blocks == 0 else self.n_exact / self.n_blocks

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exact_share"] = self.exact_share
        return d

    def add(self, st: StoreStat) -> None:
        self.tensors.append(asdict(st))
        self.storage[st.stored] = self.storage.get(st.stored, 0) + 1
        if st.stored == "f16":
            self.f16_tensors.append(st.name)
            return
        self.n_blocks += st.n_blocks
        self.n_exact += st.n_exact
        self.max_rel_err = max(self.max_rel_err, st.max_rel_err)


def _planned_type(ckpt: Int4Checkpoint, name: str, exact: bool) -> str:
    """The storage type of a tensor, decided before any data is read (the GGUF header comes first)."""
    if ckpt.is_quantized(name):
        grp = ckpt.scheme.group_for(ckpt_module(ckpt, name)) or ckpt.scheme.groups[0]
        K = tensor_shape(ckpt.cfg, name)[1]
        g = K if grp.group_size == -1 else grp.group_size
        empty = np.zeros((1, 0), np.float32)
        probe = Int4(empty.astype(np.uint8), empty.astype(np.uint8), empty, g, grp.symmetric,
                     m=empty if ckpt.scheme.version == "gemv_fast" else None,
                     g_idx=None if ckpt.blockwise(name) else np.zeros(0))
        return choose_type(probe, exact)
    if name.endswith(".bias") or "norm" in name:
        return "f32"
    return "f16" if ckpt.float_dtype(name) == "F16" else "f32"


def ckpt_module(ckpt: Int4Checkpoint, name: str) -> str:
    return hf_name(ckpt.cfg, name).rsplit(".", 1)[0]


def _ggml(t: str):
    return getattr(gguf.GGMLQuantizationType, t.upper())


def _metadata(ckpt: Int4Checkpoint, report: ConvertReport, types: dict[str, str], exact: bool) -> list[KV]:
    T = gguf.GGUFValueType
    int4 = sorted({t for n, t in types.items() if ckpt.is_quantized(n)})
    fmt = int4[0] if len(int4) == 1 else "mixed"
    return [KV("edgerun.quant.method", "import", T.STRING),
            KV("edgerun.quant.format", fmt, T.STRING),
            KV("edgerun.quant.block_size", 32, T.UINT32),
            KV("edgerun.import.source_format", report.scheme, T.STRING),
            KV("edgerun.import.group_size", report.group_size, T.INT32),
            KV("edgerun.import.zero_point", report.zero_point, T.STRING),
            KV("edgerun.import.exact", bool(exact), T.BOOL),
            KV("edgerun.import.storage", [f"{n}={t}" for n, t in types.items()], T.ARRAY, T.STRING),
            KV("edgerun.source.sha256", ckpt.sha256(), T.STRING),
            KV("edgerun.source.name", ckpt.name, T.STRING),
            KV("edgerun.version", __version__, T.STRING)]


def convert(source: str | os.PathLike, out: str | os.PathLike, *, exact: bool = False, n_ctx: int | None = None,
            accuracy_level: int = 4, force: bool = False,
            progress: Callable[[str, int, int], None] | None = None) -> ConvertReport:
    """Convert INT4 checkpoint directory `source` to `out`: a .gguf file, or an ONNX directory otherwise.

    exact: store asymmetric weights as Q5_0 (bit-exact for every zero point) instead of Q4_1.
    n_ctx, accuracy_level, force: as for edgerun.onnx.export.export_onnx (ONNX output only).
    """
    t0 = time.perf_counter()
    out = Path(out)
    ckpt = Int4Checkpoint(source)
    grp = ckpt.scheme.groups[0]
    report = ConvertReport(str(out), "gguf" if out.suffix.lower() == ".gguf" else "onnx", ckpt.name,
                           ckpt.scheme.label, grp.group_size, "symmetric" if grp.symmetric else "asymmetric")
    if report.kind == "onnx":
        _to_onnx(ckpt, out, report, n_ctx, accuracy_level, force, progress)
    else:
        if out.exists() and out.is_dir():
            raise InvalidArgument(f"{out} is a directory; expected an output .gguf file path")
        check_destination(out)
        _to_gguf(ckpt, out, report, exact, progress)
    if report.f16_tensors:
        log.warning("%d INT4 tensors are act-order (their inputs are not grouped in order) and were stored as "
                    "F16: %s", len(report.f16_tensors), ", ".join(report.f16_tensors))
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log.info("converted %s (%s) -> %s in %.1f s: %.2f%% of blocks bit-exact, max |dw|/s %.4g",
             ckpt.name, report.scheme, out, report.seconds, 100 * report.exact_share, report.max_rel_err)
    return report


def _to_gguf(ckpt: Int4Checkpoint, out: Path, report: ConvertReport, exact: bool, progress) -> None:
    cfg = ckpt.cfg
    names = ckpt.tensor_names()
    types = {n: _planned_type(ckpt, n, exact) for n in names}
    plan = [TensorPlan(n, (cfg.n_embd,) if n == "output_norm.weight" else tensor_shape(cfg, n), _ggml(types[n]))
            for n in names]
    int4_types = [t for n, t in types.items() if ckpt.is_quantized(n) and t != "f16"]
    file_type = _FILE_TYPE.get(max(set(int4_types), key=int4_types.count)) if int4_types else None

    def data():
        for i, n in enumerate(names):
            w = ckpt.float16_stored(n) if types[n] == "f16" else None
            if w is None:
                w = ckpt.weight(n)
            if isinstance(w, Int4):
                t, raw, st = store(n, w, exact)
                if t != types[n]:
                    raise QuantizationError(f"internal: {n} planned as {types[n]}, stored as {t}")
                report.add(st)
                yield raw
            else:
                yield np.ascontiguousarray(w, dtype=np.float16 if types[n] == "f16" else np.float32)
            if progress is not None:
                progress(n, i + 1, len(names))

    write_gguf(out, cfg.arch, [*source_kv(ckpt), *_metadata(ckpt, report, types, exact)], plan, data(), file_type)


def _to_onnx(ckpt: Int4Checkpoint, out: Path, report: ConvertReport, n_ctx, accuracy_level, force, progress) -> None:
    meta = {"edgerun.quant.method": "import", "edgerun.import.source_format": report.scheme,
            "edgerun.import.group_size": report.group_size, "edgerun.import.zero_point": report.zero_point,
            "edgerun.source.sha256": ckpt.sha256(), "edgerun.source.name": ckpt.name, "edgerun.version": __version__}
    view = CheckpointView(ckpt, meta)
    say = (lambda msg: progress(msg, 0, 0)) if progress is not None else None
    export_onnx(ckpt.path, out, n_ctx=n_ctx, accuracy_level=accuracy_level, force=force, progress=say, source=view)
    conv = read_config(out).conversions
    for n, note in conv.items():
        report.storage[note] = report.storage.get(note, 0) + 1
