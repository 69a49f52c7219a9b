"""Quantization pipeline: load -> calibrate -> AWQ per block (with fallback) -> pack -> write GGUF.

Streaming: the source is read one block at a time (dequantized on demand), calibration
activations of one block are held at once, and each block's packed tensors are written to the
output file as soon as they are ready. The file appears only when complete (formats.gguf.write_gguf).

Per block, for each scale group (in reverse order, so that a group whose 1/s is folded into a
linear of an earlier group is decided before that linear is quantized; by default only the groups
after a norm, q/k/v and gate/up, search scales, see `awq_block`) three candidates are scored by
the group's output error on calibration tokens, and the best is kept:
  awq   AWQ scale s (grid search scored with round-to-nearest; the RESCORE best scored again with
        their per-block d/m search) + per-block d/m search on the scaled weights,
  clip  s = 1 + per-block d/m search,
  rtn   plain round-to-nearest (the fallback; AWQ never makes a group worse than this).
RTN (`method="rtn"`) is the same pipeline with the search skipped: byte-identical to gguf.quants.
"""

from __future__ import annotations

import logging
import os
import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ..version import __version__
from ..formats.arch import ModelConfig, tensor_shape
from ..eval.texts import load_text, token_sequences, tokens_sha256
from ..config import QuantArgs
from ..errors import InvalidArgument, QuantizationError
from ..formats.gguf import KV, GGUFSource, TensorPlan, hparam_kv, source_kv, write_gguf
from ..formats.hf import HFSource
from ..formats.source import open_source
from ..tokenizer import Tokenizer
from ..util.atomic import check_destination, raise_if_stopped
from ..reference.llama import block_forward
from . import awq
from . import blocks as F

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]     # (message, done, total)
RESCORE = 3          # AWQ scale candidates (best by round-to-nearest) rescored with searched block params
# Per-format default of the block search's importance: False = E[x_j^2] per input channel (what AWQ
# collects), True = also sqrt(sigma2 + w^2) per element (`blocks.element_importance`). Measured with
# bench/awq_ablation.py at 16 windows: on Qwen2.5-Coder-0.5B Q4_1 it lowered AWQ's perplexity from
# 39.35 to 38.76 (wiki) and 4.878 to 4.859 (code) (measured with the earlier all-group scaling); on
# SmolLM2-135M Q4_0 it is level (21.966 / 7.857 -> 22.113 / 7.827, paired intervals containing 1),
# so Q4_0 keeps the channel statistic alone.
ELEMENT_IMPORTANCE = {"q4_0": False, "q4_1": True, "iq4_nl": False}
FILE_TYPE = {"q4_0": 2, "q4_1": 3, "iq4_nl": 25, "q4_k": 14}   # LLAMA_FTYPE_MOSTLY_Q4_0 / _Q4_1 / _IQ4_NL / _Q4_K_S


@dataclass(frozen=True)
class GroupReport:
    layer: int
    group: str
    choice: str              # "awq" | "clip" | "rtn"
    alpha: float | None
    loss_rtn: float          # output error of round-to-nearest on the scoring tokens
    loss: float              # output error of what was stored


@dataclass
class QuantReport:
    out: str
    method: str
    format: str
    source: str
    n_layer: int
    calib_name: str = ""
    calib_tokens: int = 0
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    groups: list[GroupReport] = field(default_factory=list)

    @property
    def error_reduction(self) -> float:
        """1 - sum(loss) / sum(loss_rtn) over every group (0 for rtn)."""
        r = sum(g.loss_rtn for g in self.groups)
        return 0.0 if r == 0 else 1.0 - sum(g.loss for g in self.groups) / r

    def to_dict(self) -> dict:
        d = asdict(self)
        d["error_reduction"] = self.error_reduction
        return d


def _ggml(name: str):
    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
            "q4_1": gguf.GGMLQuantizationType.Q4_1, "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL,
            "q4_k": gguf.GGMLQuantizationType.Q4_K}[name]


