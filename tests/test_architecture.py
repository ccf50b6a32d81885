"""The tree shows the architecture: layers that only point down, no cycle, no private reach-in,
no function-local import in the core, and a frozen public surface (docs/architecture.md).

Each check is shown to fail on an injected bad edge, so a passing suite means the rule held,
not that the check saw nothing.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ckptguard
from ckptguard._core.door import MEMBERS

PKG = Path(ckptguard.__file__).parent

# The rank table: a module may import modules of its own layer or a lower one. ``_commit`` and
# ``_resume`` stand side by side at one rank and never import each other. The first matching
# prefix names a module's layer (the package root ``""`` is the public surface).
LAYERS: list[tuple[str, int, tuple[str, ...]]] = [
    (
        "base",
        0,
        ("errors", "_log", "_faults", "_priority", "_version", "_types", "_agree", "_dist"),
    ),
    ("memory", 1, ("memory",)),
    ("disk and format primitives", 2, ("_disk",)),
    ("state capture", 3, ("_state", "cursor")),
    ("storage", 4, ("storage",)),
    ("records on disk", 5, ("_records",)),
    ("config", 6, ("config",)),
    ("context", 7, ("_context",)),
    ("commit", 8, ("_commit",)),
    ("resume", 8, ("_resume",)),
    ("core", 9, ("_core",)),
    (
        "front doors",
        10,
        (
            "manager",
            "run",
            "tiers",
            "preempt",
            "rollout",
            "turns",
            "environments",
            "objectstore",
            "",
        ),
    ),
    ("ops", 11, ("ops", "integrations", "demo", "testing")),
    ("cli", 12, ("cli",)),
]
SIDE_BY_SIDE = {("commit", "resume"), ("resume", "commit")}
CORE_MAX_RANK = 10  # base .. front doors: no function-local import, no module over 500 lines
CORE_MAX_LINES = 500


def layer(module: str) -> tuple[str, int]:
    for name, rank, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or (prefix and module.startswith(prefix + ".")):
                return name, rank
    return "", -1


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolved(path: Path, node: ast.ImportFrom) -> list[str]:
    """The ckptguard modules (or module.name) one ``from ... import`` names, without the prefix."""
    me = list(path.relative_to(PKG).with_suffix("").parts)
    if node.level:
        base = me[:-1]
        parts = base[: len(base) - node.level + 1] + (node.module.split(".") if node.module else [])
    elif (node.module or "").split(".")[0] == "ckptguard":
        parts = node.module.split(".")[1:]  # type: ignore[union-attr]
    else:
        return []
    base_name = ".".join(parts)
    if node.module:
        return [base_name]
    return [".".join([*parts, a.name]) for a in node.names]  # ``from . import x``: the module x


def _is_module(name: str) -> bool:
    path = PKG.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or name == ""


def _target(name: str) -> str:
    """The module an imported name lives in (``from pkg import name`` names a module or a name of
    pkg)."""
    return name if _is_module(name) else name.rpartition(".")[0]


def import_graph(*, local_only: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if local_only:
            nodes = [
                n
                for f in ast.walk(tree)
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f)
                if isinstance(n, ast.ImportFrom)
            ]
        graph[module_name(path)] = {_target(t) for n in nodes for t in _resolved(path, n)}
    return graph


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        src_layer, src_rank = layer(src)
        for t in sorted(targets):
            t_layer, t_rank = layer(t)
            if src_layer == "memory" and t_layer not in ("memory", "base"):
                bad.append(f"{src} -> {t} (memory/ imports only the base)")
            elif t_rank > src_rank or (src_layer, t_layer) in SIDE_BY_SIDE:
                bad.append(
                    f"{src} ({src_layer}) -> {t} ({t_layer}): imports must "
                    f"point down the rank table"
                )
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as sorted module lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w == v or w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _private_names() -> dict[str, set[str]]:
    """Every private name (``_x``) ckptguard defines, and the modules that define it."""
    defined: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [n.name]
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                names = [n.attr]
            elif isinstance(n, ast.Assign):
                names = [t.id for t in n.targets if isinstance(t, ast.Name)]
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names = [n.target.id]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(module_name(path))
    return defined


def reach_ins(sources: dict[str, str]) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls``/``super()``/a class of the same module and
    ``_name`` is a private name of another ckptguard module, and ``from m import _name``."""
    defined = _private_names()
    bad = []
    for module, text in sorted(sources.items()):
        tree = ast.parse(text)
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr in defined and not n.attr.startswith("__"):
                v = n.value
                if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in classes):
                    continue
                if (
                    isinstance(v, ast.Call)
                    and isinstance(v.func, ast.Name)
                    and v.func.id == "super"
                ):
                    continue
                if module in defined[n.attr]:
                    continue  # a module's own private name
                bad.append(f"{module}:{n.lineno}: {ast.unparse(n)}")
            elif isinstance(n, ast.ImportFrom):
                bad += [
                    f"{module}:{n.lineno}: import {a.name}"
                    for a in n.names
                    if a.name in defined and module not in defined[a.name]
                ]
    return bad


