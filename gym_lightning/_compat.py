"""The one place where gym_lightning touches Lightning's private (``_``-prefixed) helpers.

Lightning does not promise to keep these stable; keeping every use here means one file to fix on an upgrade.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

__all__ = ["rank_zero_info", "rank_zero_warn"]
