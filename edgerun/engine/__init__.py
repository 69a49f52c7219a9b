"""Concurrency in one room: the threads and hand-offs that run the decode loops.

- `thread.py`: the engine thread that evaluates every multi-sequence context (`on_engine`,
  `on_engine_later`) and steps drivers between calls (`attach_driver`, `signal_engine`).
- `batch.py`: continuous batching, `BatchGroup` (several decode loops' rows in one step); `inline.py`: its
  members stepped as greenlets of the engine thread, and `blocking()` for a wait inside one;
  `sequence.py`: `SeqBackend`, one sequence of a shared context as a Backend.
- `handoff.py`: hand-offs to other threads made as the next native evaluation begins (`defer`, `flush`).
- `packing.py`: the llama.cpp sequence id of each generation slot, kept packed (`SeqPacking`).

What the rest of edgerun uses is named here; the serve scheduler keeps queueing, admission and deadlines.
"""

from __future__ import annotations

from .batch import ADMIT_GRACE_S, YIELD_GRACE_S, BatchGroup, SeqBackend, blocking
from .handoff import defer, flush
from .packing import SeqPacking
from .thread import attach_driver, on_engine, on_engine_later, signal_engine

__all__ = ["ADMIT_GRACE_S", "YIELD_GRACE_S", "BatchGroup", "SeqBackend", "SeqPacking", "attach_driver", "blocking",
           "defer", "flush", "on_engine", "on_engine_later", "signal_engine"]
