"""The context of one checkpoint root: everything a save or a restore needs, resolved once.

The commit side (``_commit``) and the resume side (``_resume``) both run on it; it sits below
both, so neither imports the other (docs/architecture.md, the rank table). Here too: the reshard
rule a save records for every state item (``manifest.json`` field ``reshard``, decided from the live
objects and this root's config); ``_resume.reshard`` applies the rules and documents each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._agree import Agreement
from ._disk import layout as _layout
from ._state.expert import ExpertParallel
from ._state.rng import RNG_ITEM, GeneratorState
from ._state.state import ItemKind, PerRank, classify
from ._types import JsonObject
from .config import CheckpointConfig
from .cursor import DataCursor
from .storage.base import Storage, StorageContext

DCP, REPLICATED, DATA_CURSOR, USER, RNG = "dcp", "replicated", "data_cursor", "user", "rng_rederive"
"""The reshard rules a save records (``_resume.reshard`` applies each)."""
_TENSOR_KINDS = (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS)


def fn_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


@dataclass(frozen=True)
class Actions:
    """One-shot actions of one save: arguments of the call that asks for them, never config that
    survives a restart of the job (``save(..., overwrite=True)``, ``save(...,
    break_lease=True)``)."""

    overwrite: bool = False
    """Replace a committed step, or save a step older than the tracker (a deliberate rollback)."""
    break_lease: bool = False
    """Take the root's write lease even from a live owner (reported in the log)."""


NO_ACTIONS = Actions()


@dataclass
class Context:
    """Everything a save or restore needs, resolved once by the manager."""

    root: Path
    config: CheckpointConfig
    naming: _layout.StepNaming
    agreement: Agreement
    storage: Storage
    storage_ctx: StorageContext
    expert: ExpertParallel | None = None
    last_save: tuple[int, float] | None = None  # (step, monotonic end) of this process's last save
    node_publisher: bool = (
        False  # the last save was on node-local roots and this rank published its node's part
    )

    @classmethod
    def of(
        cls,
        root: Path,
        config: CheckpointConfig,
        naming: _layout.StepNaming,
        agreement: Agreement,
        storage: Storage,
        group: Any,
        expert: ExpertParallel | None,
    ) -> Context:
        """The context of ``root`` for the ranks of ``agreement``, DCP's collectives over
        ``group``."""
        info = agreement.info
        return cls(
            root=root,
            config=config,
            naming=naming,
            agreement=agreement,
            storage=storage,
            storage_ctx=StorageContext(
                rank=info.rank, world_size=info.world_size, process_group=group
            ),
            expert=expert,
        )

    @property
    def rank(self) -> int:
        return self.agreement.info.rank

    @property
    def world(self) -> int:
        return self.agreement.info.world_size

    def topology(self) -> dict[str, int]:
        """This run's world: its size and the layout's sizes (what ``Topology.shape`` gives of a
        saved one)."""
        declared = self.config.reshard.layout
        layout = declared.as_dict() if declared else {"dp": self.world, "tp": 1, "pp": 1, "ep": 1}
        if self.expert is not None:
            layout["ep"] = self.expert.size
        return {"world_size": self.world, **layout}

    def declared_rules(self, state: Any) -> dict[str, JsonObject]:
        """The reshard rule of every item of ``state`` that has one under this root's config (JSON,
        as the manifest records it)."""
        seed = self.config.reshard.rng_seed
        rules: dict[str, JsonObject] = {}
        for name, value in state.items():
            if classify(value) in _TENSOR_KINDS:
                rules[name] = {"rule": DCP}
            elif isinstance(value, DataCursor):
                rules[name] = {"rule": DATA_CURSOR}
            elif isinstance(value, PerRank) and value.reshard is not None:
                rules[name] = {"rule": USER, "fn": fn_name(value.reshard)}
            elif name in self.config.reshard.replicated:
                rules[name] = {"rule": REPLICATED}
            elif isinstance(value, GeneratorState) and seed is not None:
                rules[name] = {"rule": RNG, "seed": seed}
        if self.config.state.capture_rng and seed is not None:
            rules[RNG_ITEM] = {"rule": RNG, "seed": seed}
        return rules

    def keyfn(self) -> Any:
        return self.expert.key if self.expert is not None else (lambda key: key)
