"""The run contract: what a resumed run must share with the run that saved.

Contract: ``ROOT/contract/phase_NNNN.json`` files are append-only. Phase 0 is written
by the first save; the newest phase is the contract in force. A restore or save whose
``RunContract`` differs from it raises, listing the items, until the change is declared
with ``CheckpointManager.declare_phase`` (a new file; an old one is never edited).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .._disk.layout import CONTRACT_DIR, fsync_dir, read_json, refuse_link
from .._types import JsonObject
from ..errors import ChainMismatchError, CheckpointCorruptError, ConfigError, ContractMismatchError
from .entries import is_int, is_number

ITEMS = ("code", "data", "recipe", "total_steps")


def _canonical(obj: Any) -> str:
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"recipe must be JSON-serializable (str keys, finite numbers): {exc}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class RunContract:
    """What must not change silently between the run that saved and the run that resumes."""

    code: str | None = None
    """Hash of the code, e.g. ``hash_git_tree(".")`` or ``hash_imported_files(["mypkg"])``."""
    data: str | None = None
    """Hash of the data, e.g. ``hash_data_files(paths)``."""
    recipe: Mapping[str, Any] | None = None
    """The training recipe (hyperparameters); stored whole so a change names the keys."""
    total_steps: int | None = None
    """Planned length of training; extending it is a new phase."""

    def __post_init__(self) -> None:
        if self.total_steps is not None and (
            not isinstance(self.total_steps, int) or self.total_steps <= 0
        ):
            raise ConfigError(
                f"RunContract.total_steps must be a positive int, got {self.total_steps!r}"
            )
        if self.recipe is not None:
            _canonical(self.recipe)

    def items(self) -> JsonObject:
        recipe = json.loads(_canonical(self.recipe)) if self.recipe is not None else None
        return {
            "code": self.code,
            "data": self.data,
            "recipe": recipe,
            "total_steps": self.total_steps,
        }

    def hash(self) -> str:
        return xxhash.xxh3_64_hexdigest(_canonical(self.items()).encode())


def contract_hash(items: Mapping[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(_canonical(dict(items)).encode())


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(top-level item, description) for every difference, recipe keys one by one."""
    out = []
    for item in ITEMS:
        a, b = old.get(item), new.get(item)
        if a == b:
            continue
        if item == "recipe" and isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key, "<absent>") != b.get(key, "<absent>"):
                    out.append(
                        (
                            item,
                            f"recipe.{key}: {a.get(key, '<absent>')!r} -> "
                            f"{b.get(key, '<absent>')!r}",
                        )
                    )
        else:
            out.append((item, f"{item}: {a!r} -> {b!r}"))
    return out


# ---------------------------------------------------------------- hash helpers


