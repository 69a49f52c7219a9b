"""Which layers of a model land on which device of a cluster, and whether each device's share fits.

The placement is llama.cpp's own rule (llama_model::load_tensors, 0.3.36), so the numbers checked here
are the ones llama.cpp will allocate: with n_gpu_layers = g of n_layer repeating layers, layers below
n_layer + 1 - g stay on the head's CPU; the rest (the output layer counts as layer n_layer) go to the
devices in order, device i taking the layers whose fraction (il - start) / g falls below the cumulative
share of devices 0..i (float32, upper bound). The token embeddings always stay on the head. Without a
tensor split the shares are the devices' free memory. Each layer's K/V cache lives with the layer.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InvalidArgument, MemoryBudgetError

MiB = 1024 ** 2
WORKER_OVERHEAD = 128 * MiB      # a worker's compute buffer and allocator slack, on top of its weights + K/V
_BLK = re.compile(r"^blk\.(\d+)\.")


def parse_tensor_split(value: str | Sequence[float] | None) -> tuple[float, ...]:
    """'3,1' (or numbers) -> shares; InvalidArgument for anything but finite numbers >= 0 with a positive sum."""
    if value is None or value == "" or value == ():
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for raw in items:
        try:
            x = float(raw)
        except (TypeError, ValueError):
            raise InvalidArgument(f"--tensor-split: {str(raw).strip()!r:.40} is not a number; expected shares "
                                  f"such as 1,1 (one per worker, optionally one more for the head)") from None
        if not math.isfinite(x) or x < 0:
            raise InvalidArgument(f"--tensor-split: {str(raw).strip()} is not a share >= 0; expected numbers "
                                  f"such as 1,1 (one per worker, optionally one more for the head)")
        out.append(x)
    if not out or sum(out) <= 0:
        raise InvalidArgument("--tensor-split: the shares must add up to more than 0")
    return tuple(out)


@dataclass(frozen=True)
class Device:
    """One device of the cluster as the head sees it."""

    worker: str          # endpoint HOST:PORT
    name: str            # ggml's name on the head (RPC0, RPC1, ...)
    free: int
    total: int


@dataclass
class Placement:
    n_layer: int
    n_gpu_layers: int                       # what llama.cpp is given
    shares: tuple[float, ...]               # tensor_split over the devices (llama.cpp's input)
    layer_device: list[int]                 # for layer 0..n_layer (n_layer = output): device index, -1 = head
    device_bytes: list[int] = field(default_factory=list)   # weights per device
    device_kv: list[int] = field(default_factory=list)
    head_bytes: int = 0                     # weights that stay on the head (embeddings, head layers)
    head_kv: int = 0

    def layers_of(self, d: int) -> list[int]:
        return [il for il, x in enumerate(self.layer_device) if x == d]


def layer_bytes(info) -> tuple[dict[int, int], int, int]:
    """(bytes of each repeating layer, bytes of the output layer, bytes of the token embeddings) from a
    GGUF header. A model without output.weight (tied embeddings) gets a copy of the embeddings on the
    output layer's device, as llama.cpp makes one."""
    # lazily: importing gguf-py costs ~0.3 s (measured here); the option checks that import this module do not need it
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    per: dict[int, int] = {}
    out = emb = 0
    for name, (ttype, shape, _) in info.tensors.items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        n = int(np.prod(shape)) if shape else 1
        nbytes = n // block * size
        m = _BLK.match(name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + nbytes
        elif name.startswith("token_embd."):
            emb += nbytes
        else:
            out += nbytes                   # output, output_norm, rope factors: the output layer's device
    if "output.weight" not in info.tensors:
        out += emb
    return per, out, emb


def place(n_layer: int, devices: Sequence[Device], tensor_split: Sequence[float] = (),
          n_gpu_layers: int | None = None) -> Placement:
    """llama.cpp's layer placement for this cluster. tensor_split: one share per device, optionally one
    more (last) for the head; n_gpu_layers: the layers offloaded to the devices (default: all of them,
    or what the head's share leaves)."""
    n_dev = len(devices)
    shares = list(tensor_split)
    if shares and len(shares) not in (n_dev, n_dev + 1):
        raise InvalidArgument(f"--tensor-split has {len(shares)} values but the workers offer {n_dev} device(s); "
                              f"give one share per device, in --rpc order, and optionally one more (last) for the head")
    head_share = shares.pop() if len(shares) == n_dev + 1 else None
    if head_share is not None and n_gpu_layers is not None:
        raise InvalidArgument("give the head's share either as the last --tensor-split value or with --gpu-layers, "
                              "not both")
    if head_share is not None:
        total = head_share + sum(shares)
        head_layers = round((n_layer + 1) * head_share / total)
        n_gpu_layers = n_layer + 1 - head_layers
    elif n_gpu_layers is None or n_gpu_layers < 0:
        n_gpu_layers = n_layer + 1
    if shares and sum(shares) == 0:
        n_gpu_layers = 0                    # everything on the head (llama.cpp would split by memory instead)
    weights = np.array(shares if shares else [d.free for d in devices], dtype=np.float32)
    cum = np.cumsum(weights, dtype=np.float32)
    cum = (cum / cum[-1]).astype(np.float32) if n_dev and cum[-1] > 0 else cum
    start = max(n_layer + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layer + 1) if n_dev else 0
    layer_device = []
    for il in range(n_layer + 1):
        if il < start or il - start >= act:
            layer_device.append(-1)
        else:
            layer_device.append(min(bisect_right(list(cum), float(np.float32(il - start) / np.float32(act))),
                                    n_dev - 1))
    return Placement(n_layer=n_layer, n_gpu_layers=n_gpu_layers, shares=tuple(float(x) for x in weights),
                     layer_device=layer_device)


def size(p: Placement, info, kv_bytes: int, n_devices: int) -> Placement:
    """Fill in the bytes each device (and the head) holds: weights of its layers, their K/V cache."""
    per, out, emb = layer_bytes(info)
    kv_layer = kv_bytes / max(1, p.n_layer)
    p.device_bytes = [0] * n_devices
    p.device_kv = [0] * n_devices
    p.head_bytes, p.head_kv = emb, 0
    for il, d in enumerate(p.layer_device):
        b = out if il == p.n_layer else per.get(il, 0)
        kv = 0 if il == p.n_layer else int(kv_layer)
        if d < 0:
            p.head_bytes += b
            p.head_kv += kv
        else:
            p.device_bytes[d] += b
            p.device_kv[d] += kv
    return p


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / MiB:.0f} MiB"


def check_devices(p: Placement, devices: Sequence[Device]) -> None:
    """MemoryBudgetError naming the first device whose share does not fit its free memory."""
    for i, d in enumerate(devices):
        need = p.device_bytes[i] + p.device_kv[i] + (WORKER_OVERHEAD if p.layers_of(i) else 0)
        if need > d.free:
            n = len(p.layers_of(i))
            raise MemoryBudgetError(
                f"the split does not fit: worker {d.worker} ({d.name}) would hold {n} layer(s) = "
                f"{_gib(p.device_bytes[i])} of weights + K/V cache {_gib(p.device_kv[i])} + compute "
                f"{_gib(WORKER_OVERHEAD)} = {_gib(need)}, but it has {_gib(d.free)} free; give it a smaller "
                f"--tensor-split share, a smaller --ctx, or add a worker")