def _sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in PKG.rglob("*.py")}


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer(m)[1] < 0] == []


def test_imports_point_down_the_rank_table():
    assert upward(import_graph()) == []


def test_the_rank_rule_catches_an_upward_import():
    graph = import_graph()
    graph["_records.retention"] = graph["_records.retention"] | {"ops.verify"}
    graph["memory.plan"] = graph["memory.plan"] | {"_disk.layout"}
    graph["_commit.protocol"] = graph["_commit.protocol"] | {"_resume.reshard"}  # side by side
    graph["storage.unpickler"] = graph["storage.unpickler"] | {"_records.checks"}
    assert len(upward(graph)) == 4


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_rule_catches_a_cycle():
    graph = import_graph()
    graph["_records.runmanifest"] = graph["_records.runmanifest"] | {"_records.checks"}
    assert cycles(graph) == [["_records.checks", "_records.runmanifest"]]


def test_no_private_reach_in():
    assert reach_ins(_sources()) == []


def test_the_reach_in_rule_catches_a_private_name_of_another_module():
    sources = _sources()
    sources["tiers"] += "\n\ndef _peek(mgr):\n    return mgr._ctx, mgr.core._unobserved\n"
    sources["preempt"] += "\nfrom ._agree import _Nothing\n"
    assert len(reach_ins(sources)) == 3


def reach_throughs(sources: dict[str, str]) -> list[str]:
    """``x.core`` / ``x.context`` (and every chain through them) where ``x`` is not ``self``:
    another front door's bookkeeping read or written from outside it. A door composes another
    through constructor arguments (``_core.parts.Parts``), never by reaching into it
    (``mgr.core.proof.tags = ...``)."""
    bad = []
    for module, text in sorted(sources.items()):
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, ast.Attribute) and n.attr in ("core", "context"):
                if isinstance(n.value, ast.Name) and n.value.id == "self":
                    continue
                bad.append(f"{module}:{n.lineno}: {ast.unparse(n)}")
    return bad


def test_no_front_door_reaches_through_another():
    assert reach_throughs(_sources()) == []


def test_the_reach_through_rule_catches_an_injected_chain():
    sources = _sources()
    lines = sources["tiers"].count("\n")
    sources["tiers"] += (
        "\n\ndef _poke(mgr, other):\n    mgr.core.x = 1\n    return other.context.agreement\n"
    )
    assert reach_throughs(sources) == [
        f"tiers:{lines + 4}: mgr.core",
        f"tiers:{lines + 5}: other.context",
    ]


def store_branches(source: str, door: str = "TieredCheckpoint", label: str = "tiers") -> list[str]:
    """Where ``TieredCheckpoint`` asks which kind its persistent tier is, outside the constructor
    that builds it: a name of the object store (``store``, ``object_store``,
    ``ObjectStoreCheckpoint``) in any other method. The tiers drive either kind through its
    manager's ``_core.rootstage.RootStage`` (issue 40: 7 such branches)."""
    tree = ast.parse(source)
    names = {
        "store",
        "object_store",
        "ObjectStoreCheckpoint",
        "StoreStage",
        "ObjectStore",
        "is_store",
    }
    bad = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == door):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
            for node in ast.walk(fn):
                name = (
                    node.attr
                    if isinstance(node, ast.Attribute)
                    else node.id
                    if isinstance(node, ast.Name)
                    else ""
                )
                if name in names:
                    bad.append(f"{label}:{node.lineno}: {fn.name} names {name}")
    return bad


