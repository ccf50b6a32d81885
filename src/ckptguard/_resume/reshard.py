"""Per-rank state across a changed world size: one declared rule per item (``ReshardRule.BY_ITEM``).

Contract: tensor items (modules, optimizers, tensors) are resharded by DCP (rule ``dcp``);
every other item needs a rule, declared on the live objects and recorded in the manifest at
each save (``manifest.json`` field ``reshard``: item -> ``{"rule": ..., ...}``):

- ``data_cursor``: a ``ckptguard.DataCursor`` counts the global position, equal on every saving
  rank (checked against the manifest's per-rank digests); each new rank loads it and takes its
  share of the rest of the epoch under the new world size;
- ``replicated``: an item named in ``CheckpointConfig(reshard=ReshardOptions(replicated=...))`` (a
  scheduler, a step counter) is equal on every saving rank (checked); each new rank takes it;
- ``user``: ``PerRank(value, reshard=f)``; ``f(old_values_by_rank, new_world)`` returns the list of
  new values, one per new rank; every new rank runs it and the results must agree (checked);
- ``rng_rederive``: the four RNG streams of new rank r are seeded from
  ``derived_seed(seed, step, r)`` (the seed recorded at save,
  ``CheckpointConfig(reshard=ReshardOptions(rng_seed=...))``),
  never copied from another rank, and so is every ``GeneratorState`` item (its seed also mixes in
  the item's name); the ranks' streams must then be distinct (checked).

An item without a rule refuses the restore on every rank, naming the item and the rules that
would apply, before any byte of tensor state is read. A rule recorded at save that differs
from the one declared now refuses too. A checkpoint saved without rules (older ckptguard, or
nothing declared) is restored under the rules declared now.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from .._agree import Wire, gather_decide
from .._context import DATA_CURSOR, REPLICATED, RNG, USER, Context, fn_name
from .._disk.digest import digest
from .._records import manifest as _manifest
from .._state import rng as _rng
from .._state import state as _state
from .._state.rng import RNG_ITEM
from .._types import JsonObject, StateDict
from ..errors import StateMismatchError, TopologyMismatchError

log = logging.getLogger("ckptguard")


def derived_seed(seed: int, step: int, rank: int, item: str | None = None) -> int:
    """The seed of new rank ``rank``'s RNG streams (or of its generator ``item``) after a resharded
    restore of ``step``."""
    text = f"ckptguard-rng:{seed}:{step}:{rank}" + (f":{item}" if item is not None else "")
    return xxhash.xxh3_64_intdigest(text.encode()) & ((1 << 63) - 1)


def seed_streams(seed: int) -> None:
    """Seed the four streams (CPU, every CUDA device, Python, NumPy) from one integer."""
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))
    random.seed(seed)


def derived_streams(seed: int, step: int, rank: int) -> StateDict:
    """The four streams the rule gives ``rank`` (as ``rng.capture()`` would hold them), leaving ours
    alone."""
    keep = _rng.capture()
    try:
        seed_streams(derived_seed(seed, step, rank))
        return _rng.capture()
    finally:
        _rng.restore(keep, where="deriving RNG streams")


def _would_apply(value: Any) -> str:
    kind = _state.classify(value)
    if kind is _state.ItemKind.PER_RANK:
        return (
            "PerRank(value, reshard=f) with f(old_values_by_rank, new_world) -> new_values_by_rank"
        )
    if isinstance(value, _rng.GeneratorState):
        return (
            "CheckpointConfig(reshard=ReshardOptions(rng_seed=<the job's seed>)): each new rank's "
            "generator is re-derived from it"
        )
    what = "object's state_dict()" if kind is _state.ItemKind.STATEFUL else "value"
    return (
        f"CheckpointConfig(reshard=ReshardOptions(replicated=(...))) if it is equal on every rank, "
        f"a ckptguard.DataCursor for a data position, or, if it differs per rank, pass its {what} "
        f"as PerRank(value, reshard=f)"
    )


def skeleton_rank(manifest: _manifest.Manifest, ep_rank: int | None) -> int:
    """The old rank whose extras give this rank the non-tensor leaves of its tensor items:
    the lowest one of the same expert-parallel rank (their keys name it), else rank 0."""
    ep_ranks = manifest.topology.ep_ranks
    if ep_rank is not None and ep_ranks is not None and ep_rank in ep_ranks:
        return ep_ranks.index(ep_rank)
    return 0


@dataclass
class Plan:
    """What a BY_ITEM resharded restore gives this rank, decided before anything is loaded."""

    old_world: int
    new_world: int
    step: int
    rules: dict[str, dict[str, Any]]
    extras: StateDict
    """This rank's extras, as if the saving run had written them for it."""
    expected: dict[str, str] = field(default_factory=dict)
    """Digests the restored extras items (and the RNG streams) must have."""
    user_digests: dict[str, str] = field(default_factory=dict)
    """Per user-rule item: digest of the whole list the rule returned (equal on every rank)."""

    def record(self, rng_digest: str | None) -> JsonObject:
        """The ``reshard`` field of the restore's proof record."""
        rules = {
            n: r["rule"] + (f"(seed {r['seed']})" if "seed" in r else "")
            for n, r in sorted(self.rules.items())
        }
        return {
            "mode": "by_item",
            "from": self.old_world,
            "to": self.new_world,
            "rules": rules,
            "rng": rng_digest,
        }


