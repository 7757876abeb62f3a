"""Start-up checks of the NVMe tier's keys (``store.tier``, ``store.tier_dir``, ``store.tier_buffers``).

Owns: the field rules (:func:`check_tier`, called by checks.py's ``validate`` into its problem list),
and the start-up checks of ``store.tier_dir`` itself (:func:`tier_dir_problem`) and of its free space
against the tier's bytes (:func:`tier_space_problem`), both called by the start-up fit check
(plan/host.py). Does not own the tier (optim/tier.py).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TIERS", "check_tier", "tier_dir_problem", "tier_space_problem"]

TIERS = ("ram", "nvme")


def check_tier(cfg, problems) -> None:
    """Add the tier's problems to ``problems`` (checks.py's ``Problems``: key, value, what, fix)."""
    s = cfg.store
    if s.tier not in TIERS:
        problems.add("store.tier", s.tier, f"must be one of {', '.join(TIERS)}", "use ram (default) or nvme")
        return
    if s.tier == "ram":
        return
    if not s.tier_dir:
        problems.add(
            "store.tier_dir",
            s.tier_dir,
            "required with store.tier=nvme",
            "set it to a directory on a local NVMe drive",
        )
    if isinstance(s.tier_buffers, bool) or not isinstance(s.tier_buffers, int) or s.tier_buffers < 2:
        problems.add(
            "store.tier_buffers",
            s.tier_buffers,
            "must be an integer >= 2 (one unit is read ahead while another is updated)",
            "use 2 or more (default 4)",
        )
    if cfg.optim.speculative is True and cfg.optim.overlap and cfg.optim.max_grad_norm > 0:
        problems.add(
            "optim.speculative",
            True,
            "backs up fp32 master weights and moments in host RAM "
            "(12 B/param), which store.tier=nvme keeps out of it",
            "set optim.speculative=false (or store.tier=ram)",
        )


def tier_dir_problem(tier_dir: str) -> str | None:
    """Why ``tier_dir`` cannot take the tier's file on this node (None when it can): missing or not
    writable. Checked at the training start-up (plan/host.py), not by ``validate``: a plan for
    another machine names a directory this one does not have."""
    if not Path(tier_dir).is_dir():
        return f"store.tier_dir={tier_dir}: not a directory; create it or point at one"
    if not os.access(tier_dir, os.W_OK):
        return f"store.tier_dir={tier_dir}: not writable; fix its permissions or choose another"
    return None


def tier_space_problem(tier_dir: str, need_bytes: int, free_bytes: int | None = None) -> str | None:
    """Why ``tier_dir`` cannot hold the tier (None when it can): free bytes from ``os.statvfs``
    (``f_bavail × f_frsize``, what an unprivileged writer may use) unless ``free_bytes`` is given."""
    if free_bytes is None:
        st = os.statvfs(tier_dir)
        free_bytes = st.f_bavail * st.f_frsize
    if need_bytes <= free_bytes:
        return None
    return (
        f"store.tier_dir={tier_dir}: the tier needs {need_bytes / 1e9:.2f} GB for the optimizer state but "
        f"the directory has {free_bytes / 1e9:.2f} GB free; free space there, point store.tier_dir at a "
        "larger drive, or use store.tier=ram"
    )