def test_the_tiers_never_branch_on_the_kind_of_persistent_tier():
    source = _sources()["tiers"]
    assert store_branches(source) == []
    injected = source.replace(
        "    def _due(self",
        "    def _asks(self):\n        return self.store is not None\n\n    def _due(self",
        1,
    )
    assert [b.split(": ", 1)[1] for b in store_branches(injected)] == ["_asks names store"]


def test_the_manager_never_branches_on_the_kind_of_root():
    """Issue 40: an s3:// root is a root. The manager calls its root's stage (``_core.rootstage``)
    at the same points whatever the root; no method asks whether it is an object store."""
    source = _sources()["manager"]
    assert store_branches(source, "CheckpointManager", "manager") == []
    injected = source.replace(
        "    def poll(self",
        "    def _asks(self):\n        return is_store(self.root)\n\n    def poll(self",
        1,
    )
    assert [
        b.split(": ", 1)[1] for b in store_branches(injected, "CheckpointManager", "manager")
    ] == ["_asks names is_store"]


COMMIT_ORDER = {
    "begin",
    "commit",
    "rotate",
    "_advance",
    "_check_won",
    "resolve",
    "collect",
    "gc",
    "acquire_lease",
    "check_lease",
    "release_lease",
    "_takeover",
}


def commit_order_in_the_store(sources: dict[str, str]) -> list[str]:
    """Where the object-store package runs the commit's order itself (issue 40 item 2): a function
    named for a step of it or for the resume decision (``COMMIT_ORDER``), or the commit's fault
    points. The order is ``_commit.storepublish``'s and the decision ``_resume.storefetch``'s, over
    the store's primitives (temporary area, create-if-absent marker, tracker compare-and-set, reads,
    deletes); gc is ``ops.gc.collect`` over ``ops.storegc.StoreRoot``'s survey, and the lease's
    take-over rule ``_commit.storelease``'s (the store reads and writes ``lease.json`` by
    compare-and-set only)."""
    bad = []
    for name, source in sorted(sources.items()):
        if name != "storage.s3" and not name.startswith("storage.s3."):
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name in COMMIT_ORDER
            ):
                bad.append(f"{name}:{node.lineno}: def {node.name}")
            elif isinstance(node, ast.Constant) and node.value in (
                "store.before_marker",
                "store.before_tracker",
            ):
                bad.append(f"{name}:{node.lineno}: the fault point {node.value}")
    return bad


def test_the_object_store_package_holds_the_stores_primitives_not_the_commit_order():
    sources = _sources()
    assert commit_order_in_the_store(sources) == []
    sources["storage.s3._store"] += "\n\ndef commit(store):\n    return 'store.before_marker'\n"
    assert [b.split(": ", 1)[1] for b in commit_order_in_the_store(sources)] == [
        "def commit",
        "the fault point store.before_marker",
    ]


# The commit rule of a root (issue 40 item 2) is ``_commit.rootcommit``'s, over a ``RootStore``: the
# store's steps of it are called there only, and the primitives that make a step visible, uncommit
# one or move a tracker are called only inside the stores' own methods (``DirRoot``,
# ``BucketRoot``), by the modules that define them, or by the functions of
# ``OTHER_TRACKER_WRITERS``, each for a reason that is not a save's commit.
ROOT_STORE_STEPS = {"make_visible", "uncommit", "put_back", "move_tracker", "sealed"}
COMMIT_PRIMITIVES = {
    "create_marker",
    "swap_tracker",
    "drop_marker",
    "uncommit_to_trash",
    "restore_from_trash",
    "write_tracker",
}
ROOT_STORES = {"_commit.stepdir": "DirRoot", "_commit.storepublish": "BucketRoot"}
# Rotation moves a dropped step aside (its own rule, ``_records.retention``), a directory is
# uncommitted before it is deleted (``_disk.layout``), and the object store defines its primitives.
PRIMITIVE_USERS = {"_records.retention", "_disk.layout", "storage.s3._store"}
OTHER_TRACKER_WRITERS = {
    "_commit.stepdir:prepare_root": "tracker 0 on a new root, before its first save",
    "_core.root:hold": "tracker 0 on a new root, before its first save",
    "ops.gc:adopt_step": "the operator points the tracker at a complete step (ckptguard adopt)",
    "ops.transfer:_transfer_locked": "a step copied into another root, committed there",
    "ops.storetransfer:from_store": "a store's step copied into a local root, committed there",
    "_core.tierrestore:fetch": "the fast tier's copy of the step every rank restores",
    "_core.tierrestore:align_fast": "the fast tier's tracker moved to the step the tiers restored",
}


