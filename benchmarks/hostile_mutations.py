"""Random mutations of a committed step's ``.metadata``, manifest and tracker (issue 42's
acceptance).

For each mutation: a fresh copy of a one-step root is damaged in one file (a ``.metadata`` change
has its checksum and size in the manifest fixed to match, as an attacker with write access would),
then the operator commands (``list``, ``verify``, ``verify --deep``, ``preflight``, ``resolve``) run
in this process through click, and a real ``CheckpointManager.restore`` runs too. A mutation fails
the bar when

- an operator command calls the step good (committed, OK, READY, resolved to it) and restore
  refuses, unless the damage is one that only reading the tensor bytes can show (a digest string
  edited in the manifest, a chunk moved inside its file) and ``verify --deep`` (or ``--deep
  --restore``, which restores in a new process) catches it: those are listed apart as
  ``bytes_only``, with what caught them;
- a command shows a traceback (an exception escapes click) or calls its error a ckptguard bug;
- restore raises anything but a ``CheckpointError`` (a bare ``AttributeError``);
- anything runs past ``--timeout-s`` (a hang), or asks for more memory than the process may map (the
  address space is capped at its size at the start plus ``--headroom-gib``: a declared 4 TiB tensor
  is then a MemoryError/RuntimeError naming the allocation, counted as an allocation failure), or
  the process's peak RSS grows by more than 256 MiB during one mutation (the step holds 33 kB).

    python benchmarks/hostile_mutations.py --n 400 --seed 42 \\
        --out benchmarks/results/hostile_mutations.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import xxhash
from click.testing import CliRunner

import ckptguard as cg
from ckptguard.cli import main as cli_main

TRACKER = "latest_checkpointed_iteration.txt"
_GREW_MAX = 256 << 20
STEP = "step_00000001"


class Hang(Exception):
    pass


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "n": 1}


def build(base: Path) -> Path:
    root = base / "clean"
    cg.CheckpointManager(root).save(1, _state())
    return root


# ---------------------------------------------------------------- mutations


def _flip(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.random()
    i = rng.randrange(len(b))
    if kind < 0.6:
        b[i] ^= 1 << rng.randrange(8)
    elif kind < 0.8:
        b[i] = rng.randrange(256)
    elif kind < 0.9:
        del b[i:]
    else:
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5)))
    return bytes(b)


_LEAVES: list[Any] = [
    None,
    -1,
    0,
    1,
    2**63,
    2**70,
    1.5,
    "",
    "x",
    "../../etc/passwd",
    [],
    {},
    True,
    [1, 2],
    {"a": 1},
]


def _paths(obj: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*at, i))
    return out


def _mutate_json(text: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return _flip(text, rng)
    data = json.loads(text)
    at = rng.choice(_paths(data))
    parent = data
    for k in at[:-1]:
        parent = parent[k]
    if rng.random() < 0.2 and isinstance(parent, dict):
        del parent[at[-1]]
    elif (
        isinstance(parent[at[-1]], int)
        and not isinstance(parent[at[-1]], bool)
        and rng.random() < 0.5
    ):
        parent[at[-1]] += rng.choice([-1, 1, 1 << 40])
    else:
        parent[at[-1]] = rng.choice(_LEAVES)
    return json.dumps(data, indent=1).encode()


_TRACKERS = [
    b" 1",
    b"1 ",
    b"01",
    b"+1",
    b"-1",
    b"1e0",
    b"1.0",
    b"99999999999999999999999",
    b"\x001",
    b"",
    b"2",
    b"0",
    b"1\n\n",
    b"\t1\n",
    b"\xff\xfe1",
]


def mutate(root: Path, rng: random.Random) -> str:
    target = rng.choice(["metadata", "metadata", "manifest", "tracker"])
    step = root / STEP
    if target == "tracker":
        new = (
            rng.choice(_TRACKERS)
            if rng.random() < 0.7
            else _flip((root / TRACKER).read_bytes(), rng)
        )
        (root / TRACKER).write_bytes(new)
        return f"tracker {new!r}"
    if target == "manifest":
        path = step / "manifest.json"
        path.write_bytes(_mutate_json(path.read_bytes(), rng))
        return "manifest"
    path = step / "state" / ".metadata"
    new = _flip(path.read_bytes(), rng)
    path.write_bytes(new)
    manifest = json.loads((step / "manifest.json").read_text())
    for entry in manifest["files"]:
        if (
            entry["path"] == "state/.metadata"
        ):  # the checksum fixed to match: the checks must look deeper
            entry["size"], entry["xxh3"] = len(new), xxhash.xxh3_64(new).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return "metadata"


# ---------------------------------------------------------------- the verdicts


def _cli(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = CliRunner().invoke(cli_main, args, catch_exceptions=True)
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.output, exc


def operator_verdicts(root: Path) -> tuple[dict[str, bool], list[str]]:
    """Which commands call step 1 good, and the problems their runs showed (tracebacks, "a bug")."""
    good: dict[str, bool] = {}
    problems: list[str] = []
    runs = {
        "list": ["list", str(root), "--json"],
        "verify": ["verify", str(root), "--json"],
        "verify --deep": ["verify", str(root), "--deep", "--json"],
        "preflight": ["preflight", str(root), "--json"],
        "resolve": ["resolve", str(root), "--json"],
    }
    for name, args in runs.items():
        code, out, exc = _cli(args)
        if exc is not None:
            problems.append(f"{name}: traceback {type(exc).__name__}: {exc}")
        if "bug in ckptguard" in out:
            problems.append(f"{name}: calls its error a ckptguard bug: {out.strip()[-300:]}")
        try:
            data = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        except ValueError:
            data = {}
        if name == "list":
            good[name] = code == 0 and any(
                e.get("step") == 1 and e.get("state") == "committed"
                for e in data.get("entries", [])
            )
        elif name == "resolve":
            good[name] = code == 0 and data.get("step") == 1
        else:
            good[name] = code == 0
    return good, problems


def restore_verdict(root: Path, path: Path | None) -> tuple[int | None, str]:
    """(the step restored, or None when restore refused; what happened). ``path``: restore that step
    directory (what ``list`` and ``verify`` speak of), else the root as a job would (``resolve``,
    ``preflight``)."""
    state = _state()
    try:
        step = cg.CheckpointManager(root).restore(state, path=path)
    except cg.CheckpointError as exc:
        return None, f"refused: {type(exc).__name__}: {str(exc)[:200]}"
    except Exception as exc:
        return None, f"BARE {type(exc).__name__}: {str(exc)[:200]}"
    return step, f"restored step {step}"


def _said_step(root: Path) -> int | None:
    code, out, _ = _cli(["resolve", str(root), "--json"])
    try:
        return int(json.loads(out.strip().splitlines()[-1])["step"]) if code == 0 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def one(base: Path, clean: Path, i: int, rng: random.Random, timeout_s: int) -> dict[str, Any]:
    root = base / f"m{i}"
    shutil.copytree(clean, root, symlinks=True)
    what = mutate(root, rng)
    signal.alarm(timeout_s)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        found = _judge(root, what, i)
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) << 10
        if (
            grew > _GREW_MAX
        ):  # the whole step is 33 kB: anything near this was allocated from a declared size
            found["problems"].append(f"the peak RSS grew by {grew >> 20} MiB")
        return found
    except Hang:
        return {"i": i, "what": what, "problems": [f"hang: past {timeout_s} s"]}
    finally:
        signal.alarm(0)
        shutil.rmtree(root, ignore_errors=True)


def _judge(root: Path, what: str, i: int) -> dict[str, Any]:
    """The verdicts on one damaged root (see the module doc)."""
    good, problems = operator_verdicts(root)
    said = _said_step(root)
    step_restored, how_step = restore_verdict(root, root / STEP)
    auto_restored, how_auto = restore_verdict(root, None)
    for how in (how_step, how_auto):
        if how.startswith("BARE"):
            problems.append(f"restore raised a bare exception: {how}")
        if "MemoryError" in how or "can't allocate" in how:
            problems.append(f"restore allocated beyond the real bytes: {how}")
    # list and verify speak of step 1 itself; resolve and preflight of what a job's restore would
    # load.
    lying = [k for k in ("list", "verify", "verify --deep") if good[k] and step_restored != 1]
    lying += [
        k
        for k in ("resolve", "preflight")
        if good[k] and (auto_restored is None or auto_restored != said)
    ]
    caught_by = None
    if lying and not good["verify --deep"]:
        caught_by = "verify --deep"
    elif (
        lying
    ):  # only a real restore compares what is left (a plain value's digest): does verify --restore?
        code, _, _ = (
            _cli(["verify", str(root), "--deep", "--restore", "--json"])
            if root.exists()
            else (0, "", None)
        )
        caught_by = "verify --restore" if code != 0 else None
    if lying and caught_by is None:
        problems.append(
            f"{', '.join(lying)} call the step good; restore of step 1: {how_step}; "
            f"restore of the root: {how_auto} (resolve said {said})"
        )
    return {
        "i": i,
        "what": what,
        "good": good,
        "said": said,
        "restore_step": how_step,
        "restore_root": how_auto,
        "problems": problems,
        "bytes_only": bool(lying and caught_by),
        "caught_by": caught_by,
    }


def _cap_address_space(headroom: int) -> None:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    now = pages * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (now + headroom, resource.RLIM_INFINITY))


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run(n: int, seed: int, timeout_s: int, headroom_gib: float) -> dict[str, Any]:
    import logging

    logging.getLogger("ckptguard").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGALRM, _on_alarm)
    rng = random.Random(seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        clean = build(base)
        _cap_address_space(int(headroom_gib * (1 << 30)))
        results = [one(base, clean, i, rng, timeout_s) for i in range(n)]
    bad = [r for r in results if r["problems"]]
    return {
        "n": n,
        "seed": seed,
        "seconds": round(time.monotonic() - t0, 1),
        "targets": dict(Counter(r["what"].split()[0] for r in results)),
        "restored": sum(
            1 for r in results if r.get("restore_step", "").startswith("restored step 1")
        ),
        "failed": len(bad),
        "failures": bad,
        "bytes_only": [
            {k: r[k] for k in ("i", "what", "good", "caught_by", "restore_step")}
            for r in results
            if r.get("bytes_only")
        ],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--timeout-s", type=int, default=60)
    parser.add_argument("--headroom-gib", type=float, default=8.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = run(args.n, args.seed, args.timeout_s, args.headroom_gib)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}))
    for r in report["failures"][:40]:
        print(r["i"], r["what"], "|", "; ".join(r["problems"])[:400])
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