def _rules(
    ctx: Context, manifest: _manifest.Manifest, state: Mapping[str, Any]
) -> dict[str, JsonObject]:
    """Every restored item's rule, or TopologyMismatchError naming each item without one."""
    saved = manifest.reshard or {}
    live = ctx.declared_rules(state)
    rules: dict[str, dict[str, Any]] = {}
    problems = []
    for name in sorted(n for n in state if n in manifest.items):
        rule, was = live.get(name), saved.get(name)
        if rule is None:
            problems.append(
                f"item {name!r} ({manifest.items[name]}) has no rule: declare "
                f"{_would_apply(state[name])}"
            )
        elif was is not None and was.get("rule") != rule["rule"]:
            problems.append(
                f"item {name!r} was saved under the rule {was.get('rule')!r} and declares "
                f"{rule['rule']!r} now: declare the rule it was saved under"
            )
        else:
            # A generator is re-derived from the seed recorded at save, like the four streams.
            rules[name] = (
                dict(rule, seed=was["seed"])
                if rule["rule"] == RNG and was and "seed" in was
                else rule
            )
    if RNG_ITEM in manifest.digests.get("0", {}) and ctx.config.state.restore_rng:
        seed = saved.get(RNG_ITEM, {}).get("seed", ctx.config.reshard.rng_seed)
        if seed is None:
            problems.append(
                "the RNG streams (CPU, CUDA, Python, NumPy) have no rule: set "
                "CheckpointConfig(reshard=ReshardOptions(rng_seed=<the job's seed>)) so each new "
                "rank's streams are re-derived "
                "from (seed, step, rank), or restore_rng=False"
            )
        else:
            if ctx.config.reshard.rng_seed not in (None, seed):
                log.warning(
                    "ckptguard: the RNG streams are re-derived from the seed recorded at save "
                    "(%d), not from CheckpointConfig(reshard=ReshardOptions(rng_seed=%d))",
                    seed,
                    ctx.config.reshard.rng_seed,
                )
            rules[RNG_ITEM] = {"rule": RNG, "seed": int(seed)}
    if problems:
        raise TopologyMismatchError(
            f"restore of step {manifest.step} from {manifest.path.parent} onto {ctx.world} ranks "
            f"(saved on {manifest.world_size}) is refused before anything is loaded: "
            f"{len(problems)} per-rank item(s) cannot be resharded: {'; '.join(problems)}. Tensor "
            f"items are resharded by DCP; every other item needs a declared rule "
            f"(ckptguard.DataCursor, CheckpointConfig(reshard=ReshardOptions(replicated=...)), "
            f"PerRank(value, reshard=f), CheckpointConfig(reshard=ReshardOptions(rng_seed=...))), "
            f"or restore on the saved world size."
        )
    return rules


def _check_equal(manifest: _manifest.Manifest, name: str, rule: str) -> str:
    """The saved digest of an item every saving rank must have saved alike; raise naming the ranks
    if not."""
    by_digest: dict[str, list[int]] = {}
    for r in range(manifest.world_size):
        by_digest.setdefault(manifest.digests.get(str(r), {}).get(name, ""), []).append(r)
    if len(by_digest) != 1 or "" in by_digest:
        groups = "; ".join(f"ranks {ranks}" for ranks in by_digest.values())
        what = (
            "a DataCursor counts the global position, so every rank must call take(n) alike"
            if rule == DATA_CURSOR
            else (
                "it was declared replicated "
                "(CheckpointConfig(reshard=ReshardOptions(replicated=...))) but differs per rank"
            )
        )
        raise StateMismatchError(
            f"restore of step {manifest.step} from {manifest.path.parent}: item {name!r} (rule "
            f"{rule}) was saved with different values on the saving ranks (alike: {groups}): "
            f"{what}. Give it a rule that merges the per-rank values (PerRank(value, reshard=f)), "
            f"or restore on the saved world size."
        )
    return next(iter(by_digest))


