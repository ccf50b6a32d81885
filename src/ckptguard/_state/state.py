"""What a state dict item is, where it goes on disk, and how it comes back.

Contract: each named item is classified once (``ItemKind``). Tensor leaves of models, optimizers
and tensor items go to DCP under ``<item>.<path>`` keys; everything else (plain values, stateful
objects' state, ``PerRank`` values, optimizer state's non-tensor leaves) goes to this rank's extras
file, which ``torch.load(weights_only=True)`` reads. Models and optimizers pass through
``torch.distributed.checkpoint.state_dict`` so FSDP2/DTensor parameters work. Restore writes
tensors in place and replaces plain values in the caller's mapping.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel

from .._disk.boxsum import digest_with_layout_free, layout_free_partials
from .._disk.digest import DIGEST_BYTES, DIGEST_STRUCTURE, digest, structure_digest
from .._types import StateDict
from ..errors import ConfigError, StateMismatchError
from . import rng as _rng

TENSOR_REF = "__ckptguard_dcp_key__"


class ItemKind(str, enum.Enum):
    MODULE = "module"
    OPTIMIZER = "optimizer"
    STATEFUL = "stateful"
    TENSORS = "tensors"
    PER_RANK = "per_rank"
    VALUE = "value"


@dataclass
class PerRank:
    """Marks a value as different on each rank: kept in this rank's extras, never in DCP.

    DCP stores a plain tensor once for all ranks (rank 1 silently gets rank 0's copy), so
    anything that differs per rank must be wrapped in ``PerRank`` or be a DTensor.

    ``reshard``: how the value crosses a change of world size (``ReshardRule.BY_ITEM``):
    ``reshard(old_values_by_rank, new_world) -> new_values_by_rank``, a deterministic function
    (every new rank runs it); without one a resharded restore refuses the item."""

    value: Any
    reshard: Callable[[list[Any], int], list[Any]] | None = None


@dataclass
class Captured:
    """One item as it goes to disk."""

    name: str
    kind: ItemKind
    skeleton: Any  # the item's structure; tensor leaves replaced by {TENSOR_REF: key}
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def digest(self) -> str:
        """The item's digest, from the captured tensors (a staged copy hashes the same bytes)."""
        return digest(_unflatten(self.skeleton, self.tensors))

    def structure_digest(self) -> str:
        """The item's structure digest (format 3's for a tensor item): no tensor byte read."""
        return structure_digest(_unflatten(self.skeleton, self.tensors))

    def digest_and_layout_free(self) -> tuple[str, dict[str, list[str]]]:
        """``digest()`` and its tensors' layout-free partials, reading their bytes once."""
        return digest_with_layout_free(
            _unflatten(self.skeleton, self.tensors), self.tensors, self.name
        )

    @property
    def replicated_keys(self) -> list[str]:
        return [k for k, t in self.tensors.items() if not _is_dtensor(t)]


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


def classify(value: Any) -> ItemKind:
    if isinstance(value, PerRank):
        return ItemKind.PER_RANK
    if isinstance(value, torch.nn.Module):
        return ItemKind.MODULE
    if isinstance(value, torch.optim.Optimizer):
        return ItemKind.OPTIMIZER
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return ItemKind.STATEFUL
    if _has_tensor(value):
        return ItemKind.TENSORS
    return ItemKind.VALUE


_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size)


