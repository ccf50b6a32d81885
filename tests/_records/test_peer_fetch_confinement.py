"""A peer that sends a rank's part of a step (``replica.send_part`` / ``recv_part``, the fetch of a
tiered restore) is trusted for bytes it can prove, never for where they go: the receiver accepts
only the files the step's manifest lists for that rank, under the step's temp directory, and the
contract phases the manifest names. A crafted header that names a tracker, ``trust.json``, a hold
or another step's manifest plants nothing in the receiving root, and one that does not parse is a
problem the fetch reports, never a bare ``TypeError``.

One job of two gloo ranks: rank 0 saves a real step of world 2 on a shared root, then plays the
peer, sending rank 1's part with one crafted entry per case; rank 1 receives each into a fresh
temp directory of an empty root and reports what it returned and what its root holds after.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.testing import run_ranks, values

STEP = 3
TIMEOUT_S = 30.0
# Root files a hostile peer would like to plant: the resume pointer, the trust record, a hold that
# stops retention, the marker of a step that was never saved.
PLANTED = [
    "latest_checkpointed_iteration.txt",
    "trust.json",
    "holds/5.json",
    "step_00000050/manifest.json",
]


def _cases(spec_type: type, manifest_spec: object, first_file: object) -> dict[str, dict]:
    mk = spec_type
    size, xxh = first_file.size, first_file.xxh3  # type: ignore[attr-defined]
    cases = {f"root:{p}": {"spec": mk(p, size, xxh, "root")} for p in PLANTED}
    # Inside the temp directory but not the rank's part: the marker files of the step, another
    # rank's extras.
    cases["step:node_manifest.json"] = {"spec": mk("node_manifest.json", size, xxh, "step")}
    cases["step:rank_00000.pt"] = {"spec": mk("rank_00000.pt", size, xxh, "step")}
    cases["step:owner.json"] = {"spec": mk("owner.json", size, xxh, "step")}
    cases["where:elsewhere"] = {"spec": mk("state/x", size, xxh, "elsewhere")}
    cases["header:unknown field"] = {
        "raw": {"path": "rank_00001.pt", "size": size, "xxh3": xxh, "mode": "0777"}
    }
    cases["header:wrong step"] = {"step": STEP + 1}
    return cases


def _job(rank: int, world: int, base: str) -> dict:
    from ckptguard._commit import p2p, replica
    from ckptguard._records import manifest as _manifest
    from ckptguard._records.manifest import files_needed

    base_p = Path(base)
    src_root = base_p / "src"
    mgr = cg.CheckpointManager(src_root, config=cg.CheckpointConfig(timeout_s=TIMEOUT_S))
    torch.manual_seed(rank)
    mgr.save(STEP, {"w": torch.arange(4.0), "n": cg.PerRank(torch.tensor([rank]))})
    name = f"step_{STEP:08d}"
    step_dir = src_root / name
    manifest = _manifest.read(step_dir)
    specs, paths = replica.fetch_plan(
        src_root, name, files_needed(step_dir, manifest, 1), manifest.files, 1
    )
    manifest_spec = next(s for s in specs if s.path == "manifest.json")
    data_spec = next(s for s in specs if s.path == "rank_00001.pt")
    data_path = paths[specs.index(data_spec)]
    out: dict = {}
    cases = _cases(p2p.FileSpec, manifest_spec, data_spec)
    dst_root = base_p / "dst"
    for i, (case, how) in enumerate(cases.items()):
        if rank == 0:
            header_specs = [s.__dict__ for s in specs]
            if "spec" in how:  # one more entry, right after the first, sent with real bytes
                header_specs.insert(1, how["spec"].__dict__)
                send_paths = [*paths[:1], data_path, *paths[1:]]
                send_specs = [*specs[:1], how["spec"], *specs[1:]]
            else:
                send_paths, send_specs = paths, specs
            if "raw" in how:
                header_specs.insert(1, how["raw"])
            link = p2p.Link(None, step=STEP, what="test fetch", retry="again", timeout_s=TIMEOUT_S)
            p2p.send_json(link, {"step": how.get("step", STEP), "files": header_specs}, 1)
            sent = []
            for s, p in zip(send_specs, send_paths, strict=True):
                problem = p2p.send_file(link, p, s, 1)
                sent.append(s.path)
                if problem is not None:
                    break
            out[case] = {"sent": sent}
        else:
            root = dst_root / f"case{i}"
            root.mkdir(parents=True)
            tmp = root / f".tmp-{name}-{i:012x}"
            tmp.mkdir()
            try:
                problems = replica.recv_part(root, tmp, 1, 0, None, step=STEP, timeout_s=5.0)
                raised = None
            except (
                Exception
            ) as exc:  # the bug this guards: a bare TypeError out of a crafted header
                problems, raised = [], f"{type(exc).__name__}: {exc}"
            planted = [p for p in PLANTED if (root / p).exists()]
            in_tmp = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
            out[case] = {
                "problems": problems,
                "raised": raised,
                "planted": planted,
                "tmp": in_tmp,
                "root": sorted(
                    p.relative_to(root).as_posix()
                    for p in root.rglob("*")
                    if p.is_file() and tmp not in p.parents
                ),
            }
        # Both ranks start the next case together (the sender may stop early).
        torch.distributed.barrier()
    # An honest part still arrives whole: the receiver's checks refuse only what the manifest does
    # not list.
    if rank == 0:
        out["honest"] = replica.send_part(specs, paths, 1, None, step=STEP, timeout_s=TIMEOUT_S)
    else:
        root = dst_root / "honest"
        tmp = root / f".tmp-{name}-{0:012x}"
        tmp.mkdir(parents=True)
        problems = replica.recv_part(root, tmp, 1, 0, None, step=STEP, timeout_s=TIMEOUT_S)
        out["honest"] = {
            "problems": problems,
            "files": sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()),
        }
    return out


def test_a_peer_cannot_plant_files_outside_the_ranks_part_of_the_step(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _, received = values(run_ranks(_job, 2, str(tmp_path), timeout=180))
    for case, got in received.items():
        if case == "honest":
            continue
        assert got["raised"] is None, (
            case,
            "a crafted header raised instead of a reported problem",
            got["raised"],
        )
        assert got["planted"] == [], (
            case,
            "the peer planted files in the receiving root",
            got["planted"],
        )
        assert got["problems"], (
            case,
            "the receiver accepted a file the manifest does not list for it",
            got,
        )
        leaked = [p for p in got["root"] if not p.startswith("contract/")]
        assert leaked == [], (case, "files outside the step's temp directory", leaked)
        text = " ".join(got["problems"])
        assert "step 3" in text and "rank 0" in text, (
            case,
            "the problem names the step and the peer",
            text,
        )
    bad_spec = received["step:node_manifest.json"]
    assert "node_manifest.json" not in bad_spec["tmp"], bad_spec
    assert "rank_00000.pt" not in received["step:rank_00000.pt"]["tmp"], received[
        "step:rank_00000.pt"
    ]
    assert "owner.json" not in received["step:owner.json"]["tmp"]
    assert "unknown field" in " ".join(
        received["header:unknown field"]["problems"]
    ) or "mode" in " ".join(received["header:unknown field"]["problems"])
    honest = received["honest"]
    assert honest["problems"] == [], honest
    assert "contract/phase_0000.json" in honest["files"] and any(
        f.endswith("rank_00001.pt") for f in honest["files"]
    )