def commit_rule_outside_rootcommit(sources: dict[str, str]) -> list[str]:
    """Calls of a ``RootStore`` step outside ``_commit.rootcommit``, and of a commit primitive
    outside the stores' methods (``ROOT_STORES``), the modules of ``PRIMITIVE_USERS`` and
    ``OTHER_TRACKER_WRITERS``."""
    bad = []
    for name, source in sorted(sources.items()):
        tree = ast.parse(source)
        inside: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and ROOT_STORES.get(name) == node.name:
                inside |= {id(n) for n in ast.walk(node)}
            elif (
                isinstance(node, ast.FunctionDef) and f"{name}:{node.name}" in OTHER_TRACKER_WRITERS
            ):
                inside |= {
                    id(n)
                    for n in ast.walk(node)
                    if isinstance(n, ast.Call) and _called(n) == "write_tracker"
                }
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn, called = node.func, _called(node)
            ruled = isinstance(fn, ast.Attribute) and getattr(fn.value, "id", None) == "rootcommit"
            if called in ROOT_STORE_STEPS and isinstance(fn, ast.Attribute) and not ruled:
                if name != "_commit.rootcommit" and id(node) not in inside:
                    bad.append(f"{name}:{node.lineno}: {called}")
            elif (
                called in COMMIT_PRIMITIVES
                and name not in PRIMITIVE_USERS
                and id(node) not in inside
            ):
                bad.append(f"{name}:{node.lineno}: {called}")
    return bad


def _called(call: ast.Call) -> str | None:
    fn = call.func
    return fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)


def test_the_commit_rule_is_written_once_over_the_root_stores():
    sources = _sources()
    assert commit_rule_outside_rootcommit(sources) == []
    sources["_commit.publish_nodes"] += (
        "\n\ndef _loose(root, store):\n    root.move_tracker(3, back=False)\n"
    )
    sources["_commit.storepublish"] += (
        "\n\ndef _again(store):\n    return store.create_marker(None)\n"
    )
    sources["ops.transfer"] += "\n\ndef _direct(root):\n    _layout.write_tracker(root, 3)\n"
    got = [b.split(": ", 1)[1] for b in commit_rule_outside_rootcommit(sources)]
    assert got == ["move_tracker", "create_marker", "write_tracker"]


# Imports by name at run time (``importlib.import_module``) in the core, besides a package
# ``__init__``'s PEP 562 ``__getattr__`` (commented ``# lazy``): the restricted unpickler imports
# the module of a global its allow-list names (as pickle's own find_class would) to snapshot it
# before a load.
DYNAMIC_IMPORTS = {"storage.unpickler:_allowed_objects"}


def local_imports(sources: dict[str, str]) -> list[str]:
    """Function-local imports in the core: ``import`` statements (except ``# optional`` ones) and
    calls of ``importlib.import_module``/``__import__`` (except a package ``__init__``'s PEP 562
    ``__getattr__``, commented ``# lazy``, and ``DYNAMIC_IMPORTS``)."""
    found = []
    for module, text, f in core_functions(sources):
        lines = text.splitlines()
        package = (PKG.joinpath(*module.split(".")) / "__init__.py").is_file() or module == ""
        for n in ast.walk(f):
            line = lines[n.lineno - 1] if hasattr(n, "lineno") else ""
            if isinstance(n, (ast.Import, ast.ImportFrom)) and "# optional" not in line:
                found.append(f"{module}:{n.lineno}")
            elif isinstance(n, ast.Call) and _dynamic_import(n):
                lazy = package and f.name == "__getattr__" and "# lazy" in line
                if not lazy and f"{module}:{f.name}" not in DYNAMIC_IMPORTS:
                    found.append(f"{module}:{n.lineno} (import by name)")
    return found