def check_weights_only(obj: Any, where: str) -> None:
    """Refuse, at save time, what ``torch.load(weights_only=True)`` could not read back."""
    if isinstance(obj, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            check_weights_only(k, f"{where} key")
            check_weights_only(v, f"{where}.{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_weights_only(v, f"{where}[{i}]")
        return
    raise ConfigError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a safe load "
        f"(torch.load(weights_only=True)) cannot read back; {_fix_for(obj)}"
    )


def _fix_for(obj: Any) -> str:
    """What to put in the state instead of ``obj``: the fix for the objects users put there most."""
    data = torch.utils.data
    if isinstance(obj, data.DataLoader):
        return (
            "a DataLoader keeps no position to save. Put the position in the state instead: a "
            "ckptguard.DataCursor (cursor = ckptguard.DataCursor(len(dataset), seed=...); "
            "DataLoader(dataset, batch_size=b, sampler=cursor.sampler(b), "
            "generator=torch.Generator()); state['data'] = cursor: the loader's own generator "
            "keeps its base-seed draw off the global RNG), or torchdata's StatefulDataLoader (it "
            "has state_dict()/load_state_dict())"
        )
    if isinstance(obj, torch.Generator):
        return "put ckptguard.GeneratorState(generator) in the state (its state as a tensor)"
    if type(obj).__name__.endswith("DataLoaderIter") or hasattr(obj, "__next__"):
        return (
            "an iterator's position cannot be saved; save what produces it (a "
            "ckptguard.DataCursor, a sampler with state_dict(), torchdata's StatefulDataLoader) "
            "and rebuild the iterator after restore()"
        )
    return (
        "convert it to tensors and plain Python types (int, float, str, list, dict) in its "
        "state_dict()"
    )


def check_items(state: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything loads or trains, an item no save could write (``capture``'s checks):
    a run must not learn only at its first save that its state cannot be checkpointed."""
    for name, value in state.items():
        check_name(name)
        kind = classify(value)
        if kind in (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.STATEFUL):
            # torch's module/optimizer state dicts hold tensors and plain values only; a stateful
            # object's state_dict() is not called before its load (a StatefulDataLoader would start
            # its workers, draw its seeds there): its content is checked at the save
            continue
        check_weights_only(
            current_state(name, value, kind, state), f"{where}: state item {name!r} ({kind.value})"
        )


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name or "." in name or name.startswith("_"):
        raise ConfigError(
            f"state item name {name!r} must be a non-empty str without '.' and not "
            "starting with '_' (dots separate DCP key parts; '_' names are ckptguard's)"
        )


KeyFn = Callable[[str], str]


def _same(key: str) -> str:
    return key


def flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], keyfn: KeyFn = _same) -> Any:
    """Replace tensor leaves by references to flat keys, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        key = keyfn(prefix)
        out[key] = obj
        return {TENSOR_REF: key}
    if isinstance(obj, Mapping):
        return {k: flatten(v, f"{prefix}.{k}", out, keyfn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [flatten(v, f"{prefix}.{i}", out, keyfn) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, Mapping):
        if set(skeleton) == {TENSOR_REF}:
            return tensors[skeleton[TENSOR_REF]]
        return {k: _unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [_unflatten(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def tensor_keys(skeleton: Any) -> set[str]:
    """The DCP keys a skeleton refers to."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if set(node) == {TENSOR_REF}:
                found.add(node[TENSOR_REF])
                return
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(skeleton)
    return found


def _model_for(optim: torch.optim.Optimizer, state: Mapping[str, Any], name: str) -> Any:
    params = {id(p) for g in optim.param_groups for p in g["params"]}
    for value in state.values():
        if isinstance(value, torch.nn.Module) and params <= {id(p) for p in value.parameters()}:
            return value
    raise ConfigError(
        f"optimizer {name!r} has no model in the state holding all of its parameters; put the "
        "model in the same state dict (DCP needs it to name the optimizer state by FQN)"
    )


def current_state(
    name: str, value: Any, kind: ItemKind, state: Mapping[str, Any], *, loaded: bool = False
) -> Any:
    """The item's state dict now (tensors: live references where possible). ``loaded``: read
    right after a load, to check it; the global RNG streams are left as the load put them."""
    if kind is ItemKind.MODULE:
        return get_model_state_dict(value)
    if kind is ItemKind.OPTIMIZER:  # never stepped to be read (read_optimizer)
        return read_optimizer(_model_for(value, state, name), value, name)
    if kind is ItemKind.STATEFUL:
        return _rng_untouched(value.state_dict) if loaded else value.state_dict()
    if kind is ItemKind.PER_RANK:
        return value.value
    return value


def read_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer, name: str) -> StateDict:
    """``optim``'s state dict by FQN as ``get_optimizer_state_dict`` gives it; ``optim`` unchanged.

    DCP initialises a stateless optimizer by running ``step()`` with zero gradients and lr 0
    (``_init_optim_state``): Adam's ``step`` would become 1 before the first real step, every
    later update's bias correction off by one, the run diverging bitwise from the same run without
    ckptguard. A never-stepped optimizer has no moments to save: its param groups, empty state.
    (A restore loads into DCP's own read, ``restore_targets``, replacing what it set.)"""
    if optim.state:  # DCP initialises only an optimizer whose state is empty
        return get_optimizer_state_dict(model, optim)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        # FSDP1 renames flat params in its optim_state_dict: only DCP's path (it steps first) can.
        raise ConfigError(
            f"optimizer {name!r} has never stepped and its model is wrapped in FSDP1 "
            f"(FullyShardedDataParallel): its state can only be read by stepping it, which "
            f"would change the training. Save after the first optimizer step, or shard the "
            f"model with FSDP2 (fully_shard)"
        )
    osd = optim.state_dict()  # param indices mapped to FQNs, as DCP maps them
    index = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
    fqn_of = {
        index[id(p)]: next(iter(_get_fqns(model, key)))
        for key, p in model.named_parameters()
        if id(p) in index
    }
    groups = [{**g, "params": [fqn_of[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {}, "param_groups": groups}


def _rng_untouched(read: Callable[[], Any]) -> Any:
    """``read()``, the four global RNG streams put back after it. torchdata's StatefulDataLoader
    builds an iterator in ``state_dict()`` when it has none, drawing from torch's global RNG:
    right after a restore (the digest check) that shifts every dropout mask of the resumed run.
    Only there: before a fresh run's first iteration the loop's ``iter()`` reuses that iterator,
    so a save's (or staging plan's) ``state_dict()`` must draw what ``iter()`` would have."""
    streams = _rng.capture()
    try:
        return read()
    finally:
        _rng.restore(streams, where="a state item's state_dict()")


def capture(state: Mapping[str, Any], keyfn: KeyFn = _same) -> dict[str, Captured]:
    """Snapshot every item: its skeleton, its DCP tensors and its digest."""
    out = {}
    for name, value in state.items():
        check_name(name)
        kind = classify(value)
        sd = current_state(name, value, kind, state)
        if kind in (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS):
            tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten(sd, name, tensors, keyfn)
        else:
            tensors, skeleton = {}, sd
        check_weights_only(skeleton, f"state item {name!r}")
        out[name] = Captured(name, kind, skeleton, tensors)
    return out


def digests_and_layout_free(
    items: Mapping[str, Captured],
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Every item's per-rank digest and the layout-free partials of all tensor items.

    A tensor item's per-rank digest is its structure digest (``digest_kind``): the layout-free
    partials alone cover its bytes, read once, not twice (xxh3 of them too cost the save's pass
    1.4-1.6x the layout-free pass, layout_digest.md). Other items' digests cover their bytes."""
    digests: dict[str, str] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name, c in items.items():
        if c.kind in _TENSOR_ITEMS:
            digests[name] = c.structure_digest()
            tensors[name] = c.tensors
        else:
            digests[name] = c.digest()
    return digests, layout_free_partials(tensors)


_TENSOR_ITEMS = (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS)


def digest_kind(kind: str) -> str:
    """What an item's per-rank digest covers from format 3 on (``kind``: an ItemKind value)."""
    return DIGEST_STRUCTURE if kind in {k.value for k in _TENSOR_ITEMS} else DIGEST_BYTES


Target = tuple[ItemKind, Any, dict[str, torch.Tensor]]
"""What a restore loads one item into: its kind, current state dict, the flat tensors DCP fills."""
Targets = dict[str, Target]


def restore_targets(
    state: Mapping[str, Any], keyfn: KeyFn = _same, stepped: frozenset[str] = frozenset()
) -> Targets:
    """Each item's ``Target``. ``stepped``: the optimizer items whose saved state holds tensors
    (DCP's load target initialises them; the load replaces it)."""
    targets = {}
    for name, value in state.items():
        kind = classify(value)
        if kind is ItemKind.OPTIMIZER and name in stepped:
            # DCP's init: what it fills
            sd = get_optimizer_state_dict(_model_for(value, state, name), value)
        else:
            sd = current_state(name, value, kind, state)
        flat: dict[str, torch.Tensor] = {}
        if kind in (ItemKind.MODULE, ItemKind.OPTIMIZER, ItemKind.TENSORS):
            flatten(sd, name, flat, keyfn)
        targets[name] = (kind, sd, flat)
    return targets


def read_back(
    state: Mapping[str, Any], targets: Targets, keyfn: KeyFn = _same
) -> dict[str, Captured]:
    """Every restored item read once from the live objects after the load, as ``capture`` takes
    it: a restore's checks (digests, layout-free sums, replicas) all compare this one read. A
    stateful item's read leaves the RNG streams as the load put them (``loaded=True``)."""
    out = {}
    for name, (kind, _sd, _flat) in targets.items():
        sd = current_state(name, state[name], kind, state, loaded=True)
        tensors: dict[str, torch.Tensor] = {}
        out[name] = Captured(
            name, kind, flatten(sd, name, tensors, keyfn) if kind in _TENSOR_ITEMS else sd, tensors
        )
    return out


def apply(
    state: MutableMapping[str, Any],
    name: str,
    kind: ItemKind,
    skeleton: Any,
    loaded: Mapping[str, torch.Tensor],
) -> None:
    """Put one loaded item back into the live objects."""
    value = state[name]
    if kind is ItemKind.MODULE:
        set_model_state_dict(
            value, _unflatten(skeleton, loaded), options=StateDictOptions(strict=True)
        )
    elif kind is ItemKind.OPTIMIZER:
        model = _model_for(value, state, name)
        set_optimizer_state_dict(model, value, _unflatten(skeleton, loaded))
    elif kind is ItemKind.STATEFUL:
        value.load_state_dict(skeleton)
    elif kind is ItemKind.TENSORS:
        # DCP filled the tensors in place; non-tensor leaves come from the skeleton.
        rebuilt = _unflatten(skeleton, loaded)
        if not isinstance(value, torch.Tensor):
            _merge_into(value, rebuilt, name)
    elif kind is ItemKind.PER_RANK:
        value.value = _copy_into(value.value, skeleton)
    else:
        state[name] = skeleton


def _copy_into(current: Any, saved: Any) -> Any:
    """Copy saved tensors into existing ones where shapes allow, so references stay valid."""
    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        if current.shape == saved.shape and current.dtype == saved.dtype:
            with torch.no_grad():
                current.copy_(saved)
            return current
        return saved.to(current.device)
    if isinstance(current, MutableMapping) and isinstance(saved, Mapping):
        for k, v in saved.items():
            current[k] = _copy_into(current.get(k), v)
        return current
    return saved


def _merge_into(target: Any, rebuilt: Any, where: str) -> None:
    if isinstance(target, MutableMapping) and isinstance(rebuilt, Mapping):
        for k, v in rebuilt.items():
            if isinstance(v, torch.Tensor):
                continue  # already filled in place
            if isinstance(target.get(k), (MutableMapping, list)):
                _merge_into(target[k], v, f"{where}.{k}")
            else:
                target[k] = v
    elif isinstance(target, list) and isinstance(rebuilt, list):
        for i, v in enumerate(rebuilt):
            if not isinstance(v, torch.Tensor):
                if isinstance(target[i], (MutableMapping, list)):
                    _merge_into(target[i], v, f"{where}[{i}]")
                else:
                    target[i] = v


def check_restored(item: Captured, saved: str, *, structure: bool = False) -> None:
    """Raise if the item, read back from the live object (``read_back``), differs from the save.
    ``structure``: the saved digest is a structure digest (format 3 tensor items; the layout-free
    pass compares their bytes)."""
    name, kind = item.name, item.kind
    now = item.structure_digest() if structure else item.digest()
    if now != saved:
        hint = ""
        if kind is ItemKind.STATEFUL:
            hint = (
                f" Its load_state_dict() did not reproduce the saved state (a scheduler that "
                f"recomputes its LR from source defaults does this): saved state "
                f"digest {saved}, now {now}."
            )
        elif structure:
            hint = (
                " Its structure, a tensor's dtype or shape, or a non-tensor value "
                "(a hyperparameter) changed."
            )
        raise StateMismatchError(
            f"state item {name!r} ({kind.value}) differs after restore from what was saved.{hint} "
            "Do not train on: fix the object's load_state_dict, or restore into an object "
            "built with the saved configuration."
        )


def addresses(state: StateDict) -> dict[str, int]:
    """data_ptr of every parameter and buffer of the modules in ``state`` (local shard for DTensor).

    CUDA graphs and colocated rollout engines hold these addresses; a restore must copy into the
    existing storages, never swap in new tensors."""
    out = {}
    for name, value in state.items():
        if isinstance(value, torch.nn.Module):
            for key, t in [*value.named_parameters(), *value.named_buffers()]:
                local = t.to_local() if hasattr(t, "to_local") else t
                out[f"{name}.{key}"] = local.data_ptr()
    return out


def moved(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(k for k in before if after.get(k) != before[k])
