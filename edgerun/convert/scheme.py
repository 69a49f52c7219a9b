"""What a checkpoint's `quantization_config` says, checked: method, packing version, bits, groups, zero points.

Only the schemes edgerun can import exactly are accepted; every other one is refused by name with
what is expected instead (a QuantizationError, which the CLI turns into one `error:` line).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import QuantizationError

AWQ_VERSIONS = ("gemm", "gemv", "gemv_fast")
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class Group:
    """One group of modules quantized alike (compressed-tensors' config_groups; one group for AWQ / GPTQ)."""

    targets: tuple[str, ...]        # "Linear" (every linear), exact names, or "re:<regex>"
    group_size: int                 # -1: one group per row (channel strategy)
    symmetric: bool


@dataclass(frozen=True)
class Scheme:
    method: str                     # "awq" | "compressed-tensors" | "gptq"
    version: str                    # awq: gemm|gemv|gemv_fast; compressed-tensors: pack-quantized; gptq: gptq|gptq_v2
    groups: tuple[Group, ...]
    ignore: tuple[str, ...] = ()    # modules kept in float (ignore / modules_to_not_convert)
    desc_act: bool = False
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:
        return f"{self.method}/{self.version}"

    def group_for(self, module: str) -> Group | None:
        """The group that quantizes `module` (a Hugging Face module name), None when it stays float."""
        if any(_matches(p, module) for p in self.ignore):
            return None
        for g in self.groups:
            if any(_matches(t, module) for t in g.targets):
                return g
        return None


def _matches(pattern: str, module: str) -> bool:
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _bits(value: Any, where: Path) -> None:
    if value != 4:
        raise QuantizationError(f"{where}: {value}-bit weights are not supported; expected 4-bit (INT4) weights")


def _group_size(value: Any, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value >= 1):
        raise QuantizationError(f"{where}: group_size {value!r}; expected a positive integer or -1 (per channel)")
    return value


def _names(qc: Mapping[str, Any], key: str, where: Path) -> tuple[str, ...]:
    """A list of module names (modules_to_not_convert, ignore, targets); absent or null: none."""
    value = qc.get(key)
    if value is None:
        return ()
    if not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        raise QuantizationError(f"{where}: {key} is {value!r:.40}; expected a list of module names")
    return tuple(value)


def read_scheme(config: Mapping[str, Any], where: Path) -> Scheme:
    """The Scheme of a config.json dict; QuantizationError for anything not importable exactly."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise QuantizationError(f"{where}: no quantization_config; expected a published INT4 checkpoint "
                                "(AutoAWQ, GPTQ or compressed-tensors); for a float checkpoint use `edgerun quantize`")
    method = qc.get("quant_method")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if qc.get("backend") == "llm-awq":
            raise QuantizationError(f"{where}: AWQ checkpoints of the llm-awq backend are not supported; "
                                    "expected an AutoAWQ checkpoint (backend autoawq)")
        if version not in AWQ_VERSIONS:
            raise QuantizationError(f"{where}: AWQ version {version!r} is not supported; expected one of {list(AWQ_VERSIONS)}"
                                    + (" (marlin repacks the weights for its GPU kernel)" if version == "marlin" else ""))
        _bits(qc.get("bits", qc.get("w_bit")), where)
        gs = _group_size(qc.get("group_size", qc.get("q_group_size")), where)
        sym = not qc.get("zero_point", True)
        if sym:
            raise QuantizationError(f"{where}: AWQ without zero points (zero_point false) is not supported; "
                                    "AutoAWQ writes zero_point true")
        skip = _names(qc, "modules_to_not_convert", where)
        return Scheme("awq", version, (Group(("Linear",), gs, False),), ignore=("lm_head", *skip), raw=dict(qc))
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if qc.get("is_marlin_format") or fmt not in GPTQ_FORMATS:
            raise QuantizationError(f"{where}: GPTQ checkpoint_format {('marlin' if qc.get('is_marlin_format') else fmt)!r} "
                                    f"is not supported; expected one of {list(GPTQ_FORMATS)}")
        _bits(qc.get("bits"), where)
        gs = _group_size(qc.get("group_size"), where)
        sym = bool(qc.get("sym", True))
        skip = _names(qc, "modules_to_not_convert", where)
        return Scheme("gptq", fmt, (Group(("Linear",), gs, sym),), ignore=("lm_head", *skip),
                      desc_act=bool(qc.get("desc_act", False)), raw=dict(qc))
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise QuantizationError(f"{where}: compressed-tensors format {fmt!r} is not supported; expected "
                                    "'pack-quantized' (INT4 weights, W4A16)")
        groups = []
        config_groups = qc.get("config_groups") or {}
        if not isinstance(config_groups, dict) or not all(isinstance(g, dict) for g in config_groups.values()):
            raise QuantizationError(f"{where}: config_groups is {config_groups!r:.40}; expected an object of groups")
        for gname, gcfg in config_groups.items():
            w = gcfg.get("weights") or {}
            if not isinstance(w, dict):
                raise QuantizationError(f"{where}: config group {gname} has weights {w!r:.40}; expected an object")
            if gcfg.get("input_activations"):
                raise QuantizationError(f"{where}: config group {gname} quantizes activations too; "
                                        "expected weight-only quantization (W4A16)")
            _bits(w.get("num_bits"), where)
            if w.get("type") != "int":
                raise QuantizationError(f"{where}: config group {gname} has weights of type {w.get('type')!r}; "
                                        "expected 'int'")
            strategy = w.get("strategy")
            if strategy == "group":
                gs = _group_size(w.get("group_size"), where)
            elif strategy == "channel":
                gs = -1
            else:
                raise QuantizationError(f"{where}: config group {gname} has strategy {strategy!r}; "
                                        "expected 'group' or 'channel'")
            if w.get("actorder") not in (None, False, "static"):
                raise QuantizationError(f"{where}: config group {gname} has actorder {w.get('actorder')!r}; "
                                        "expected no activation reordering (or 'static')")
            groups.append(Group(_names(gcfg, "targets", where), gs, bool(w.get("symmetric", True))))
        if not groups:
            raise QuantizationError(f"{where}: compressed-tensors quantization_config has no config_groups")
        return Scheme("compressed-tensors", fmt, tuple(groups), ignore=_names(qc, "ignore", where), raw=dict(qc))
    raise QuantizationError(f"{where}: quant_method {method!r} is not supported; expected 'awq', 'gptq' or "
                            "'compressed-tensors'")