def core_functions(
    sources: dict[str, str],
) -> Iterator[tuple[str, str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(module, its text, a function) for every function of the modules of ranks 0-10, modules
    sorted."""
    for module, text in sorted(sources.items()):
        if layer(module)[1] > CORE_MAX_RANK:
            continue
        for f in ast.walk(ast.parse(text)):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield module, text, f


def _dynamic_import(call: ast.Call) -> bool:
    fn = call.func
    return (isinstance(fn, ast.Attribute) and fn.attr == "import_module") or (
        isinstance(fn, ast.Name) and fn.id in ("__import__", "import_module")
    )


def test_no_function_local_import_in_the_core():
    """Except an optional dependency, commented ``# optional`` on its line, and the first-use
    imports of a package's public names (PEP 562, ``# lazy``): docs/architecture.md."""
    assert local_imports(_sources()) == []


def test_the_local_import_rule_catches_an_import_in_a_function():
    sources = _sources()
    sources["_records.trust"] += "\n\ndef _late():\n    import torch\n    return torch\n"
    sources["_disk.layout"] += (
        "\n\ndef _late2():\n    return importlib.import_module('torch')  # lazy\n"
    )
    sources["storage"] += "\n\ndef _late3(name):\n    return importlib.import_module(name)\n"
    assert len(local_imports(sources)) == 3


# Untyped records: a core function's signature names its records' types, ``StateDict`` for a
# caller's training state or ``JsonObject`` for a JSON object at a reader or writer (``_types``),
# never a bare ``dict[str, Any]``. The memory sampler's package keeps its own JSONL kinds
# (``memory.records``) and is not held to it.
UNTYPED = ("dict[str, Any]", "Dict[str, Any]")


def untyped_signatures(sources: dict[str, str]) -> list[str]:
    found = []
    for module, _text, f in core_functions(sources):
        if layer(module)[0] == "memory":
            continue
        args = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs, f.args.vararg, f.args.kwarg]
        annotations = [a.annotation for a in args if a is not None and a.annotation is not None]
        text_of = " ".join(
            ast.unparse(a) for a in [*annotations, *([f.returns] if f.returns else [])]
        )
        if any(u in text_of for u in UNTYPED):
            found.append(f"{module}:{f.lineno} {f.name}")
    return found


def test_no_untyped_record_in_a_core_signature():
    assert untyped_signatures(_sources()) == []


def test_the_signature_rule_catches_a_bare_dict():
    sources = _sources()
    sources["_records.trust"] += "\n\ndef _loose(x: dict[str, Any]) -> None:\n    pass\n"
    sources["_commit.protocol"] += "\n\ndef _loose2() -> list[dict[str, Any]]:\n    return []\n"
    assert {s.split(" ")[1] for s in untyped_signatures(sources)} >= {"_loose", "_loose2"}


def test_no_core_module_over_500_lines():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert {
        m: n for m, n in sizes.items() if layer(m)[1] <= CORE_MAX_RANK and n > CORE_MAX_LINES
    } == {}


EXPORTED = [
    "AsyncOptions",
    "BlockingBudget",
    "ChainMismatchError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CollectiveTimeoutError",
    "ConfigError",
    "Consistency",
    "ContractMismatchError",
    "CursorSampler",
    "DCPStorage",
    "DataCursor",
    "DerivedState",
    "EnvKind",
    "Environment",
    "ExpertParallel",
    "GeneratorState",
    "HealthPolicy",
    "IOStats",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "LeaseHeldError",
    "ObjectStoreOptions",
    "OnBusy",
    "OverBudget",
    "ParallelLayout",
    "PendingCommit",
    "PendingSave",
    "PerRank",
    "PinnedMemoryUnavailableError",
    "Preempted",
    "PreemptionGuard",
    "Prefer",
    "ProofPlan",
    "RankDisagreementError",
    "RecordFormatError",
    "RehearsalError",
    "ReplicatedDivergenceError",
    "ReshardOptions",
    "ReshardRule",
    "Resolution",
    "ResumeError",
    "ResumeMode",
    "RetentionPolicy",
    "Role",
    "RolloutLedger",
    "RunCheckpoint",
    "RunContract",
    "RunStepError",
    "SaveBudgetError",
    "SaveStillRunningError",
    "StaleDerivedStateError",
    "StateMismatchError",
    "StateOptions",
    "Storage",
    "StorageContext",
    "StorageFormatError",
    "StorageOptions",
    "StorageStallError",
    "StreamingConfig",
    "StreamingStorage",
    "Tier",
    "TieredCheckpoint",
    "TieredSave",
    "TopologyMismatchError",
    "TurnLedger",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
    "WrittenFile",
    "__version__",
    "hash_data_files",
    "hash_git_tree",
    "hash_imported_files",
    "hash_recipe",
    "open_step",
    "read_dcp_metadata",
]


def test_exported_members():
    """Adding or removing a public name is a decision: change this list on purpose."""
    assert ckptguard.__all__ == EXPORTED
    for name in ckptguard.__all__:
        assert hasattr(ckptguard, name), name
    modules = {n for n in dir(ckptguard) if isinstance(getattr(ckptguard, n), type(ckptguard))}
    public = {n for n in dir(ckptguard) if not n.startswith("_")} - modules
    assert public <= set(EXPORTED), f"public but not in __all__: {sorted(public - set(EXPORTED))}"


def private_imports(path: Path, module: str) -> list[str]:
    """The private ckptguard modules a file imports (a path component starting with ``_``)."""
    if module:
        names = {
            t
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom)
            for t in _resolved(path, n)
        }
    else:  # a script outside the package: absolute imports only
        names = {
            n.module.removeprefix("ckptguard").lstrip(".")
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ckptguard")
        }
    public_dunder = {"__version__"}  # ckptguard.__version__ is public
    return sorted(
        n
        for n in names
        if any(p.startswith("_") and p not in public_dunder for p in n.split(".") if p)
    )


