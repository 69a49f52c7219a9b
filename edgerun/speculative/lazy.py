"""The model drafter loaded when it will be used (docs/coldstart.md).

A 0.5B drafter beside a 1.5B target costs half a second of start-up and ~0.5 GB of memory. On a device where
the gamma tuner has learned that drafting with it does not pay (its state is kept per device, model pair and
sampling regime: speculative/tuner_store.py), a one-shot command would load it for nothing. `plan()` decides,
from what is already cached for the pair (the drafter's step time beside the target's cost curve, the tuner's
state), whether the drafter can start unloaded:

- deferred: the stored state says the tuner will not draft soon (speculation off in every class, no warm-up
  left). The drafter is a `LazyDrafter` that loads at the first cycle the tuner does choose to draft (an
  exploration, a switch back on): outside the cycle's timed draft (generate.py asks `load()` before it), so the
  tuner learns no load time as draft time.
- loading (a server only): the state says it drafts; the server answers with the target alone while the
  drafter loads on a thread of its own, and drafts from the cycle after it is loaded.
- joining (a batching server, --parallel above 1): loading on a thread whatever the state says (a batch cannot
  wait for a load); the slots draft from their suffix part meanwhile and get their views of the drafter's
  multi-sequence context together, at a moment no generation runs (SlotDrafters).
- eager (`plan()` returns None): nothing cached for the pair yet (its first run measures the drafter's step),
  a fixed gamma, batching slots outside a server (Runtime.slots of load(parallel=N)), a directory model.

Exactness: an unloaded drafter's hint is the same margin class a loaded one gives (the target's logits decide
it) and its lag is the whole context, as a loaded drafter's that has not drafted yet; so while deferred the
tuner makes the same choices it would with the drafter loaded, and the text is the same. While a server's
drafter is loading its hint is None (nothing to draft), which the tuner counts as no observation of any class;
those cycles run plain, and `describe()` (the `--json` stats' and /health's `drafter`) says so.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np

from ..config import BackendArgs, SamplingArgs, SpeculativeArgs
from ..constrain.base import Constraint
from ..errors import EdgerunError
from .combined import SuffixOrModel
from .drafters import ModelDrafter, margin_class
from .gamma import WARMUP_ALPHA, GammaTuner
from .tuner_store import TunerStore

log = logging.getLogger(__name__)

REGIMES = ("greedy", "sampled")
# a test of the server's readiness holds the background load until this file exists (tests/test_lazy_drafter.py)
GATE_ENV = "EDGERUN_TEST_DRAFT_LOAD_GATE"


class LazyDrafter:
    """A ModelDrafter that is not loaded yet (module docstring). States: deferred (loads at the first draft),
    loading (a thread loads it), loaded, failed (the load raised: the generation runs without drafts)."""

    n_classes = ModelDrafter.n_classes
    vocab_fingerprint = None

    def __init__(self, path: Path, target, args: BackendArgs, spec: SpeculativeArgs, *, name: str, key: str,
                 reason: str) -> None:
        self.path, self.target, self.args, self.spec = Path(path), target, args, spec
        self.name = name
        self.key = key                    # the drafter key the tuner store was found under (predicted)
        self.reason = reason
        self.weight_bytes = self.path.stat().st_size
        self.state = "deferred"
        self.error: str | None = None
        self.load_s: float | None = None
        self._real: ModelDrafter | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- loading ------------------------------------------------------------------------------
    @property
    def deferred(self) -> bool:
        """Not loaded, and loads when asked to draft (generate.py calls load() then, before the timed draft)."""
        return self._real is None and self.state == "deferred"

    @property
    def loaded(self) -> ModelDrafter | None:
        return self._real

    def load(self, *, strict: bool = False) -> None:
        """Load the drafter now (a no-op once loaded or failed). A failure is logged and leaves state 'failed':
        the generation goes on without drafts; strict: it raises instead (a load before the first token)."""
        with self._lock:
            if self._real is not None or self.state == "failed":
                return
            from ..backends import open_backend
            from ..device.costprobe import drafter_key

            t0 = time.perf_counter()
            try:
                gate = os.environ.get(GATE_ENV)
                while gate and self._thread is threading.current_thread() and not os.path.exists(gate):
                    time.sleep(0.05)
                backend = open_backend(self.path, self.args)
                try:
                    real = ModelDrafter(backend, self.target, p_min=self.spec.p_min, name=self.name)
                except BaseException:
                    backend.close()
                    raise
            except (EdgerunError, OSError) as e:
                self.state, self.error = "failed", str(e)
                if strict:
                    raise
                log.warning("the drafter %s could not be loaded (%s); generating without drafts", self.name, e)
                return
            self.load_s = time.perf_counter() - t0
            if drafter_key(real, self.target) != self.key:
                log.warning("the drafter %s loaded with other settings than predicted; the gamma tuner's state is "
                            "kept under the predicted key", self.name)
            self._real = real
            self.state = "loaded"
            log.info("drafter %s loaded in %.2f s (%s)", self.name, self.load_s, self.reason)

    def start_background(self) -> None:
        """Load on a thread of its own (state 'loading'); hint() is None until it is loaded."""
        self.state = "loading"
        self._thread = threading.Thread(target=self._load_quietly, name="edgerun-drafter", daemon=True)
        self._thread.start()

    def _load_quietly(self) -> None:
        try:
            self.load()
        except BaseException as e:       # nothing may escape a thread unseen
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            log.exception("loading the drafter %s failed", self.name)

    def describe(self) -> dict:
        d = {"name": self.name, "state": self.state, "reason": self.reason}
        if self.load_s is not None:
            d["load_s"] = round(self.load_s, 3)
        if self.error:
            d["error"] = self.error
        return d

    # -- the Drafter protocol -----------------------------------------------------------------
    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> int | None:
        real = self._real
        if real is not None:
            return real.hint(context, logits)
        return margin_class(logits) if self.state == "deferred" else None

    def lag(self, context: Sequence[int]) -> int:
        real = self._real
        return real.lag(context) if real is not None else max(len(context), 1)

    def propose(self, context: Sequence[int], gamma: int, sampling: SamplingArgs, rng: np.random.Generator,
                constraint: Constraint | None = None) -> tuple[list[int], np.ndarray | None]:
        if self._real is None and self.state == "deferred":
            self.load()
        real = self._real
        if real is None:
            return [], None
        return real.propose(context, gamma, sampling, rng, constraint)

    def reset(self) -> None:
        if self._real is not None:
            self._real.reset()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._real is not None:
            self._real.close()


class Awaiting:
    """A batching slot's model part while the shared drafter loads on its thread: no model drafts (hint None, as
    a LazyDrafter's while loading), so the slot drafts from its suffix part only. SlotDrafters replaces it."""

    n_classes = ModelDrafter.n_classes
    vocab_fingerprint = None
    deferred = False

    def __init__(self, lazy: LazyDrafter) -> None:
        self.name, self.weight_bytes = lazy.name, lazy.weight_bytes

    def hint(self, context: Sequence[int], logits: np.ndarray | None = None) -> None:
        return None

    def lag(self, context: Sequence[int]) -> int:
        return max(len(context), 1)

    def propose(self, context, gamma, sampling, rng, constraint=None) -> tuple[list[int], None]:
        return [], None

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def joining(drafter) -> LazyDrafter | None:
    """The LazyDrafter a drafter holds (itself or a SuffixOrModel's model part), else None."""
    inner = drafter.model if isinstance(drafter, SuffixOrModel) else drafter
    return inner if isinstance(inner, LazyDrafter) else None


