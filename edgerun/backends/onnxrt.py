"""onnxruntime backend: runs a directory written by `edgerun export onnx` (edgerun/onnx/).

The KV cache is one preallocated [1, n_head_kv, n_ctx, head_dim] buffer per layer and per K/V,
bound as both `past_key_values.N.*` and `present.N.*` (GroupQueryAttention's shared-buffer mode):
a forward pass writes only the new positions in place, and `truncate(n)` is free -- positions past
n are simply not counted in the attention mask any more. Logits are computed only for the
positions asked for (`num_logits_to_keep`).

Per step the Python side does no allocation but the returned logits: input_ids, attention_mask and
num_logits_to_keep live in buffers preallocated once and are bound by pointer, and onnxruntime
writes the logits straight into the array `eval` returns (no copy).

On Linux the memory onnxruntime allocated for the weights while loading (its prepacked MatMulNBits
blocks) is collapsed into transparent huge pages (madvise MADV_COLLAPSE, Linux >= 6.1): every decode
step streams all weights, and 2 MiB pages instead of 4 KiB ones cut the CPU time per token (~7% on
SmolLM2-135M here) for a one-time cost at load (~0.4 s per 200 MB).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import psutil

from .base import CachedTokens, check_eval
from ..config import BackendArgs
from ..errors import BackendError, InvalidArgument, ModelFormatError
from ..onnx.layout import LOGITS_TO_KEEP, OnnxModelConfig, past_key, past_value, present_key, present_value, read_config
from ..tokenizer import Tokenizer
from ..engine import handoff
from ..util import hugepages

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
# Short names a device profile or the command line may use for onnxruntime's execution providers.
PROVIDER_ALIASES = {
    "cpu": CPU,
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "trt": "TensorrtExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "dml": "DmlExecutionProvider",
    "directml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
}
_GPU_MEMORY = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda"}


def _ort():
    try:    # lazily: onnxruntime is the optional 'onnx' extra
        import onnxruntime
    except ImportError as e:  # pragma: no cover - depends on the install
        raise BackendError(f"onnxruntime is not installed ({e}); install it with "
                           f"`pip install 'edgerun[onnx]'` to run ONNX models") from e
    return onnxruntime


def select_providers(requested: Sequence[str], available: Sequence[str] | None = None) -> list[str]:
    """The requested execution providers this onnxruntime has, in order, CPU always last.

    A provider that is not available is skipped with a warning naming what is available, so a
    profile written for a Jetson (CUDA) still runs on a CPU-only install.
    """
    available = list(_ort().get_available_providers() if available is None else available)
    chosen: list[str] = []
    for r in requested:
        name = PROVIDER_ALIASES.get(str(r).lower(), str(r))
        if name in available:
            if name not in chosen:
                chosen.append(name)
        else:
            log.warning("onnxruntime execution provider %r is not available in this onnxruntime "
                        "(available: %s); skipping it", r, ", ".join(available))
    if CPU in chosen:
        chosen.remove(CPU)
    chosen.append(CPU)
    if requested and PROVIDER_ALIASES.get(str(requested[0]).lower(), str(requested[0])) != chosen[0]:
        log.warning("running on %s instead of the requested %s", chosen[0], requested[0])
    return chosen


def default_threads() -> int:
    return max(1, psutil.cpu_count(logical=False) or psutil.cpu_count() or 1)


class OnnxBackend(CachedTokens):
    """One exported ONNX decoder + its KV cache in onnxruntime."""

    def __init__(self, path: str | Path, args: BackendArgs | None = None) -> None:
        args = args or BackendArgs()
        ort = _ort()
        before = hugepages.anon_ranges() if args.huge_pages else {}   # what onnxruntime adds from here: the weights
        self.path = Path(path)
        self.config: OnnxModelConfig = read_config(self.path)
        cfg = self.config
        self.name = f"onnxruntime:{self.path.name}"
        self.tokenizer = Tokenizer.from_gguf(self.path / cfg.tokenizer_file)
        if self.tokenizer.vocab_fingerprint != cfg.vocab_fingerprint:
            raise ModelFormatError(
                f"{self.path}: the vocabulary of {cfg.tokenizer_file} (fingerprint "
                f"{self.tokenizer.vocab_fingerprint[:12]}) does not match edgerun.json "
                f"({cfg.vocab_fingerprint[:12]}); expected the files of one export -- re-export the model")
        if self.tokenizer.n_vocab > cfg.model.n_vocab:
            raise ModelFormatError(f"{self.path}: the tokenizer has {self.tokenizer.n_vocab} tokens but the "
                                   f"graph only {cfg.model.n_vocab} logits; expected tokenizer <= logits")
        self.n_threads = args.n_threads or default_threads()
        self.providers = self._open_session(ort, select_providers(args.providers))
        if self.providers[0] == CPU:
            hugepages.collapse_new_memory(before, self.path.name, "onnxruntime's weight memory")
        self._check_graph()

        self.n_ctx = args.n_ctx
        if self.n_ctx > cfg.n_ctx:
            log.info("n_ctx %d exceeds the %d positions %s was exported for; using %d "
                     "(re-export with a larger --n-ctx for more)", args.n_ctx, cfg.n_ctx, self.path.name, cfg.n_ctx)
            self.n_ctx = cfg.n_ctx
        self.n_batch = max(1, min(args.n_batch, self.n_ctx))
        self.n_vocab: int = cfg.model.n_vocab
        self.weight_bytes: int = cfg.weight_bytes
        self.tokens: list[int] = []

        # KV buffers, shared between past and present: [1, n_head_kv, n_ctx, head_dim] per layer and K/V
        device = _GPU_MEMORY.get(self.providers[0], "cpu")
        shape = (1, cfg.model.n_head_kv, self.n_ctx, cfg.model.head_dim)
        self._kv = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32), device, 0)
                    for _ in range(2 * cfg.model.n_layer)]
        self._io = self._sess.io_binding()
        # step inputs, preallocated: a step writes its values in place and binds them by pointer
        self._ids = np.zeros((1, self.n_batch), dtype=np.int64)     # [1, n_batch]: a chunk's token ids
        self._mask = np.ones((1, self.n_ctx), dtype=np.int64)       # [1, n_ctx]: a step binds [1, n_past + n]
        self._keep = np.zeros(1, dtype=np.int64)                    # [1]: num_logits_to_keep
        self._scratch = np.empty((1, self.n_vocab), dtype=np.float32)   # logits of a chunk nobody asked for
        self._ids_ptr, self._mask_ptr, self._keep_ptr = (a.ctypes.data for a in (self._ids, self._mask, self._keep))
        # On the CPU provider a pointer binding is zero-copy: onnxruntime reads the buffer when it runs,
        # so input_ids (while its length stays) and num_logits_to_keep need no rebinding per step. Other
        # providers copy a host input to the device when it is bound: rebind every step there.
        self._rebind_all = self.providers[0] != CPU
        self._bound_n = 0                                           # length input_ids is bound with (0: none)
        if not self._rebind_all:
            self._io.bind_input(LOGITS_TO_KEEP, "cpu", 0, np.int64, (1,), self._keep_ptr)
        for i in range(cfg.model.n_layer):
            k, v = self._kv[2 * i], self._kv[2 * i + 1]
            self._io.bind_ortvalue_input(past_key(i), k)
            self._io.bind_ortvalue_input(past_value(i), v)
            self._io.bind_ortvalue_output(present_key(i), k)
            self._io.bind_ortvalue_output(present_value(i), v)

    # -- setup ------------------------------------------------------------------------------------
    def _open_session(self, ort, providers: list[str]) -> list[str]:
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.n_threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3          # errors only
        # no busy-waiting between ops: a target and a drafter (two sessions) alternate, and spinning
        # worker threads of the idle one steal the cores of the busy one (measured 3x slower decode
        # on 2 cores with any other load); see README "ONNX backend"
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model = str(self.path / self.config.model_file)
        try:
            self._sess = ort.InferenceSession(model, so, providers=providers)
        except Exception as e:             # onnxruntime raises its own (pybind) exception types
            if providers == [CPU]:
                raise ModelFormatError(f"onnxruntime cannot load {model}: {_first_line(e)}; "
                                       f"expected a graph written by `edgerun export onnx`") from e
            log.warning("onnxruntime could not start %s (%s); falling back to %s",
                        providers[0], _first_line(e), CPU)
            return self._open_session(ort, [CPU])
        used = list(self._sess.get_providers())
        if used[0] != providers[0]:
            log.warning("onnxruntime did not start %s; running on %s", providers[0], used[0])
        log.info("%s: onnxruntime %s on %s, %d threads", self.path.name, ort.__version__, used[0], self.n_threads)
        return used

    def _check_graph(self) -> None:
        cfg = self.config
        ins = {i.name: i for i in self._sess.get_inputs()}
        outs = {o.name: o for o in self._sess.get_outputs()}
        want_in = ["input_ids", "attention_mask"] + [n for i in range(cfg.model.n_layer) for n in (past_key(i), past_value(i))]
        want_out = ["logits"] + [n for i in range(cfg.model.n_layer) for n in (present_key(i), present_value(i))]
        missing = [n for n in want_in if n not in ins] + [n for n in want_out if n not in outs]
        if missing:
            raise ModelFormatError(
                f"{self.path / cfg.model_file} lacks {len(missing)} of the inputs/outputs edgerun.json implies "
                f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); expected a decoder with "
                f"input_ids, attention_mask, past_key_values.N.key/value and logits, present.N.key/value "
                f"for N < {cfg.model.n_layer}")
        overridable = {i.name for i in self._sess.get_overridable_initializers()}
        if LOGITS_TO_KEEP not in ins and LOGITS_TO_KEEP not in overridable:
            raise ModelFormatError(f"{self.path / cfg.model_file} has no {LOGITS_TO_KEEP} input; "
                                   f"re-export the model with this edgerun")
        shp = ins[past_key(0)].shape
        if len(shp) != 4 or shp[1] != cfg.model.n_head_kv or shp[3] != cfg.model.head_dim:
            raise ModelFormatError(f"{self.path / cfg.model_file}: {past_key(0)} has shape {shp}, expected "
                                   f"[batch, {cfg.model.n_head_kv}, past, {cfg.model.head_dim}] as edgerun.json says")
        v = outs["logits"].shape[-1]
        if isinstance(v, int) and v != cfg.model.n_vocab:
            raise ModelFormatError(f"{self.path / cfg.model_file}: logits have {v} entries, edgerun.json "
                                   f"says n_vocab {cfg.model.n_vocab}; re-export the model")

    # -- Backend protocol ---------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int], n_logits: int | None = None) -> np.ndarray:
        tokens, k = check_eval(self, tokens, n_logits)
        n = len(tokens)
        out = np.empty((k, self.n_vocab), dtype=np.float32)
        first = n - k                                    # first position whose logits are returned
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            end = start + len(chunk)
            want = max(0, end - max(start, first))       # requested positions inside this chunk (its last ones)
            # onnxruntime writes the chunk's last `want` rows straight into out (the scratch row when none)
            self._forward(chunk, out[end - want - first:end - first] if want else self._scratch)
        return out

    def _forward(self, chunk: list[int], logits: np.ndarray) -> None:
        """Append chunk to the cache; the logits of its last len(logits) positions go into `logits` [k, n_vocab]."""
        n, n_keep = len(chunk), len(logits)
        io, i64 = self._io, np.int64
        self._ids[0, :n] = chunk
        self._keep[0] = n_keep
        if n != self._bound_n or self._rebind_all:
            io.bind_input("input_ids", "cpu", 0, i64, (1, n), self._ids_ptr)
            self._bound_n = n
        if self._rebind_all:
            io.bind_input(LOGITS_TO_KEEP, "cpu", 0, i64, (1,), self._keep_ptr)
        io.bind_input("attention_mask", "cpu", 0, i64, (1, self.n_past + n), self._mask_ptr)
        io.bind_output("logits", "cpu", 0, np.float32, (1, n_keep, self.n_vocab), logits.ctypes.data)
        handoff.flush()                    # tokens handed to other threads: their Python runs beside this
        handoff.native(True)
        try:
            self._sess.run_with_iobinding(io)
        except Exception as e:             # onnxruntime's pybind exceptions have no common base
            raise BackendError(f"onnxruntime failed at position {self.n_past}: {_first_line(e)}") from e
        finally:
            handoff.native(False)
        self.tokens.extend(chunk)

    def truncate(self, n: int) -> None:
        if n < 0:
            raise InvalidArgument(f"truncate needs n >= 0, got {n}")
        # positions >= n stay in the buffers but fall outside the attention mask; the next eval
        # overwrites them in place
        del self.tokens[n:]

    def close(self) -> None:
        self._io = None
        self._kv = []
        self._sess = None

    def __enter__(self) -> "OnnxBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__