def _kind(cfg: ModelConfig, name: str) -> str:
    """'embed' (token_embd/output), 'linear' (a block matrix) or 'f32' (norms, biases, rope_freqs)."""
    if name in ("token_embd.weight", "output.weight"):
        return "embed"
    parts = name.split(".")
    if parts[0] == "blk" and parts[-1] == "weight" and parts[2] in cfg.spec.linears:
        return "linear"
    return "f32"


def _kept(src, name: str, stored: str, args: QuantArgs) -> np.ndarray | None:
    """A round-to-nearest run keeps a tensor the source already stores in its target type byte for byte:
    rounding its dequantized values again could only add error (a Q4_K_M file's Q4_K tensors stay exact
    in a q4_k output; only its Q6_K ones are requantized)."""
    if args.method != "rtn" or stored in ("f32", "f16") or not isinstance(src, GGUFSource):
        return None
    if src.tensor_type(name) != _ggml(stored):
        return None
    return np.asarray(src.raw(name), dtype=np.uint8)


def _store(kind: str, a: np.ndarray, args: QuantArgs, params: F.BlockParams | None = None) -> np.ndarray:
    if kind == "embed":
        return a.astype(np.float16) if args.embed_type == "f16" else F.pack(args.embed_type, a)
    if kind == "linear":
        return F.pack(args.format, a, params)
    return np.ascontiguousarray(a, dtype=np.float32)


def _check_finite(name: str, a: np.ndarray) -> np.ndarray:
    if not np.isfinite(a).all():
        raise QuantizationError(f"tensor {name} has {int((~np.isfinite(a)).sum())} NaN/inf values; "
                                "expected finite weights")
    return a