def hash_git_tree(repo: str | os.PathLike[str] = ".") -> str:
    """``git:<commit>`` plus ``+dirty:<hash>`` of the uncommitted diff (untracked files
    included)."""

    def git(*args: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(repo), *args], check=True, capture_output=True
        ).stdout

    try:
        commit = git("rev-parse", "HEAD").decode().strip()
        dirty = git("diff", "HEAD", "--binary") + git(
            "ls-files", "--others", "--exclude-standard", "-z"
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        raise ConfigError(
            f"hash_git_tree: {repo} is not a git work tree with a commit ({exc})"
        ) from None
    return f"git:{commit}" + (f"+dirty:{xxhash.xxh3_64_hexdigest(dirty)}" if dirty else "")


def hash_imported_files(packages: Iterable[str]) -> str:
    """Hash of every Python source file of ``packages`` (top-level names), read from disk.

    Stable at any call point: the files are found from each package's import location and
    walked in sorted order, not taken from ``sys.modules``, so a module the program imports
    later (lazily) counts from the first call on, and a change to it changes the hash. The
    packages must be importable (their parents are imported to locate them); only ``*.py``
    files count, ``__pycache__`` and links leaving the package are skipped."""

    prefixes = sorted(set(packages))
    h = xxhash.xxh3_64()
    found = 0
    for name in prefixes:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            files = _package_sources([Path(p) for p in spec.submodule_search_locations])
        elif spec.origin and spec.origin.endswith(".py") and os.path.isfile(spec.origin):
            files = [(Path(spec.origin).name, Path(spec.origin))]
        else:
            continue
        for rel, path in files:
            h.update(f"{name}/{rel}".encode() + b"\0" + path.read_bytes() + b"\0")
            found += 1
    if not found:
        raise ConfigError(
            f"hash_imported_files: no Python source files found for {prefixes}; pass "
            f"importable package names"
        )
    return f"sources:{found}:{h.hexdigest()}"


def _package_sources(roots: list[Path]) -> list[tuple[str, Path]]:
    out: dict[str, Path] = {}
    for root in roots:
        base = root.resolve()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(
                d for d in dirnames if d != "__pycache__" and not d.startswith(".")
            )
            for fname in filenames:
                path = Path(dirpath, fname)
                if fname.endswith(".py") and path.is_file() and base in path.resolve().parents:
                    out.setdefault(path.relative_to(root).as_posix(), path)
    return sorted(out.items())


def hash_data_files(paths: Iterable[str | os.PathLike[str]]) -> str:
    """Hash of names, sizes and contents of data files (or one data manifest file)."""
    h = xxhash.xxh3_128()
    for p in sorted(map(str, paths)):
        h.update(os.path.basename(p).encode() + b"\0")
        with open(p, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    return "xxh3-128:" + h.hexdigest()


def hash_recipe(recipe: Mapping[str, Any]) -> str:
    return xxhash.xxh3_64_hexdigest(_canonical(dict(recipe)).encode())


# ---------------------------------------------------------------- phase files


def phase_files(root: Path) -> list[Path]:
    return sorted((root / CONTRACT_DIR).glob("phase_[0-9][0-9][0-9][0-9].json"))


@dataclass(frozen=True)
class Phase:
    """One ``phase_NNNN.json``: its number, the run chain, the contract in force from it on (the
    ``RunContract.items()`` of its writer) and why it was declared. ``adopted_chains`` is None where
    the file has no such key (every phase but an ``adopt``'s); ``extra`` keeps keys a later release
    wrote."""

    phase: int
    chain_id: str
    contract: Mapping[str, Any]
    created_unix: float | None = None
    reason: str | None = None
    changes: tuple[str, ...] | None = None
    contract_hash: str | None = None
    adopted_chains: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _OPTIONAL = ("created_unix", "reason", "changes", "contract_hash", "adopted_chains")

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "phase": self.phase,
            "chain_id": self.chain_id,
            "contract": dict(self.contract),
        }
        for key in self._OPTIONAL:
            value = getattr(self, key)
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, value: object) -> Phase:
        """The phase in ``value``; ValueError saying what is wrong."""
        if not (
            isinstance(value, dict)
            and is_int(value.get("phase"))
            and isinstance(value.get("chain_id"), str)
            and isinstance(value.get("contract"), dict)
        ):
            raise ValueError(
                "is not a contract phase (an object with int 'phase', str 'chain_id' and a "
                "'contract' object)"
            )
        for key in ("changes", "adopted_chains"):
            if key in value and not (
                isinstance(value[key], list) and all(isinstance(c, str) for c in value[key])
            ):
                raise ValueError(f"has a field '{key}' that is not a list of strings")
        if value.get("created_unix") is not None and not is_number(value["created_unix"]):
            raise ValueError("has a field 'created_unix' that is not a number")
        for key in ("reason", "contract_hash"):
            if value.get(key) is not None and not isinstance(value[key], str):
                raise ValueError(f"has a field '{key}' that is not a string")
        known = {"phase", "chain_id", "contract", *cls._OPTIONAL}
        changes, adopted = value.get("changes"), value.get("adopted_chains")
        return cls(
            value["phase"],
            value["chain_id"],
            value["contract"],
            value.get("created_unix"),
            value.get("reason"),
            None if changes is None else tuple(changes),
            value.get("contract_hash"),
            None if adopted is None else tuple(adopted),
            {k: v for k, v in value.items() if k not in known},
        )

    @property
    def adopted(self) -> tuple[str, ...]:
        return self.adopted_chains or ()


def _phase(
    number: int,
    chain_id: str,
    contract: RunContract | None,
    reason: str,
    changes: list[str],
    adopted: tuple[str, ...] | None = None,
) -> Phase:
    items = (contract or RunContract()).items()
    return Phase(
        number, chain_id, items, time.time(), reason, tuple(changes), contract_hash(items), adopted
    )


