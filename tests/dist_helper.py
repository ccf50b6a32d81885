"""Kept so older test modules keep importing by this name: the helper is ``ckptguard.testing``."""

from ckptguard.testing import RankResult, free_port, run_ranks, values  # noqa: F401