def _kv_tie(cfg: ModelConfig) -> np.ndarray:
    """o-proj input channel (h*hd + j) -> the v channel it reads ((h // n_rep) * hd + j)."""
    c = np.arange(cfg.n_head * cfg.head_dim)
    return (c // cfg.head_dim // cfg.n_rep) * cfg.head_dim + c % cfg.head_dim


def awq_block(cfg: ModelConfig, fmt: str, w: dict[str, np.ndarray], x: np.ndarray, grid: int,
              n_search: int, rng: np.random.Generator, layer: int = 0, rescore: int = RESCORE,
              element: bool | None = None, scales: bool = True, scale_after_linear: bool = False,
              ) -> tuple[dict[str, np.ndarray], dict[str, F.BlockParams | None], np.ndarray, list[GroupReport]]:
    """AWQ on one block. w: block tensors ('attn_q.weight', ...) float32; x [B, T, d] block input.

    rescore: how many of the best (by round-to-nearest) scale candidates are scored again with
    their searched block params; element: weight the block search by `blocks.element_importance`
    (None: the format's default in ELEMENT_IMPORTANCE); scales=False skips AWQ's scale search (the
    candidates are then the block search and round-to-nearest only; an ablation); scale_after_linear
    also searches scales for the groups whose 1/s folds into a linear (o after v, down after up), as
    the AWQ paper does. It is off by default: measured with bench/awq_ablation.py (16 windows, paired
    95% intervals), turning those scales off lowered SmolLM2-135M Q4_0's perplexity by 2.4% / 1.5%
    (wiki / code) and raised Qwen2.5-Coder-0.5B Q4_0's by 2.6% on wiki (level on code); Qwen Q4_1
    was level (38.76 / 4.859 with, 38.87 / 4.851 without). Not a reliable gain, then; skipping
    them also shortens 0.5B's quantization (Q4_0: 576 s against 802 s, each measured alone on the
    2-core machine; down's n_ff input channels are the largest search).

    Returns (folded float weights, block params per linear (None = round-to-nearest), the float
    block output [B, T, d] (the next block's input), one report per scale group).
    """
    if element is None:
        element = ELEMENT_IMPORTANCE[fmt]
    rec: dict[str, np.ndarray] = {}
    x_out, _, _ = block_forward(cfg, w, x, 0, None, rec)
    w = {k: v.copy() for k, v in w.items()}
    params: dict[str, F.BlockParams | None] = {}
    reports = []
    rowscale: dict[str, np.ndarray] = {}            # linear -> divisor of its rows (a later group's s)
    for g in reversed(cfg.spec.groups):
        xg = rec[g.name]
        xg = xg.reshape(-1, xg.shape[-1])                                   # [B*T, in]
        st = awq.group_stats(xg, n_search, rng)
        names = [l + ".weight" for l in g.linears]
        ws = [w[n] / rowscale[l][:, None] if l in rowscale else w[n] for n, l in zip(names, g.linears)]
        xs = st.x_search
        refs = [xs @ wi.T for wi in ws]
        tie = _kv_tie(cfg) if g.repeat_kv else None
        scaled = scales and (scale_after_linear or g.prev_kind == "norm")
        sr = awq.search_scale(fmt, ws, st, grid, tie, rescore, element) if scaled else None
        loss_rtn = sr.loss_rtn if sr is not None else awq.output_error(fmt, ws, xs, None, refs)
        cands = [("rtn", None, [None] * len(ws), loss_rtn)]
        ones = np.ones(xs.shape[1], np.float32)
        pc = [awq.choose_block_params(fmt, wi, st, ones, element) for wi in ws]
        cands.append(("clip", None, pc, awq.output_error(fmt, ws, xs, None, refs, pc)))
        if sr is not None and sr.params is not None:
            cands.append(("awq", sr, list(sr.params), sr.loss))
        elif sr is not None and sr.alpha is not None:
            pa = [awq.choose_block_params(fmt, wi * sr.s, st, sr.s, element) for wi in ws]
            cands.append(("awq", sr, pa, awq.output_error(fmt, ws, xs, sr.s, refs, pa)))
        choice, res, ps, loss = min(cands, key=lambda c: c[3])
        s = res.s if res is not None else None
        for n, l, wi, p in zip(names, g.linears, ws, ps):
            w[n] = wi * s if s is not None else wi
            params[n] = p
        if s is not None:                                                    # fold 1/s into prev
            if g.prev_kind == "norm":
                w[g.prev + ".weight"] = w[g.prev + ".weight"] / s
            else:
                rowscale[g.prev] = res.s_tied
        reports.append(GroupReport(layer, g.name, choice, None if res is None else res.alpha, loss_rtn, loss))
    for l, sc in rowscale.items():                                           # prev linears' biases
        b = l + ".bias"
        if b in w:
            w[b] = w[b] / sc
    return w, params, x_out, list(reversed(reports))


def _calibration(src, path_for_vocab: Path, args: QuantArgs, cfg: ModelConfig):
    """(name, token sequences [n_seq, seq_len]) from the calibration text with the model's tokenizer."""
    name, text = load_text(args.calib)
    tok = Tokenizer.from_gguf(path_for_vocab)
    seq_len = min(args.seq_len, cfg.n_ctx_train)
    if args.calib_tokens < seq_len:
        seq_len = args.calib_tokens
    bos = tok.bos_id if tok.add_bos and tok.bos_id >= 0 else None
    seqs = token_sequences(text, lambda t: tok.tokenize(t, special=False, add_bos=False),
                           args.calib_tokens, seq_len, bos)
    if seqs.max() >= cfg.n_vocab:
        raise QuantizationError(f"tokenizer produced id {seqs.max()} >= n_vocab {cfg.n_vocab}; "
                                "the tokenizer does not match the weights")
    return name, seqs


def _vocab_gguf(src: HFSource, directory: Path) -> Path:
    """A weightless GGUF holding the HF checkpoint's tokenizer, for llama.cpp's tokenizer."""
    p = directory / "vocab.gguf"
    write_gguf(p, src.cfg.arch, [*hparam_kv(src.cfg), *src.tokenizer_kv()], [], iter(()))
    return p


def check_request(out: str | os.PathLike, args: QuantArgs) -> None:
    """What can be refused before any work (and before a registry model is pulled): the output path and
    the target format."""
    out = Path(out)
    if out.exists() and out.is_dir():
        raise QuantizationError(f"{out} is a directory; expected an output .gguf file path")
    check_destination(out)          # before the work: never replace a device node, FIFO or symlink
    if args.format not in FILE_TYPE:
        raise QuantizationError(f"target format {args.format!r} is not supported; expected one of {sorted(FILE_TYPE)}")


def quant_args(args: QuantArgs | None, options: dict) -> QuantArgs:
    """`args`, or a QuantArgs made from keyword options (not both)."""
    if args is None:
        return QuantArgs(**options)
    if options:
        raise InvalidArgument(f"pass either a QuantArgs or keyword options, not both (got {sorted(options)})")
    return args


def quantize(source: str | os.PathLike, out: str | os.PathLike, args: QuantArgs | None = None, *,
             progress: Progress | None = None, n_search: int = 512, seed: int = 0,
             block_options: dict | None = None, **options) -> QuantReport:
    """Quantize a GGUF file or HF checkpoint directory to an INT4 GGUF at `out`; return a report.
    (A registry name is resolved by edgerun.resolve.quantize, which is edgerun.quantize.)

    `args` (or the same fields as keyword options: method="awq", format="q4_0", calib="builtin",
    calib_tokens=4096, embed_type="q8_0", grid=20) chooses what is done; n_search calibration
    tokens score the candidates; seed picks them (the result is deterministic for a seed).
    block_options go to `awq_block` (element=, scales=, scale_after_linear=: the ablations of
    bench/awq_ablation.py).
    """
    args = quant_args(args, options)
    t0 = time.perf_counter()
    out = Path(out)
    check_request(out, args)
    spec = os.fspath(source)
    src = open_source(spec)
    cfg = src.cfg
    linear_in = {cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_ff}
    block = F.QK_K if args.format == "q4_k" else F.QK
    if any(k % block for k in linear_in):
        raise QuantizationError(f"input dimensions {sorted(linear_in)} must be multiples of {block} for {args.format}"
                                + (" (llama.cpp's Q4_K super-block): use q4_0 or iq4_nl for this model"
                                   if block == F.QK_K else ""))
    if args.embed_type == "q4_k" and cfg.n_embd % F.QK_K:
        raise QuantizationError(f"embedding width {cfg.n_embd} is not a multiple of {F.QK_K} for embed_type q4_k; "
                                "use q4_0, iq4_nl or q8_0")
    report = QuantReport(str(out), args.method, args.format, src.name, cfg.n_layer)

    with tempfile.TemporaryDirectory(prefix="edgerun-quant-") as tmp:
        seqs = None
        if args.method == "awq":
            vocab_path = src.path if isinstance(src, GGUFSource) else _vocab_gguf(src, Path(tmp))
            report.calib_name, seqs = _calibration(src, vocab_path, args, cfg)
            report.calib_tokens = int(seqs.size)
        plan = tensor_plan(src, args)
        T = gguf.GGUFValueType
        meta = [KV("edgerun.quant.method", args.method, T.STRING), KV("edgerun.quant.format", args.format, T.STRING),
                KV("edgerun.quant.block_size", F.QK, T.UINT32),
                KV("edgerun.quant.grid", args.grid if args.method == "awq" else 0, T.UINT32),
                KV("edgerun.quant.embed_type", args.embed_type, T.STRING),
                KV("edgerun.calib.sha256", tokens_sha256(seqs) if seqs is not None else "", T.STRING),
                KV("edgerun.calib.n_tokens", report.calib_tokens, T.UINT32),
                KV("edgerun.calib.name", report.calib_name, T.STRING),
                KV("edgerun.source.sha256", src.sha256(), T.STRING),
                KV("edgerun.source.name", src.name, T.STRING),
                KV("edgerun.version", __version__, T.STRING)]
        data = _tensor_data(src, cfg, args, seqs, n_search, seed, report, progress, block_options or {})
        write_gguf(out, cfg.arch, [*source_kv(src), *meta], plan, data, FILE_TYPE[args.format])
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    log.info("quantized %s -> %s in %.1f s (error reduction %.1f%%)", src.name, out, report.seconds,
             100 * report.error_reduction)
    return report


def storage_type(cfg: ModelConfig, name: str, args: QuantArgs) -> str:
    """How `name` is stored: args.embed_type (token_embd/output), args.format (block linears) or f32."""
    return {"embed": args.embed_type, "linear": args.format, "f32": "f32"}[_kind(cfg, name)]


def tensor_plan(src, args: QuantArgs, qtype: Callable[[str], str] | None = None) -> list[TensorPlan]:
    """The output's tensors in source order with their shapes and types (`qtype(name)` overrides
    `storage_type`, e.g. bench/awq_layer_sensitivity.py keeping some layers at q8_0)."""
    cfg = src.cfg
    qtype = qtype or (lambda n: storage_type(cfg, n, args))
    plan = []
    for n in src.tensor_names():
        shape = tuple(int(v) for v in src.tensor(n).shape) if n.startswith(("rope", "output_norm")) \
            else tensor_shape(cfg, n)
        plan.append(TensorPlan(n, shape, _ggml(qtype(n))))
    return plan


def _tensor_data(src, cfg: ModelConfig, args: QuantArgs, seqs, n_search: int, seed: int,
                 report: QuantReport, progress: Progress | None, block_options: dict):
    """Yield the stored arrays in plan order, running AWQ block by block."""
    rng = np.random.default_rng(seed)
    x = None
    for n in src.tensor_names():
        if not n.startswith("blk."):
            kept = _kept(src, n, storage_type(cfg, n, args), args)
            if kept is not None:
                yield kept
                continue
            a = _check_finite(n, src.tensor(n))
            if n == "token_embd.weight" and seqs is not None:
                x = a[seqs].astype(np.float32)                                  # [n_seq, seq_len, d]
            yield _store(_kind(cfg, n), a, args)
            continue
        i, rest = int(n.split(".")[1]), ".".join(n.split(".")[2:])
        if rest != f"{cfg.spec.block[0][0]}.weight":
            continue                                                            # yielded with its block
        raise_if_stopped()                              # a SIGTERM the numerics swallowed stops at the next layer
        prefix = f"blk.{i}."
        bnames = [m for m in src.tensor_names() if m.startswith(prefix)]
        kept = {m: _kept(src, m, storage_type(cfg, m, args), args) for m in bnames}     # (rtn only)
        w = {m[len(prefix):]: _check_finite(m, src.tensor(m)) for m in bnames if kept[m] is None}
        params: dict = {}
        if args.method == "awq":
            w, params, x, reps = awq_block(cfg, args.format, w, x, args.grid, n_search, rng, i, **block_options)
            report.groups.extend(reps)
            r = sum(g.loss_rtn for g in reps)
            red = 0.0 if r == 0 else 1 - sum(g.loss for g in reps) / r
            msg = f"layer {i + 1}/{cfg.n_layer}: output error -{100 * red:.1f}% vs RTN " \
                  f"({', '.join(g.choice for g in reps)})"
        else:
            msg = f"layer {i + 1}/{cfg.n_layer}"
        log.info(msg)
        for m in bnames:
            k = m[len(prefix):]
            yield kept[m] if kept[m] is not None else _store(_kind(cfg, m), w[k], args, params.get(k))
        if progress is not None:
            progress(msg, i + 1, cfg.n_layer)
