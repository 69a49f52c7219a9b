"""The memory-fit check: target + drafter + KV cache against the profile's budget and what is free now.
"""

from __future__ import annotations

import logging

import psutil

from ..errors import MemoryBudgetError
from .profiles import DeviceProfile


log = logging.getLogger(__name__)


GiB = 1024 ** 3
MiB = 1024 ** 2



# ----------------------------------------------------------------------------------------------
# Memory budget
# ----------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def check_memory_fit(profile: DeviceProfile, *, target_bytes: int, draft_bytes: int = 0, kv_bytes: int = 0,
                     n_ctx: int | None = None, overhead_bytes: int = 256 * MiB,
                     available_bytes: int | None = None) -> None:
    """Refuse (MemoryBudgetError) when target + drafter + KV cache exceed what the device can hold.

    The limit is the smaller of the profile's budget and what psutil says is available now
    (pages of an already-mapped model file count as available: the kernel can drop them).
    """
    vm = psutil.virtual_memory()
    available = vm.available if available_bytes is None else available_bytes
    budget = profile.budget_bytes(vm.total)
    limit = min(budget, available)
    need = target_bytes + draft_bytes + kv_bytes + overhead_bytes
    if need <= limit:
        log.debug("memory fit: need %s of %s (budget %s, available %s)", _gib(need), _gib(limit),
                  _gib(budget), _gib(available))
        return
    over = need - limit
    which = "the profile budget" if budget <= available else "the memory available now"
    tips = []
    if n_ctx and kv_bytes > 0:
        per_pos = kv_bytes / n_ctx
        fit_ctx = int((kv_bytes - over) / per_pos) if kv_bytes > over else 0
        if fit_ctx >= 256:
            tips.append(f"a smaller context (--n-ctx {fit_ctx // 256 * 256} or less)")
    if draft_bytes > 0:
        tips.append(f"a smaller drafter or none (--draft none saves {_gib(draft_bytes)})"
                    + (" -- enough" if draft_bytes >= over else ""))
    tips.append("a smaller or more strongly quantized target model")
    raise MemoryBudgetError(
        f"the models do not fit on {profile.name}: target {_gib(target_bytes)} + drafter {_gib(draft_bytes)} "
        f"+ KV cache {_gib(kv_bytes)} + runtime {_gib(overhead_bytes)} = {_gib(need)}, but {which} is "
        f"{_gib(limit)} (profile budget {_gib(budget)}, available now {_gib(available)}); "
        f"{_gib(over)} too much. Try {'; or '.join(tips)}")