class SlotDrafters:
    """The model drafter of a batching server's slots (--parallel above 1) when it loads after them: ready without
    it (plan(), background). Until it is loaded every slot's model part is an Awaiting; at the first generation
    start after that with no other generation running or being placed (BatchGroup.alone_now), the drafter's
    multi-sequence backend joins the group and every slot gets its own view of it at once, so the slots' views
    always pair (BatchGroup.move). Under a load that never pauses, the slots go on with suffix drafts only."""

    def __init__(self, lazy: LazyDrafter, group) -> None:
        self.lazy, self.group = lazy, group
        self.slots: list = []              # the slots' Runtimes (Runtime.slots appends them)
        self.attached = False
        self._lock = threading.Lock()

    def placeholder(self, drafter):
        return SuffixOrModel(Awaiting(self.lazy)) if isinstance(drafter, SuffixOrModel) else Awaiting(self.lazy)

    def attach_if_quiet(self) -> None:
        """Called by a slot as a generation starts (Runtime._loop), before its drafter is read."""
        real = self.lazy.loaded
        if real is None or self.attached:
            return
        with self._lock:
            if self.attached or not self.group.alone_now():
                return
            self.group.add_backend(real.backend)
            for i, slot in enumerate(self.slots):
                model = copy.copy(real)
                model.backend = self.group.view(real.backend, i)
                model.reset()
                if isinstance(slot.drafter, SuffixOrModel):
                    slot.drafter.model = model
                else:
                    slot.drafter = model
            self.attached = True
            log.info("drafter %s joined the %d generation slots", self.lazy.name, len(self.slots))


def describe(drafter) -> dict | None:
    """The drafter's state for `generate --json` and /health: None without a model drafter."""
    if isinstance(drafter, SuffixOrModel):
        d = describe(drafter.model)
        return None if d is None else {**d, "with_suffix": True}
    if isinstance(drafter, LazyDrafter):
        return drafter.describe()
    if isinstance(drafter, ModelDrafter):
        return {"name": drafter.name, "state": "loaded", "reason": "loaded before the first token"}
    return None


# ---------------------------------------------------------------------------------- the plan

