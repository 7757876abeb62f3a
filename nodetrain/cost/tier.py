"""The NVMe tier as the cost model sees it (``store.tier=nvme``): which store bytes leave host RAM for
the node's NVMe drives and what reading and writing them once per step costs the optimizer thread.

Owns: the tier's bytes (``tier_bytes``) and the optimizer thread's rate with the tier
(``tier_optimizer_rate``: the slower of its CPU AdamW and the tier's I/O for the same parameters).
Does not own: the store layout (``nodetrain/store.py``), the engine's tier (``optim/tier.py``), the
step (``step_time.py``) or whether the drives hold the tier (``plan/verdict.py``).
"""

from __future__ import annotations

from nodetrain.cost.memory import field_bytes
from nodetrain.store import StoreLayout

__all__ = ["TIER_FIELDS", "ram_store_bytes", "tier_bytes", "tier_optimizer_rate"]

TIER_FIELDS = {
    "full": ("master", "exp_avg", "exp_avg_sq"),
    "lean": ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax"),
}
"""Per ``optim.state``, the store fields only the optimizer touches: on NVMe with ``store.tier=nvme``."""


def tier_bytes(layout: StoreLayout, buffers: int) -> tuple[int, int]:
    """(bytes of the tier's fields over all units, page-aligned as stored; host bytes of its pool of
    ``buffers`` buffers, each holding the largest unit's tier fields). With ``store.tier=nvme`` the
    host store keeps ``layout.nbytes`` − the first + the second in RAM."""
    names = TIER_FIELDS[layout.state]
    total = sum(nbytes for name, nbytes in field_bytes(layout).items() if name in names)
    unit = max(
        sum(-(-layout.field_nbytes(u, f) // 4096) * 4096 for f in names)
        for u in range(len(layout.unit_numels))
    )
    return total, buffers * unit


def ram_store_bytes(layout: StoreLayout, tier: str, buffers: int) -> int:
    """Host RAM of the store: all of it with ``store.tier=ram``; with ``nvme`` all but the tier's
    fields, plus the tier's pool of ``buffers`` buffers (:func:`tier_bytes`)."""
    if tier != "nvme":
        return layout.nbytes
    on_nvme, pool = tier_bytes(layout, buffers)
    return layout.nbytes - on_nvme + pool


def tier_optimizer_rate(
    adamw_bytes_per_s: float, optimizer_bytes: float, tier_bytes: float, read: float, write: float
) -> float:
    """Host bytes/s the optimizer thread reaches over a stage's units when their tier fields
    (``tier_bytes``) are read from and written back to NVMe at ``read`` / ``write`` bytes/s (the
    rank's share of the drives) while its CPU AdamW moves ``optimizer_bytes`` at
    ``adamw_bytes_per_s``: reads ahead and write-backs overlap the update, so its seconds are
    max(AdamW, tier I/O) = max(optimizer_bytes / adamw, tier_bytes / read + tier_bytes / write),
    expressed as a rate over ``optimizer_bytes``. No tier (``tier_bytes`` 0): ``adamw_bytes_per_s``.

    Raises:
        ValueError: a tier with a read or write rate ≤ 0."""
    if tier_bytes <= 0:
        return adamw_bytes_per_s
    if not (read > 0 and write > 0):
        raise ValueError(f"NVMe read={read} / write={write} bytes/s: both must be > 0 with a tier")
    io_s = tier_bytes / read + tier_bytes / write
    return min(adamw_bytes_per_s, optimizer_bytes / io_s)