def test_the_cli_and_the_examples_use_only_public_names():
    examples = Path(__file__).resolve().parents[1] / "examples"
    found = {"cli": private_imports(PKG / "cli.py", "cli")}
    found |= {p.name: private_imports(p, "") for p in sorted(examples.glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_public_names_rule_catches_a_private_import(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("from ckptguard._disk import layout\nfrom ckptguard.ops import verify\n")
    assert private_imports(script, "") == ["_disk"]


# ---------------------------------------------------------------- one front-door shape


def shape_problems(door: type) -> list[str]:
    """How ``door`` differs from ``ckptguard.Checkpointer``: a missing call, a keyword it does not
    take, a return type other than the protocol's (``save_async``'s: a ``PendingCommit``, checked on
    a real one)."""
    problems = []
    for name in MEMBERS:
        want, got = (
            inspect.signature(getattr(ckptguard.Checkpointer, name)),
            getattr(door, name, None),
        )
        if not callable(got):
            problems.append(f"{door.__name__}.{name}: missing")
            continue
        have = inspect.signature(got).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for p in want.parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in have and not takes_any:
                problems.append(f"{door.__name__}.{name}: no keyword {p.name}=")
        if len(_positional(have)) < len(_positional(want.parameters)):
            problems.append(f"{door.__name__}.{name}: takes fewer positional arguments")
        returns = inspect.signature(got).return_annotation
        if name != "save_async" and str(returns) != str(want.return_annotation):
            problems.append(
                f"{door.__name__}.{name}: returns {returns}, not {want.return_annotation}"
            )
    return problems


def _positional(params: Any) -> list[str]:
    return [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _doors(root: Path) -> dict[str, tuple[object, object]]:
    """Each front door on its own root, and how it takes one state (a run: a dict of each
    role's)."""
    return {
        "CheckpointManager": (lambda: ckptguard.CheckpointManager(root / "mgr"), lambda s: s),
        "RunCheckpoint": (
            lambda: ckptguard.RunCheckpoint(root / "run", [ckptguard.Role("actor")]),
            lambda s: {"actor": s},
        ),
        "TieredCheckpoint": (
            lambda: ckptguard.TieredCheckpoint(
                root / "fast", persistent=root / "pers", fast_every=1, persistent_every=1
            ),
            lambda s: s,
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        "CheckpointManager",
        "RunCheckpoint",
        "TieredCheckpoint",
        "CheckpointManager(s3://)",
        "TieredCheckpoint(persistent=s3://)",
    ],
)
def test_every_front_door_has_the_one_shape_and_answers_with_its_types(name, tmp_path):
    """Each front door, and a manager whose root is an object store: the same calls, the same
    answers."""
    with contextlib.ExitStack() as stack:
        if "s3://" in name:  # on a real S3 server (moto), its root s3://door/run
            door = stack.enter_context(_store_door(tmp_path, tiers=name.startswith("Tiered")))
            wrap: Any = lambda s: s  # noqa: E731
        else:
            make, wrap = _doors(tmp_path)[name]
            door = make()
        _conforms(door, wrap, url="s3://door/run" if name == "CheckpointManager(s3://)" else None)


@contextlib.contextmanager
def _store_door(root: Path, *, tiers: bool = False) -> Iterator[Any]:
    pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
    pytest.importorskip("moto.server", reason="moto[server] (dev extra) is not installed")
    import boto3

    import objstore_helper

    with objstore_helper.moto_endpoint() as endpoint:
        bucket = (
            "door-tiers" if tiers else "door"
        )  # moto keeps its buckets for the whole process: one each
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        if (
            tiers
        ):  # the persistent tier on the store, its staging root and options from config.storage
            staged = objstore_helper.config(endpoint, root / "staging")
            yield ckptguard.TieredCheckpoint(
                root / "fast",
                persistent="s3://door-tiers/run",
                fast_every=1,
                persistent_every=1,
                config=staged,
            )
        else:
            yield objstore_helper.root("s3://door/run", root / "staging", endpoint)


def _conforms(door: Any, wrap: Any, url: str | None = None) -> None:
    """``url``: the door's root is that object store (its resolution names the step's marker
    there)."""
    import torch

    from ckptguard._core.guard import GuardTarget
    from ckptguard._resume.resolve_local import Resolution

    assert shape_problems(type(door)) == []
    assert isinstance(door, ckptguard.Checkpointer)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    saved = door.save(1, wrap({"model": model, "n": 1}), loss=0.5)
    assert isinstance(saved, Path) and saved.is_dir() and saved.name == "step_00000001", saved
    pending = door.save_async(2, wrap({"model": model, "n": 2}))
    assert isinstance(pending, ckptguard.PendingCommit) and pending.step == 2
    path = pending.wait()
    assert isinstance(path, Path) and path.name == "step_00000002" and pending.done()
    assert door.wait() in (path, None)
    res = door.resolve()
    assert isinstance(res, Resolution) and res.step == 2 and isinstance(res.path, Path)
    assert res.url == (f"{url}/step_00000002/manifest.json" if url else None), res
    fresh = torch.nn.Linear(3, 2)
    state = {"model": fresh, "n": 0}
    assert door.restore(wrap(state)) == 2
    assert torch.equal(fresh.weight, model.weight) and state["n"] == 2
    assert isinstance(door.record_step(3, sample_ids=[1], loss=0.25), dict)
    assert door.record_update(3, grad_norm=1.0, params_changed=True) is None
    assert set(door.record_export(3, torch.ones(2))) == {"bytes", "scales"}
    assert door.record_logprobs(3, torch.zeros(4), torch.zeros(4))["probs_diff"] == 0.0
    assert isinstance(door.preemption_target(), GuardTarget)
    door.close()


def test_the_shape_check_catches_a_door_that_drifted():
    class Drifted(ckptguard.CheckpointManager):
        def save(self, step: int, state: Any) -> dict[str, Path]:  # type: ignore[override]
            return {}

    Drifted.resolve = None  # type: ignore[assignment,method-assign]
    problems = shape_problems(Drifted)
    assert "Drifted.resolve: missing" in problems
    assert "Drifted.save: no keyword healthy=" in problems
    assert any(p.startswith("Drifted.save: returns dict[str, Path]") for p in problems), problems