def predicted_key(path: Path, args: BackendArgs, target) -> str | None:
    """costprobe.drafter_key of the drafter this file would load as (backends/llamacpp.py's settings), without
    loading it: the header gives the training context that caps n_batch."""
    from ..backends.llamacpp import default_threads
    from ..device.costprobe import drafter_key
    from ..formats.ggufscan import read_info

    info = read_info(path)
    n_ctx_train = info.arch_int("context_length")
    n_ctx = min(args.n_ctx, n_ctx_train) if n_ctx_train > 0 else args.n_ctx
    be = SimpleNamespace(path=info.path, n_threads=args.n_threads or default_threads(), flash_attn=args.flash_attn,
                         n_batch=min(args.n_batch, n_ctx), name=f"llama.cpp:{info.path.name}")
    return drafter_key(SimpleNamespace(backend=be), target)


def will_draft_soon(tuner: GammaTuner) -> bool:
    """Whether a tuner (restored from its stored state) drafts with the model in its first cycles: speculation on
    in some model class, or a warm-up left where a good drafter could win. Off everywhere, its next model draft is
    an exploration, due explore_every or more cycles in (GammaTuner.choose; a restored tuner starts its count at
    0). The classes of free drafts (a SuffixOrModel's suffix classes) need no model: they do not count."""
    f = tuner.free_classes
    if (tuner._current[f:] > 0).any():
        return True
    s = tuner.settings
    n = tuner._n_drafting
    return bool((n[f:] < s.warmup_cycles).any() and n.sum() < s.warmup_total and tuner._could_win(WARMUP_ALPHA)
                and tuner._could_win())


def plan(draft_path: Path | None, target, args: BackendArgs, spec: SpeculativeArgs, profile, *, parallel: int,
         background: bool = False, combined: bool = False):
    """(LazyDrafter, its GammaTuner, its TunerStore) when the drafter can start unloaded, else None (load it now).
    background: a server: where the state says it drafts, load it on a thread instead of before serving.
    combined: the drafter goes inside a SuffixOrModel (speculative/combined.py): the tuner has its classes."""
    if draft_path is None or spec.gamma is not None or (parallel != 1 and not background) or Path(draft_path).is_dir():
        return None
    from ..device.costprobe import probe_costs, target_key
    from ..device.cost import CostCurve
    from ..device.measurements import probes_dir, read_json

    try:
        tk, dk = target_key(target), predicted_key(Path(draft_path), args, target)
    except (EdgerunError, OSError) as e:
        log.info("drafter loaded now: %s", e)
        return None
    doc = read_json(probes_dir() / f"draft-{dk}.json") if tk and dk else None
    if not isinstance(doc, dict) or not isinstance(doc.get("t_draft"), (int, float)):
        return None                    # its step time is measured with it loaded: the pair's first run
    store = TunerStore.keyed(tk, dk, combined=combined)
    if not any(store.path(r).exists() for r in REGIMES):
        return None                    # nothing learned yet: its first run loads it (and measures nothing twice)
    gmax, model_gmax = spec.limits(profile, combined)
    try:
        tv = probe_costs(target, None, n_max=gmax + 1).t_verify          # cached, or measured on the target
    except (EdgerunError, OSError) as e:
        log.info("drafter loaded now (the target's cost probe failed: %s)", e)
        return None
    free = SuffixOrModel.free_classes if combined else 0
    tuner = GammaTuner(CostCurve(t_verify=tv, t_draft=float(doc["t_draft"]), source="measured"), gamma_max=gmax,
                       n_classes=free + ModelDrafter.n_classes, free_classes=free, model_gamma_max=model_gmax)
    drafts = {}
    for r in REGIMES:
        t = tuner.fresh()
        drafts[r] = will_draft_soon(t) if store.load(t, r) else None
    known = {r: v for r, v in drafts.items() if v is not None}
    if not known:
        return None
    name = str(draft_path)
    said = ", ".join(f"{r}: {'on' if v else 'off'}" for r, v in known.items())
    if parallel != 1:       # batching slots cannot load it in the middle of a batch: on a thread now, always
        why = f"the tuner's stored state: {said}; loading beside the target for the {parallel} generation slots, " \
              f"which answer meanwhile"
        lazy = LazyDrafter(draft_path, target, args, spec, name=name, key=dk, reason=why)
        lazy.start_background()
    elif not any(known.values()):
        why = f"the gamma tuner's stored state for this device and pair drafts no time soon ({said}): loaded at " \
              f"the first cycle that drafts"
        lazy = LazyDrafter(draft_path, target, args, spec, name=name, key=dk, reason=why)
    elif background:
        why = f"the tuner drafts ({said}): loading beside the target, which answers meanwhile"
        lazy = LazyDrafter(draft_path, target, args, spec, name=name, key=dk, reason=why)
        lazy.start_background()
    else:
        # loaded now, as without a plan; the tuner is the one built here (the curve is not measured twice)
        lazy = LazyDrafter(draft_path, target, args, spec, name=name, key=dk,
                           reason=f"the tuner drafts ({said}): loaded before the first token")
        lazy.load(strict=True)
    log.info("drafter %s: %s", name, lazy.reason)
    return lazy, tuner, store
