"""What the server's handlers share (_State, on app.state.edgerun): the config, the scheduler, the metrics,
the model's names and integrity (how the models are loaded: loading.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import EdgerunError
from ..speculative.history import SuffixHistory
from . import promptcache
from . import systemd as service
from .metrics import GenerationRecord, Metrics
from .protocol import APIError
from .scheduler import JobResult, Scheduler
from .settings import ServerConfig

log = logging.getLogger(__name__)


class _State:
    """Everything the handlers share. Lives on app.state.edgerun."""

    def __init__(self, config: ServerConfig, load: Callable[[], Any], request_exit: Callable[[], None]) -> None:
        self.config = config
        self.metrics = Metrics(model=config.model)
        self.request_exit = request_exit
        cache = promptcache.sized(config.prompt_cache_mib)
        self.scheduler = Scheduler(load, queue_limit=config.queue, on_ready=self._on_ready,
                                   on_load_error=self._on_load_error, on_result=self._on_result, prompt_cache=cache)
        self.scheduler.max_per_client = config.max_per_client
        # earlier answers for suffix drafts, per API key, in RAM only (speculative/history.py); None: off
        self.scheduler.history = SuffixHistory(config.suffix_history) if config.suffix_history else None
        # grammars are vetted on one thread of their own (constrain/sandbox.py): one child at a time, and
        # one malloc arena instead of one per pool thread
        self.vetting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="edgerun-vet")
        self.model_names: set[str] = {config.model}
        if "/" in config.model or config.model.endswith(".gguf"):
            self.model_names.add(Path(config.model).name)
            self.model_names.add(Path(config.model).stem)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self.bound: tuple[str, int] | None = None     # where the watchdog's self-probe connects (run.py sets it)
        self.integrity: dict[str, str] = {}      # registry model -> checking | ok | corrupt (pinned sha256)
        self.lost_worker: str | None = None      # set when an RPC worker of a split model is gone (fatal)
        self.open_paths: set[str] = {"/health"}  # answered without the API key (ui.py adds the page's files)

    @property
    def model_id(self) -> str:
        return self.config.model

    # worker-thread callbacks
    def _on_ready(self, runtime) -> None:
        tok = getattr(runtime, "tokenizer", None)
        if hasattr(tok, "max_token_bytes"):
            tok.max_token_bytes          # computed once here (worker thread), not in a request handler
        log.info("model %s loaded (drafter: %s); ready", self.config.model, getattr(runtime, "draft_name", None))
        if runtime.drafter is None:
            self.metrics.observe_gamma(0)
        service.notify("READY=1", f"STATUS=serving {self.config.model} on {self.config.host}:{self.config.port}")
        threading.Thread(target=self._verify_models, args=(getattr(runtime, "draft_name", None),),
                         name="edgerun-verify", daemon=True).start()
        if getattr(runtime, "cluster", None) is not None:
            threading.Thread(target=self._watch_workers, args=(runtime.cluster,), name="edgerun-workers",
                             daemon=True).start()

    def _watch_workers(self, cluster, interval: float = 0.5) -> None:
        """An idle server notices a lost RPC worker too: /health answers 503 `worker_lost`, the error names
        the worker, and the server exits non-zero (a generation that meets the dead worker ends the process
        at once through the abort hook, _exit_lost_worker)."""
        from ..cluster.rpc import describe_loss

        while not cluster.lost():
            time.sleep(interval)
        self.lost_worker = describe_loss(cluster.endpoints)
        log.error("%s; stopping (systemd restarts the service)", self.lost_worker)
        service.notify(f"STATUS={self.lost_worker}")
        time.sleep(1.0)                       # load balancers see the 503 before the socket closes
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.request_exit)

    def _verify_models(self, draft_name: str | None) -> None:
        """After a load, re-hash the cached registry files against their pinned sha256 (same-size
        corruption, e.g. SD-card bit rot, passes every load check). A mismatch is logged as an error
        and /health answers 503 `corrupt_model`: the answers of a corrupt file are garbage."""
        from ..registry.fetch import verify_cached
        from ..registry.manifest import get_manifest

        for name in (self.config.model, draft_name):
            if not name or "@" in name or name in ("auto", "none", "lookup", "suffix"):
                continue
            try:
                get_manifest(name)
            except EdgerunError:
                continue                         # a path: nothing pins its content
            self.integrity[name] = "checking"
            try:
                ok = verify_cached(name)
            except OSError as e:
                log.error("could not re-read the cached model %s: %s", name, e)
                ok = False
            self.integrity[name] = "ok" if ok else "corrupt"
            if ok:
                log.info("cached model %s matches its pinned sha256", name)
            else:
                log.error("CACHED MODEL %s IS CORRUPT: its file no longer matches the sha256 its manifest pins; "
                          "answers are unreliable. Run `edgerun pull %s --verify` and restart the service.",
                          name, name)
                service.notify(f"STATUS=corrupt model file: {name} (edgerun pull {name} --verify)")

    def _on_load_error(self, exc: BaseException) -> None:
        service.notify(f"STATUS=failed to load the model: {exc}")
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.request_exit)

    def _on_result(self, res: JobResult) -> None:
        st = res.stats
        self.metrics.record_generation(GenerationRecord(
            n_prompt_tokens=res.n_prompt_tokens, n_tokens=res.n_tokens,
            t_decode_s=max(0.0, st.t_total_s - st.t_prefill_s), n_drafted=st.n_drafted,
            n_accepted=st.n_accepted, gamma_mean=st.gamma_mean if st.n_cycles else None, ttft_s=res.ttft_s,
            outcome=res.outcome))

    # event-loop side
    def begin_drain(self) -> None:
        if not self.scheduler.draining:
            log.info("shutting down: no new requests; the running one has %.0f s to finish",
                     self.config.shutdown_grace_s)
            service.notify("STOPPING=1", "STATUS=shutting down")
        self.scheduler.drain(self.config.shutdown_grace_s)

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"model {name!r} is not served here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")


def _gpu_dict(runtime) -> dict | None:
    gpu = getattr(runtime, "gpu", None)
    return gpu.to_dict() if gpu is not None else None


def _drafter_dict(runtime) -> dict | None:
    from ..speculative.lazy import describe

    return describe(getattr(runtime, "drafter", None))
