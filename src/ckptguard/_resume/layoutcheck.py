"""After any restore, resharded or not: every tensor item against the save's layout-free digest.

Contract: the save recorded, per item and DCP key, a digest that no sharding changes
(``digest.combine_layout_free``, in ``manifest.json`` under ``layout_free``). After the
restore each rank sums the pieces it now holds, rank 0 combines them and compares key by
key, and every rank raises the same StateMismatchError if an item differs. On a restore
onto another world size the items kept in the extras (stateful objects, plain and PerRank
values, the RNG streams) are compared with the digests of the rank they came from.
A manifest written before layout-free digests existed is compared per rank only.

The same gathered partials say whether the replicas agree: a chunk (a DCP key at a global
offset) that several ranks hold is one tensor by construction (DDP parameters and replicated
optimizer state, the replicated dimension of an HSDP or TP mesh); ``replica_report`` lists
every such chunk whose holders hold different bytes, with the ranks on each side, and the
restore then fails on every rank naming them (Megatron-LM PR#6920, AReaL PR#1468).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._agree import Wire, gather_decide
from .._context import Context
from .._disk.boxsum import REPLICAS_DIFFER, combine_layout_free, layout_free_partials
from .._disk.digest import digest
from .._records import manifest as _manifest
from .._state import rng as _rng
from .._state import state as _state
from .._state.rng import RNG_ITEM
from .._types import JsonObject, StateDict
from ..errors import StateMismatchError

_TENSOR_KINDS = (_state.ItemKind.MODULE, _state.ItemKind.OPTIMIZER, _state.ItemKind.TENSORS)


@dataclass(frozen=True)
class _Pieces(Wire):
    """One rank's layout-free partials of what it now holds, and its problems with the extras."""

    partials: dict[str, Any]
    problems: list[str]
    replicated: dict[str, str] = field(
        default_factory=dict
    )  # ReshardOptions.replicated items: their digests


@dataclass(frozen=True)
class _Verdict(Wire):
    """Per item the keys whose layout-free digest differs from the save's; per rank its problems;
    the replica report (``replica_report``)."""

    differ: dict[str, list[str]] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    replicas: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checked:
    items: dict[str, bool] = field(default_factory=dict)
    """Extras items compared with their source rank's digests (resharded restores only)."""
    layout_free: dict[str, bool] = field(default_factory=dict)
    """Tensor items compared through the layout-free digest; empty when the save recorded none."""
    replicas: dict[str, Any] = field(default_factory=dict)
    """``replica_report`` of the restored state (the proof's "replicas equal after load")."""


REPLICAS_SHOWN = (
    16  # differing chunks named in the report and the error; the count says how many in all
)


def replica_report(
    views: list[dict[str, list[str]]], replicated: list[dict[str, str]] | None = None
) -> JsonObject:
    """Which chunks several ranks hold, and which of those their holders hold differently.

    ``views`` are the ranks' ``layout_free_partials`` in rank order; ``replicated`` each rank's
    digests of the items ``CheckpointConfig(reshard=ReshardOptions(replicated=...))`` names (one
    value on every rank by the user's word), compared like chunks (key ``(item)``, offset ``-``).
    Returns ``{"world": ranks, "checked": chunks held by 2+ ranks, "most": the most holders of one
    chunk, "differing": count, "differ": [{"item", "key", "offset", "ranks": [[ranks with one
    value], ...]}, ...]}`` (the first ``REPLICAS_SHOWN`` differing chunks, by item and key)."""
    holders: dict[str, dict[str, list[int]]] = {}
    names: dict[str, tuple[str, str]] = {}
    for rank, view in enumerate(views):
        for cid, (item, key, header, part) in view.items():
            holders.setdefault(cid, {}).setdefault(f"{header}|{part}", []).append(rank)
            names[cid] = (item, key)
    for rank, items in enumerate(replicated or []):
        for item, value in items.items():
            holders.setdefault(f"{item}@-", {}).setdefault(value, []).append(rank)
            names[f"{item}@-"] = (item, "(item)")
    shared = {
        cid: values for cid, values in holders.items() if sum(len(r) for r in values.values()) > 1
    }
    differ = sorted(
        (cid for cid, values in shared.items() if len(values) > 1), key=lambda c: (names[c], c)
    )
    return {
        "world": len(views),
        "checked": len(shared),
        "most": max(
            (sum(len(r) for r in v.values()) for v in shared.values()), default=1 if views else 0
        ),
        "differing": len(differ),
        "differ": [
            {
                "item": names[cid][0],
                "key": names[cid][1],
                "offset": cid.rpartition("@")[2],
                "ranks": sorted(shared[cid].values()),
            }
            for cid in differ[:REPLICAS_SHOWN]
        ],
    }


def differing_chunks(report: JsonObject, *, short: bool = False) -> str:
    """The report's differing chunks, each with the ranks on each side; ``short`` leaves the offsets
    out (the proof's line)."""

    def name(d: JsonObject) -> str:
        if d.get("offset") == "-":
            return (
                f"item {d.get('item')!r} "
                f"(declared {'replicated' if short else 'in ReshardOptions.replicated'})"
            )
        where = "" if short else f", offset {d.get('offset')}"
        return f"{d.get('key')!r} (item {d.get('item')!r}{where})"

    return "; ".join(
        f"{name(d)}: " + " vs ".join(f"ranks {r}" for r in d.get("ranks") or [])
        for d in report.get("differ") or []
    )


def describe_replicas(report: JsonObject) -> str:
    """One line naming the differing replicas (empty when they agree)."""
    if not report.get("differing"):
        return ""
    shown = differing_chunks(report)
    more = report["differing"] - len(report.get("differ", []))
    return (
        f"{report['differing']} tensor chunk(s) held by several ranks differ between their "
        f"replicas after the load: {shown}{f' (and {more} more)' if more > 0 else ''}"
    )


