"""The head's side of a split model: check the workers, place the layers, check memory, attach the devices.

`plan()` does everything that can fail cleanly, before any model is loaded (status in a child process,
placement, each worker's memory); `Cluster.attach()` then opens ggml's connections in this process and
installs the abort hook that turns a lost worker into one message and an exit (ggml cannot continue).

The target gets the workers' devices through llama_model_params.devices (in --rpc order), so nothing is
registered process-wide: the drafter and any other model stay on the head.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .. import llama_lib
from ..errors import ClusterError, InvalidArgument
from ..formats.ggufscan import read_info
from . import rpc, split
from .status import require_all, status

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    endpoints: tuple[rpc.Endpoint, ...]
    devices: list[split.Device]
    placement: split.Placement
    records: list[dict] = field(default_factory=list)
    handles: list = field(default_factory=list)          # ggml device handles, once attached
    _keep: list = field(default_factory=list)            # ctypes arrays llama.cpp reads during the load

    def attach(self, on_lost: Callable[[Sequence[rpc.Endpoint], str], None] | None = None) -> None:
        """Connect to every worker in this process (ggml keeps the connections) and install the abort hook:
        on_lost(endpoints, ggml's message) (default: one `error:` line naming the lost worker, exit 2)."""
        if on_lost is None:
            rpc.exit_on_lost_worker(self.endpoints)
        else:
            rpc.on_abort(lambda msg: on_lost(self.endpoints, msg))
        handles = []
        for ep in self.endpoints:
            handles.extend(rpc.remote_devices(ep))
        if len(handles) != len(self.devices):
            raise ClusterError(f"the workers now offer {len(handles)} devices, {len(self.devices)} at the status "
                               f"check; did one restart with other --device options?")
        self.handles = handles

    def model_params(self, params) -> None:
        """Point llama_model_params at the workers' devices, with the placement's layers and shares."""
        n_max = int(llama_lib.lib().llama_max_devices())
        devs = (ctypes.c_void_p * (len(self.handles) + 1))(*self.handles, None)
        shares = (ctypes.c_float * max(n_max, len(self.handles)))(*self.placement.shares)
        self._keep = [devs, shares]
        params.devices = ctypes.cast(devs, ctypes.c_void_p)
        params.tensor_split = ctypes.cast(shares, ctypes.POINTER(ctypes.c_float))
        params.n_gpu_layers = self.placement.n_gpu_layers

    def lost(self) -> list[rpc.Endpoint]:
        return rpc.lost_workers(self.endpoints)

    def summary(self) -> str:
        p = self.placement
        parts = [f"head {p.layer_device.count(-1)} layer(s) {split._gib(p.head_bytes + p.head_kv)}"]
        for i, d in enumerate(self.devices):
            parts.append(f"{d.worker} {len(p.layers_of(i))} layer(s) {split._gib(p.device_bytes[i] + p.device_kv[i])}")
        return "; ".join(parts)


def plan(endpoints, tensor_split, target_path: str | Path, *, kv_bytes: int,
         n_gpu_layers: int | None = None) -> Cluster:
    """Check the workers (child process), place the target's layers and check each worker's memory.
    ClusterError / InvalidArgument / MemoryBudgetError with one line naming the worker; nothing is loaded."""
    eps = rpc.parse_endpoints(endpoints)
    shares = split.parse_tensor_split(tensor_split)
    rpc.require_rpc("--rpc")
    p = Path(target_path)
    if p.is_dir():
        raise InvalidArgument(f"--rpc splits GGUF models (llama.cpp); {p} is an ONNX export")
    info = read_info(p)
    n_layer = info.arch_int("block_count")
    if n_layer <= 0:
        raise InvalidArgument(f"{p} has no block_count: cannot place its layers over workers")
    records = status(eps)
    require_all(records)
    devices = [split.Device(worker=r["endpoint"], name=d["name"], free=int(d["free"]), total=int(d["total"]))
               for r in records for d in r["devices"]]
    placement = split.size(split.place(n_layer, devices, shares, n_gpu_layers), info, kv_bytes, len(devices))
    split.check_devices(placement, devices)
    c = Cluster(eps, devices, placement, records)
    log.info("cluster split: %s", c.summary())
    return c
