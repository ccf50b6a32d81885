"""The manifest builder returns a typed Manifest whose JSON is exactly what is on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckptguard as cg
from ckptguard._records import manifest as _manifest
from ckptguard._records.entries import FileEntry, NodeEntry, Topology
from ckptguard.demo.toyjob import build_job, train_step

FIXTURE = Path(__file__).parents[1] / "fixtures" / "v1" / "root" / "step_00000003"


def test_written_manifest_round_trips_through_the_typed_manifest(tmp_path):
    job = build_job()
    train_step(job)
    step_dir = cg.CheckpointManager(tmp_path).save(1, job.state())
    raw = json.loads((step_dir / "manifest.json").read_text())
    typed = _manifest.read(step_dir)
    assert isinstance(typed, _manifest.Manifest)
    assert typed.to_json() == raw  # nothing lost, nothing added between the builder and the disk
    assert typed.cost is not None and typed.cost.bytes > 0
    assert typed.layout_free and set(typed.layout_free) <= set(typed.items)


def test_an_older_manifest_without_the_optional_fields_reads_and_writes_back_the_same():
    raw = json.loads((FIXTURE / "manifest.json").read_text())
    typed = _manifest.read(FIXTURE)
    assert typed.layout_free is None
    assert typed.to_json() == raw


def _write_manifest(step_dir: Path, data: dict) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "manifest.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_every_format_reads_into_typed_records_and_writes_back_byte_for_byte(version):
    step_dir = Path(__file__).parents[1] / "fixtures" / version / "root" / "step_00000003"
    raw = (step_dir / "manifest.json").read_bytes()
    typed = _manifest.read(step_dir)
    assert all(isinstance(f, FileEntry) for f in typed.files) and isinstance(
        typed.topology, Topology
    )
    assert typed.files[0].rank == 0 and typed.topology.world_size == 1 and typed.topology.rank_hosts
    assert (json.dumps(typed.to_json(), indent=1, sort_keys=True) + "\n").encode() == raw
    assert (typed.cost is None) == (version == "v1")


def test_node_entries_and_cost_extras_are_typed_and_round_trip(tmp_path):
    v3 = Path(__file__).parents[1] / "fixtures" / "v3" / "root" / "step_00000003"
    data = json.loads((v3 / "manifest.json").read_text())
    data["topology"] = {**data["topology"], "world_size": 2, "rank_hosts": ["a", "b"], "dp": 2}
    data["nodes"] = [
        {"name": "a", "ranks": [0], "copies": ["state/.metadata"]},
        {"name": "b", "ranks": [1], "copies": []},
    ]
    data["cost"] = {**data["cost"], "staged_bytes": 12, "skipped_saves": 1}
    _write_manifest(tmp_path / "step_00000003", data)
    typed = _manifest.read(tmp_path / "step_00000003")
    assert typed.nodes == (NodeEntry("a", (0,), ("state/.metadata",)), NodeEntry("b", (1,), ()))
    assert typed.node_of(1) == 1 and typed.topology.shape()["dp"] == 2
    assert (
        typed.cost is not None
        and typed.cost.figure("staged_bytes") == 12
        and typed.cost.figure("save_seconds")
    )
    assert typed.to_json() == data


@pytest.mark.parametrize(
    "field,value,said",
    [
        (
            "files",
            [{"path": "rank_00000.pt", "size": "12", "xxh3": "ab", "rank": 0}],
            "'files' must be a list",
        ),
        ("files", [{"path": 3, "size": 12, "xxh3": "ab"}], "'files' must be a list"),
        ("topology", {"world_size": 0}, "outside 1.."),
        ("topology", {"world_size": 1, "rank_hosts": [1]}, "rank_hosts"),
        ("nodes", [{"name": "a", "ranks": [1], "copies": []}], "covering every rank once"),
        ("nodes", [{"name": "a", "ranks": [0]}], "covering every rank once"),
    ],
)
def test_a_crafted_entry_is_refused_on_read_naming_what_is_wrong(tmp_path, field, value, said):
    data = json.loads((FIXTURE / "manifest.json").read_text())
    data[field] = value
    _write_manifest(tmp_path / "step_00000003", data)
    with pytest.raises(cg.CheckpointCorruptError, match=said):
        _manifest.read(tmp_path / "step_00000003")


def test_a_node_manifest_reads_typed_and_a_damaged_one_is_refused(tmp_path):
    files = [FileEntry("rank_00000.pt", 10, "ab", 0)]
    record = _manifest.node_manifest(step=3, index=0, name="a", ranks=[1, 0], files=files)
    (tmp_path / "node_manifest.json").write_text(json.dumps(record.to_json()))
    got = _manifest.read_node(tmp_path)
    assert got is not None and got.ranks == (0, 1) and got.files == tuple(files) and got.step == 3
    (tmp_path / "node_manifest.json").write_text(
        json.dumps({**record.to_json(), "files": [{"path": "x"}]})
    )
    with pytest.raises(cg.CheckpointCorruptError, match="not a node manifest"):
        _manifest.read_node(tmp_path)


def test_trust_entries_are_typed_written_back_the_same_and_a_bad_one_names_its_step(tmp_path):
    from ckptguard._records import trust as _trust

    _trust.committed(tmp_path, 1, 2, on_disk=[1])
    _trust.committed(tmp_path, 2, 2, on_disk=[1, 2])
    assert _trust.observe(tmp_path, [2, 3], [], lambda s: True) == [1]
    entries = _trust.read(tmp_path)
    assert entries[1].state is _trust.Trust.VERIFIED and entries[1].healthy_after == (2, 3)
    assert (
        entries[2].healthy_after == (3,)
        and _trust.describe(entries[2]) == "candidate (1/2 healthy steps after it)"
    )
    raw = json.loads((tmp_path / "trust.json").read_text())
    assert {int(k): _trust.TrustEntry.from_json(v).to_json() for k, v in raw["steps"].items()} == {
        int(k): v for k, v in raw["steps"].items()
    }
    raw["steps"]["2"]["healthy_after"] = ["3"]
    (tmp_path / "trust.json").write_text(json.dumps(raw))
    with pytest.raises(cg.CheckpointCorruptError, match="step 2: 'healthy_after'"):
        _trust.read(tmp_path)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_proof_records_of_every_format_read_typed_and_write_back_line_for_line(version):
    from ckptguard._records.proofreader import ProofRecord, read_records

    root = Path(__file__).parents[1] / "fixtures" / version / "root"
    lines = (root / "proof" / "rank_00000.jsonl").read_text().splitlines()
    records = read_records(root)[0]
    assert all(isinstance(r, ProofRecord) for r in records) and records[0].event == "save"
    assert records[0].step == 3 and records[0].rank == 0 and isinstance(records[0].mono, float)
    assert [json.dumps(r.to_json(), sort_keys=True) for r in records] == lines
    assert (
        records[0]["plan"] == json.loads(lines[0])["plan"]
    )  # the event's own fields read as written


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("time", "noon", "'time' is 'noon', not a number"),
        ("rank", 1.0, "'rank' is 1.0, not an int"),
        ("host", 7, "'host' is 7, not a string"),
        ("pid", None, "no int 'pid'"),
    ],
)
def test_a_proof_record_with_a_bad_header_is_refused_naming_file_line_and_field(
    tmp_path, field, value, said
):
    from ckptguard._records.proofreader import read_records

    good = {"event": "save", "pid": 1, "rank": 0, "host": "h", "time": 1.0, "mono": 1.0, "step": 2}
    path = tmp_path / "proof" / "rank_00000.jsonl"
    path.parent.mkdir()
    path.write_text(
        json.dumps(good)
        + "\n"
        + json.dumps({**good, field: value})
        + "\n"
        + json.dumps(good)
        + "\n"
    )
    with pytest.raises(
        cg.CheckpointCorruptError, match=r"rank_00000\.jsonl:2 is not a proof record"
    ) as info:
        read_records(tmp_path)
    assert said in str(info.value)


def test_a_record_the_writer_could_not_read_back_is_refused_when_made(tmp_path):
    from ckptguard._records.proofwriter import ProofLog

    log = ProofLog(tmp_path, 0)
    with pytest.raises(
        cg.ConfigError, match=r"the step proof record of rank 0 .*'time' is 'noon', not a number"
    ):
        log.build("step", step=7, time="noon")
    assert log.build("step", step=7).step == 7


def test_a_step_earlier_releases_wrote_as_a_float_reads_as_no_step_and_is_kept(tmp_path):
    from ckptguard._records.proofreader import read_records

    path = tmp_path / "proof" / "rank_00000.jsonl"
    path.parent.mkdir()
    lines = [
        {"event": "export", "pid": 1, "step": 5.0},
        {"event": "update", "pid": 1, "step": None},
        {"event": "save", "pid": 1, "step": 6},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = read_records(tmp_path)[0]
    assert [r.step for r in records] == [None, None, 6] and [r.to_json() for r in records] == lines
    assert read_records(tmp_path, rank=1) == {} and len(read_records(tmp_path, rank=0)[0]) == 3


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
def test_contract_phases_of_every_format_read_typed_and_write_back_the_same(version):
    from ckptguard._records import contract as _contract

    root = Path(__file__).parents[1] / "fixtures" / version / "root"
    phases = _contract.read_phases(root)
    raw = [json.loads(p.read_text()) for p in _contract.phase_files(root)]
    assert phases and all(isinstance(p, _contract.Phase) for p in phases)
    assert [p.to_json() for p in phases] == raw
    assert phases[0].phase == 0 and phases[0].reason == "initial" and phases[0].adopted == ()


def test_declared_and_adopted_phases_are_typed_records_and_a_bad_one_names_its_file(tmp_path):
    from ckptguard._records import contract as _contract

    root = tmp_path / "ck"
    job = build_job()
    mgr = cg.CheckpointManager(
        root, config=cg.CheckpointConfig(contract=cg.RunContract(total_steps=4))
    )
    mgr.save(1, job.state())
    _contract.adopt(root, cg.RunContract(total_steps=4), "other-chain", "eval copy")
    phases = _contract.read_phases(root)
    assert [p.phase for p in phases] == [0, 1] and phases[1].adopted == ("other-chain",)
    assert phases[1].chain_id == phases[0].chain_id and _contract.chains(root)[1] == {"other-chain"}
    path = root / "contract" / "phase_0001.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "adopted_chains": "other-chain"}))
    said = r"phase_0001\.json has a field 'adopted_chains' that is not a list"
    with pytest.raises(cg.CheckpointCorruptError, match=said):
        _contract.read_phases(root)