def read_phases(root: Path) -> list[Phase]:
    """The phase records in order; each bounded, link-free, and shaped as ``write_phase`` writes
    them."""
    refuse_link(root / CONTRACT_DIR, "contract directory")
    phases = []
    for path in phase_files(root):
        try:
            phases.append(Phase.from_json(read_json(path, what="contract phase")))
        except CheckpointCorruptError as exc:
            raise CheckpointCorruptError(
                f"{exc}; phase files are append-only and must not be edited"
            ) from None
        except ValueError as exc:
            raise CheckpointCorruptError(
                f"{path} {exc}; phase files are append-only and must not be edited: "
                f"restore it from a backup"
            ) from None
    return phases


def write_phase(root: Path, record: Phase) -> Path:
    """Create ``phase_NNNN.json``; refuse to replace an existing one."""
    directory = root / CONTRACT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"phase_{record.phase:04d}.json"
    data = (json.dumps(record.to_json(), indent=1, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)
    return path


def initial_phase(chain_id: str, contract: RunContract | None) -> Phase:
    return _phase(0, chain_id, contract, "initial", [])


def check(root: Path, contract: RunContract | None, *, where: str) -> Phase:
    """The phase in force, after checking ``contract`` equals it."""
    phases = read_phases(root)
    if not phases:
        raise CheckpointCorruptError(
            f"{root / CONTRACT_DIR} holds no phase file although checkpoints exist; it is "
            "written by the first save: restore it from a backup or declare a new root"
        )
    current = phases[-1]
    changes = diff(current.contract, (contract or RunContract()).items())
    if changes:
        lines = "; ".join(d for _, d in changes)
        raise ContractMismatchError(
            f"{where}: the run contract differs from phase {current.phase} in "
            f"{root / CONTRACT_DIR}: {lines}. If the change is intended (longer training, new "
            "data), declare it: manager.declare_phase(reason, changes="
            f"{sorted({i for i, _ in changes})}); otherwise run with the original contract."
        )
    return current


def declare(root: Path, contract: RunContract | None, reason: str, changes: Iterable[str]) -> Path:
    phases = read_phases(root)
    if not phases:
        raise ConfigError(
            f"declare_phase: {root} has no contract yet; the first save writes phase 0"
        )
    if not reason.strip():
        raise ConfigError("declare_phase: give a reason (it is the audit trail of this run)")
    declared = set(changes)
    unknown = declared - set(ITEMS)
    if unknown:
        raise ConfigError(
            f"declare_phase: unknown items {sorted(unknown)}; items are {list(ITEMS)}"
        )
    current = phases[-1]
    items = (contract or RunContract()).items()
    actual = diff(current.contract, items)
    changed = {i for i, _ in actual}
    if not changed:
        raise ConfigError(
            f"declare_phase: the contract equals phase {current.phase}; nothing to declare"
        )
    if changed != declared:
        raise ContractMismatchError(
            f"declare_phase: declared {sorted(declared)} but the contract changed in "
            f"{sorted(changed)} ({'; '.join(d for _, d in actual)}); declare exactly what changed"
        )
    return write_phase(
        root, _phase(current.phase + 1, current.chain_id, contract, reason, [d for _, d in actual])
    )


# ---------------------------------------------------------------- chain identity


def chains(root: Path) -> tuple[str | None, set[str]]:
    """(the root's own chain id, the chain ids adopted into it by declared phases)."""
    phases = read_phases(root)
    if not phases:
        return None, set()
    return phases[0].chain_id, {c for p in phases for c in p.adopted}


def check_chain(root: Path, chain_id: str, *, where: str) -> None:
    """Refuse a checkpoint of another run chain unless a phase adopted it."""
    if not chain_id:
        return  # written before chain ids existed
    own, adopted = chains(root)
    if chain_id == own or chain_id in adopted:
        return
    raise ChainMismatchError(
        f"{where}: the checkpoint belongs to run chain {chain_id}, but {root} is "
        f"{'chain ' + own if own else 'not a run root yet'}. A checkpoint copied in for evaluation "
        f"or from the other arm of an experiment is not this run's past. If you mean to continue "
        f"from it, adopt it explicitly: manager.adopt(path, reason) (a new contract phase)."
    )


def adopt(root: Path, contract: RunContract | None, chain_id: str, reason: str) -> Path:
    """Append a phase that adopts ``chain_id``; creates the root's phase 0 if it has none."""

    if not reason.strip():
        raise ConfigError("adopt: give a reason (why this run continues from another chain)")
    phases = read_phases(root)
    number, chain = (phases[-1].phase + 1, phases[0].chain_id) if phases else (0, uuid.uuid4().hex)
    return write_phase(
        root, _phase(number, chain, contract, reason, [f"adopted chain {chain_id}"], (chain_id,))
    )
