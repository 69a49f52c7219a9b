"""What the gamma tuner learned, kept between processes: per device, model pair and sampling regime, beside
the probe cache ($EDGERUN_HOME/probes/tuner-<key>-<regime>.json, written atomically).

A CLI call or a service restart then starts where the last one stopped (acceptance per hint class, the
time corrections of the cost curve, the gamma in force, warm-up and exploration done) instead of paying
warm-up and exploration again on every short generation. Greedy and sampled decoding accept drafts at
very different rates, so each regime keeps its own state. An unreadable or mismatched file is ignored.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import SamplingArgs
from ..device.costprobe import drafter_key, target_key
from ..device.measurements import atomic_write_json, key_of, probes_dir, read_json
from .gamma import GammaTuner

log = logging.getLogger(__name__)

# 2: states learned before GammaTuner.lower() may hold a drafter supply driven to ~0 by busy batches
# (speculation off for good); they are not restored
# 3: states learned while batch times fed the time model may hold a load and shape(1) drifted apart, T(n >= 2)
# inflated several times (BatchedGamma.observe); they are not restored either
# 4: states whose load and shape(1) drifted apart along their product (both were learned from plain cycles; now
# shape(1) is 1) may price every draft several times too dear; they are not restored
FORMAT = 4


def regime(sampling: SamplingArgs) -> str:
    """'greedy' or 'sampled': the sampling regimes whose acceptance is learned apart."""
    return "greedy" if sampling.greedy else "sampled"


class TunerStore:
    """Load and save GammaTuner.state() for one target + drafter pair on this device."""

    def __init__(self, key: str) -> None:
        self.key = key

    @classmethod
    def for_pair(cls, target, drafter) -> "TunerStore | None":
        """The store of a loaded pair, or None when the models have no stable identity (then nothing persists)."""
        tk, dk = target_key(target), drafter_key(getattr(drafter, "model", drafter), target)
        if tk is None or dk is None:
            return None
        return cls.keyed(tk, dk, combined=getattr(drafter, "model", None) is not None)

    @classmethod
    def keyed(cls, tk: str, dk: str, *, combined: bool = False) -> "TunerStore":
        """combined: the drafter also offers suffix drafts (speculative/combined.py), whose tuner has classes of
        its own: kept apart from the model drafter's alone."""
        return cls(key_of("tuner", FORMAT, tk, dk, "suffix") if combined else key_of("tuner", FORMAT, tk, dk))

    def path(self, regime_name: str) -> Path:
        return probes_dir() / f"tuner-{self.key}-{regime_name}.json"

    def load(self, tuner: GammaTuner, regime_name: str) -> bool:
        doc = read_json(self.path(regime_name))
        if not isinstance(doc, dict):
            return False
        ok = tuner.restore(doc)
        if ok:
            log.info("gamma tuner (%s): continuing from %s", regime_name, self.path(regime_name).name)
        else:
            log.info("ignoring %s: it does not fit this tuner", self.path(regime_name))
        return ok

    def save(self, tuner: GammaTuner, regime_name: str) -> None:
        try:
            atomic_write_json(self.path(regime_name), tuner.state())
        except OSError as e:        # a read-only cache must not fail a generation
            log.warning("could not save the gamma tuner's state to %s: %s", self.path(regime_name), e)
