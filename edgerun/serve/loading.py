"""How the server's models are loaded: the default loader (edgerun.runtime.load with the config's options),
begun ahead on a thread of its own as soon as the socket is bound (LoadAhead), and the abort hook of a target
split over RPC workers. Light to import: the web stack imports while the models load."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from . import systemd as service
from .settings import ServerConfig

log = logging.getLogger("edgerun.serve.state")


class LoadAhead:
    """A load begun now on its own thread; calling the object waits for it and returns its runtime or raises
    its error (each call the same). The server begins it right after binding its socket, so llama.cpp maps
    the model and clears its KV cache while the web stack imports (they ran one after the other before)."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="edgerun-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._load()
        except BaseException as exc:        # handed to the caller: the scheduler reports every load failure
            self._error = exc

    def __call__(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def default_loader(config: ServerConfig) -> Callable[[], Any]:
    def load():
        from ..runtime import load as load_runtime

        opts = {k: v for k, v in dict(n_ctx=config.n_ctx, n_threads=config.n_threads, gamma=config.gamma).items()
                if v is not None}
        opts["parallel"] = config.parallel          # None: the device profile's
        opts["require_gpu"] = config.require_gpu
        opts["draft_background"] = True             # ready once the target answers (speculative/lazy.py)
        if config.rpc:
            opts.update(rpc=list(config.rpc), tensor_split=list(config.tensor_split) or None,
                        on_lost_worker=_exit_lost_worker)
        opts.update(config.load_opts)
        return load_runtime(config.model, draft=config.draft, profile=config.profile, pull=config.pull, **opts)
    return load


EXIT_LOST_WORKER = 3


def _exit_lost_worker(endpoints, msg: str = "") -> None:
    """The abort hook of a server whose target is split over RPC workers: ggml met a dead worker in the
    middle of a step and cannot continue. Log the worker's name and exit (systemd's Restart= brings the
    service back; its start-up check waits for the worker)."""
    import os

    from ..cluster.rpc import describe_loss

    text = describe_loss(endpoints, msg)
    log.error("%s; exiting with status %d (systemd restarts the service)", text, EXIT_LOST_WORKER)
    service.notify(f"STATUS={text}")
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(EXIT_LOST_WORKER)