def _extras_items(
    ctx: Context,
    now: dict[str, _state.Captured],
    manifest: _manifest.Manifest,
    extras: StateDict,
    source: int,
    expected: dict[str, str] | None = None,
) -> tuple[dict[str, bool], list[str]]:
    saved = manifest.digests.get(str(source), {}) if expected is None else expected
    matches: dict[str, bool] = {}
    problems: list[str] = []
    for name, item in now.items():
        if item.kind in _TENSOR_KINDS or name not in saved:
            continue
        matches[name] = item.digest() == saved[name]
        if not matches[name]:
            problems.append(
                f"state item {name!r} ({item.kind.value}) differs from what rank {source} saved"
            )
    if extras.get("rng") is not None and RNG_ITEM in saved and ctx.config.state.restore_rng:
        matches["rng"] = digest(_rng.capture()) == saved[RNG_ITEM]
        if not matches["rng"]:
            problems.append(f"the RNG streams differ from the ones rank {source} saved")
    return matches, problems


def _compare(
    saved: dict[str, dict[str, str]], now: dict[str, dict[str, str]], items: list[str]
) -> dict[str, list[str]]:
    """Per item, the keys whose digest differs (or that one side lacks)."""
    out: dict[str, list[str]] = {}
    for item in items:
        a, b = saved.get(item, {}), now.get(item, {})
        out[item] = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return out


def verify(
    ctx: Context,
    now: dict[str, _state.Captured],
    manifest: _manifest.Manifest,
    extras: StateDict,
    source: int,
    on_verified: Callable[..., None] | None = None,
    *,
    expected: dict[str, str] | None = None,
    explain: Callable[[], list[str]] | None = None,
) -> Checked:
    """Collective: compare the live objects (``now``: read back once after the load, by DCP key as
    the save captured them), record through ``on_verified``, and raise on every rank if anything
    differs.

    ``explain`` (same layout): what the files say when a tensor item differs, e.g. which data file
    changed on disk since the save; called only then, as it hashes the files."""
    resharded = manifest.world_size != ctx.world
    items, problems = (
        _extras_items(ctx, now, manifest, extras, source, expected) if resharded else ({}, [])
    )
    saved = manifest.layout_free  # None: a manifest written before layout-free digests
    tensor_items = sorted(n for n, item in now.items() if item.kind in _TENSOR_KINDS)
    live = {n: item.tensors for n, item in now.items() if item.kind in _TENSOR_KINDS}
    partials = layout_free_partials(live) if saved is not None else {}
    replicated = {
        n: item.digest()
        for n, item in now.items()
        if n in ctx.config.reshard.replicated and item.kind not in _TENSOR_KINDS
    }

    def decide(views: list[_Pieces]) -> _Verdict:
        # Format 3: an empty table is compared too (its tensor items' bytes are covered by nothing
        # else).
        compare = saved is not None and (bool(saved) or manifest.format_version >= 3)
        now = combine_layout_free([v.partials for v in views]) if compare else {}
        differ = _compare(saved or {}, now, tensor_items) if compare else {}
        replicas = (
            replica_report([v.partials for v in views], [v.replicated for v in views])
            if compare
            else {}
        )
        return _Verdict(
            differ, {str(r): v.problems for r, v in enumerate(views) if v.problems}, replicas
        )

    # Rank 0 decides without raising: every rank records the outcome for the proof, then all raise
    # alike.
    mine = _Pieces(partials, problems, replicated)
    head = gather_decide(ctx.agreement, "restore.layout_free", mine, decide, decision=_Verdict)
    differ = head.differ
    checked = Checked(items, {item: not keys for item, keys in differ.items()}, head.replicas)
    if on_verified is not None:  # recorded for the proof even when the restore then raises
        if checked.items:
            on_verified(checked.items)
        on_verified(checked.layout_free, kind="layout_free")
        if checked.replicas:
            on_verified(checked.replicas, kind="replicas")
    bad = [
        f"item {item!r}: keys {keys[:8]}{' ...' if len(keys) > 8 else ''}"
        for item, keys in differ.items()
        if keys
    ]
    others = [f"rank {r}: {'; '.join(p)}" for r, p in sorted(head.problems.items())]
    if bad or others or head.replicas.get("differing"):
        how = (
            f"onto {ctx.world} ranks from {manifest.world_size}"
            if resharded
            else "on the same layout"
        )
        split = describe_replicas(head.replicas)
        unsaved = sorted(
            k
            for item, keys in differ.items()
            for k in keys
            if (saved or {}).get(item, {}).get(k) == REPLICAS_DIFFER
        )
        parts = (
            ([split] if split else [])
            + (
                [
                    f"the save's own replicas of {unsaved[:8]} already differed (no restore can "
                    f"give them one value: restore an earlier step)"
                ]
                if unsaved
                else []
            )
            + (
                [f"the layout-free digests differ from the save's ({', '.join(bad)})"]
                if bad
                else []
            )
            + others
        )
        if bad and explain is not None:
            parts += explain()
        # Blame only what ran: a same-layout restore did no resharding.
        culprit = (
            "the resharding read is at fault"
            if resharded
            else "the read on this same layout is at fault (no resharding ran), or the "
            "manifest's digests were "
            "edited"
        )
        raise StateMismatchError(
            f"restore of step {manifest.step} {how}: {' | '.join(parts)}. The bytes "
            f"now in the model and optimizer are not the bytes that were saved: do not "
            f"train on. Run `ckptguard verify --deep` on {manifest.path.parent}; if "
            f"the files are intact, {culprit}."
        )
    return checked