def prepare(
    ctx: Context,
    manifest: _manifest.Manifest,
    state: Mapping[str, Any],
    load: Callable[[int], StateDict],
) -> Plan:
    """Decide every item's rule and build this rank's extras; raises before anything is loaded."""
    rules = _rules(ctx, manifest, state)
    plan = Plan(manifest.world_size, ctx.world, manifest.step, rules, {})
    for name, rule in rules.items():
        if rule["rule"] in (REPLICATED, DATA_CURSOR):
            plan.expected[name] = _check_equal(manifest, name, rule["rule"])
    base = load(skeleton_rank(manifest, ctx.expert.rank if ctx.expert is not None else None))
    extras = dict(base, items=dict(base["items"]), rank=ctx.rank)
    users = [n for n, r in rules.items() if r["rule"] == USER]
    if users:
        # Every old rank's extras, on every new rank: small files, and only for items with a user
        # rule.
        old = [load(r) for r in range(manifest.world_size)]
        for name in users:
            extras["items"][name] = _run_user_rule(
                manifest, ctx, name, state[name].reshard, old, plan
            )
    if RNG_ITEM in rules:
        extras["rng"] = derived_streams(rules[RNG_ITEM]["seed"], manifest.step, ctx.rank)
        plan.expected[RNG_ITEM] = digest(extras["rng"])
    elif not ctx.config.state.restore_rng:
        extras["rng"] = None
    for name in generators(rules):
        extras["items"][name] = _derived_generator(
            state[name], rules[name]["seed"], manifest.step, ctx.rank, name
        )
        plan.expected[name] = digest(extras["items"][name])
    plan.extras = extras
    return plan


def generators(rules: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The ``GeneratorState`` items re-derived under the RNG rule."""
    return sorted(n for n, r in rules.items() if r["rule"] == RNG and n != RNG_ITEM)


def _derived_generator(item: Any, seed: int, step: int, rank: int, name: str) -> StateDict:
    """The state a ``GeneratorState`` item gets: a fresh generator of its device seeded by the
    rule."""
    gen = torch.Generator(device=item.generator.device).manual_seed(
        derived_seed(seed, step, rank, name)
    )
    return {"device": str(item.generator.device), "state": gen.get_state()}


def _run_user_rule(
    manifest: _manifest.Manifest,
    ctx: Context,
    name: str,
    fn: Callable[..., Any],
    old: list[StateDict],
    plan: Plan,
) -> Any:
    where = f"restore of step {manifest.step}: the reshard rule {fn_name(fn)} of item {name!r}"
    try:
        new = fn([e["items"][name] for e in old], ctx.world)
    except Exception as exc:
        raise StateMismatchError(
            f"{where} raised {type(exc).__name__}: {exc}; fix the rule"
        ) from exc
    if not isinstance(new, (list, tuple)) or len(new) != ctx.world:
        got = (
            f"a {type(new).__name__} of {len(new)}"
            if isinstance(new, (list, tuple))
            else type(new).__name__
        )
        raise StateMismatchError(
            f"{where} returned {got}; it must return a list of {ctx.world} values, one per new "
            f"rank (it is called as f(old_values_by_rank, new_world) with the "
            f"{manifest.world_size} saved values)"
        )
    _state.check_weights_only(list(new), f"the values the reshard rule of item {name!r} returned")
    plan.user_digests[name] = digest(list(new))
    return new[ctx.rank]


@dataclass(frozen=True)
class _After(Wire):
    rng: str = ""
    users: dict[str, str] = field(default_factory=dict)
    generators: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Fine(Wire):
    pass


def confirm(ctx: Context, plan: Plan) -> str | None:
    """Collective, after the items are applied: re-derived streams distinct across ranks and user
    rules alike on every rank; every rank raises if not. Returns this rank's RNG digest."""
    mine = digest(_rng.capture()) if RNG_ITEM in plan.rules else ""
    gens = {n: digest(plan.extras["items"][n]) for n in generators(plan.rules)}

    def decide(views: list[_After]) -> _Fine:
        problems = []
        for what, of in [("RNG streams", lambda v: v.rng)] + [
            (f"generator {n!r}", lambda v, n=n: v.generators[n]) for n in gens
        ]:
            seen: dict[str, list[int]] = {}
            for r, v in enumerate(views):
                if of(v):
                    seen.setdefault(of(v), []).append(r)
            if same := [ranks for ranks in seen.values() if len(ranks) > 1]:
                problems.append(
                    f"ranks {same[0]} hold the same {what} after re-deriving them (their dropout "
                    "masks and sampling would be identical)"
                )
        for name in plan.user_digests:
            if len({v.users.get(name) for v in views}) > 1:
                problems.append(
                    f"the reshard rule of item {name!r} returned different lists on different "
                    f"ranks: it must be a deterministic function of (old_values_by_rank, new_world)"
                )
        if problems:
            raise StateMismatchError(
                f"resharded restore of step {plan.step} ({plan.old_world} -> {plan.new_world} "
                f"ranks): {'; '.join(problems)}. Do not train on."
            )
        return _Fine()

    gather_decide(
        ctx.agreement,
        "restore.reshard",
        _After(mine, plan.user_digests, gens),
        decide,
        decision=_Fine,
    )
    return mine or None
