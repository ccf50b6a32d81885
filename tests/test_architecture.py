"""The tree shows the architecture: imports flow one way, and the public surface is frozen.

Rule (docs/architecture.md): ``ops/``, ``demo/``, ``integrations/`` and ``cli`` may import the
core; the core never imports them; ``memory/`` depends on nothing of ckptguard but ``errors``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptguard

PKG = Path(ckptguard.__file__).parent
TOOLS = ("ops", "demo", "integrations", "cli", "testing")


def _imports(path: Path) -> set[str]:
    """Every ckptguard module ``path`` imports (absolute, without the ``ckptguard.`` prefix)."""
    me = list(path.relative_to(PKG).with_suffix("").parts)
    base = me[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = base[: len(base) - node.level + 1] + (node.module.split(".") if node.module else [])
            found |= {".".join([*parts, a.name]) if not node.module else ".".join(parts) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptguard"):
            found.add(node.module.removeprefix("ckptguard").lstrip("."))
    return found


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        layer = src.split(".")[0]
        for t in targets:
            top = t.split(".")[0]
            if layer == "memory" and top not in ("memory", "errors"):
                bad.append(f"{src} -> {t} (memory/ may import only errors)")
            elif layer not in TOOLS and top in TOOLS:
                bad.append(f"{src} -> {t} (the core must not import the tools)")
    return bad


def import_graph() -> dict[str, set[str]]:
    return {".".join(p.relative_to(PKG).with_suffix("").parts): _imports(p) for p in PKG.rglob("*.py")}


def test_imports_flow_one_way():
    assert wrong_way(import_graph()) == []


def test_the_rule_catches_a_wrong_way_import():
    graph = import_graph()
    graph["_commit.retention"] = graph["_commit.retention"] | {"ops.verify"}
    graph["memory.plan"] = graph["memory.plan"] | {"_commit.layout"}
    assert len(wrong_way(graph)) == 2


EXPORTED = [
    "ChainMismatchError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointIncompleteError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CollectiveTimeoutError",
    "ConfigError",
    "ContractMismatchError",
    "CursorSampler",
    "DCPStorage",
    "DataCursor",
    "DerivedState",
    "ExpertParallel",
    "GeneratorState",
    "HealthPolicy",
    "IOStats",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "LeaseHeldError",
    "ParallelLayout",
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
    "SaveStillRunningError",
    "StaleDerivedStateError",
    "StateMismatchError",
    "Storage",
    "StorageContext",
    "StorageFormatError",
    "StorageStallError",
    "StreamingConfig",
    "StreamingStorage",
    "Tier",
    "TieredCheckpoint",
    "TieredSave",
    "TopologyMismatchError",
    "UnsafeCheckpointError",
    "VersionMismatchError",
    "WriteFailure",
    "WrittenFile",
    "__version__",
    "hash_data_files",
    "hash_git_tree",
    "hash_imported_files",
    "hash_recipe",
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
        names = _imports(path)
    else:  # a script outside the package: absolute imports only
        names = {
            n.module.removeprefix("ckptguard").lstrip(".")
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("ckptguard")
        }
    public_dunder = {"__version__"}  # ckptguard.__version__ is public
    return sorted(n for n in names if any(p.startswith("_") and p not in public_dunder for p in n.split(".") if p))


def test_the_cli_and_the_examples_use_only_public_names():
    examples = Path(__file__).resolve().parents[1] / "examples"
    found = {"cli": private_imports(PKG / "cli.py", "cli")}
    found |= {p.name: private_imports(p, "") for p in sorted(examples.glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_public_names_rule_catches_a_private_import(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("from ckptguard._commit import layout\nfrom ckptguard.ops import verify\n")
    assert private_imports(script, "") == ["_commit"]
