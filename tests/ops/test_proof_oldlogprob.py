"""The old-logprob gate tells the rollout engine's sampling state from its weights: a 1-process RL
job with a stand-in engine (a categorical policy over 16 tokens; ``Colocated.record_old_logprobs``
records the logprobs with digests of the sampled token ids and seeds, ``record_export`` each push)
saves at step 2 and stops after step 3; a second process restores step 2 and replays step 3. A push
skipped after the restore (the engine keeps its start-up weights) must FAIL naming the engine's
weights; an engine whose sampling state a restart lost (the requests unseeded, its own generator
starting over) must FAIL naming the sampling state; a trainer whose old-logprob copy of the policy
was not restored (the same tokens get other logprobs) names the weights too."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptguard as cg
from ckptguard.integrations import vllm as cgv
from ckptguard.ops.prove import Status, evaluate
from ckptguard.testing import run_ranks, values

VOCAB, PROMPTS, GROUP = 16, 2, 3


class _Engine:
    """A stand-in rollout engine: its own weights (what the last push put there) and its own
    generator."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights.clone()
        self.scale = torch.tensor(
            2.0
        )  # the start-up scale; a push sets the one sent with the weights
        self.own = torch.Generator().manual_seed(99)  # a restarted engine starts it over
        self.hidden = (
            0  # "hidden": sampling depends on more than the request seed (here: a restart count)
        )

    def generate(self, step: int, seeded: bool) -> list[cgv.Sample]:
        probs = torch.softmax(self.weights.double() * self.scale.double(), 0)
        out = []
        for pid in range(PROMPTS):
            for i in range(GROUP):
                seed = cgv.request_seed(step, pid, i) if seeded else None
                gen = (
                    torch.Generator().manual_seed(seed + self.hidden)
                    if seed is not None
                    else self.own
                )
                tokens = torch.multinomial(probs, 4, replacement=True, generator=gen).tolist()
                lps = [float(torch.log(probs[t])) for t in tokens]
                out.append(cgv.Sample(pid, i, seed, [pid], tokens, lps))
        return out


def _job(rank: int, world: int, root: str, defect: str | None) -> int:
    weights = torch.linspace(-1.0, 1.0, VOCAB)
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(proof=cg.ProofPlan(rl=True)))
    state = {"policy": {"w": weights}}
    start = mgr.restore(state)
    weights = state["policy"]["w"]
    engine = _Engine(torch.linspace(-1.0, 1.0, VOCAB))  # the engine's start-up weights
    colocated = cgv.Colocated(None, mgr)
    if not (start and defect == "skip_push"):
        engine.weights = weights.clone()
    if not (start and defect == "stale_scale"):
        engine.scale = torch.tensor(
            1.0
        )  # the scale pushed with the weights (stale: the start-up one kept)
    if start and defect == "hidden":
        engine.hidden = 1
    # what the engine holds (a skipped push: its start-up weights; a stale scale cache: its start-up
    # scale)
    mgr.record_export(start, {"w": engine.weights}, scales=engine.scale)
    for step in range(start + 1, 4):
        samples = engine.generate(step, seeded=defect != "sampling")
        tokens = torch.tensor([t for s in samples for t in s.token_ids])
        # the trainer's kernels: float32; "old_policy": its logprob copy of the policy not restored
        # (start-up weights)
        policy = torch.linspace(-1.0, 1.0, VOCAB) if start and defect == "old_policy" else weights
        actor = torch.log_softmax(policy.float(), 0).double()[tokens]
        colocated.record_old_logprobs(step, actor, samples)
        weights = weights + 0.1 * torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)
        state["policy"]["w"] = weights
        mgr.record_step(step, sample_ids=[s.prompt_id for s in samples], loss=weights.sum())
        if step == 2:
            mgr.save(step, state)
        engine.weights, engine.scale = (
            weights.clone(),
            torch.tensor(1.0),
        )  # the push after the update
        mgr.record_export(step, {"w": engine.weights}, scales=engine.scale)
        if start == 0 and step == 3:
            break
    return start


def _gate(tmp_path: Path, defect: str | None):
    root = str(tmp_path / "ck")
    torch.set_num_threads(1)
    assert values(run_ranks(_job, 1, root, defect, distributed=False)) == [0]
    assert values(run_ranks(_job, 1, root, defect, distributed=False)) == [2]
    return next(g for g in evaluate(Path(root)) if g.name == "first old-logprob aligned")


def test_an_exact_resume_aligns_the_same_sampled_tokens(tmp_path):
    gate = _gate(tmp_path, None)
    assert gate.status is Status.PASS, gate.evidence
    assert (
        "bitwise the saving run's of the same step" in gate.evidence
        and "the same sampled token ids" in gate.evidence
    ), gate.evidence


def test_a_push_skipped_after_the_restore_is_named_as_the_engines_weights(tmp_path):
    gate = _gate(tmp_path, "skip_push")
    assert gate.status is Status.FAIL, gate.evidence
    assert "first old-logprob of step 3" in gate.evidence, gate.evidence
    assert (
        "Cause: the rollout engine's weights: its export of step 2 differs in "
        "['bytes'] from the reference's" in gate.evidence
    ), gate.evidence
    assert "sampling state" not in gate.evidence


def test_an_engine_sampling_state_lost_in_the_restart_is_named_as_such(tmp_path):
    gate = _gate(tmp_path, "sampling")
    assert gate.status is Status.FAIL, gate.evidence
    assert (
        "Cause: the rollout engine's sampling state: same weights (its export of step 2 equals the "
        "reference's) but other sampled token ids, requests unseeded" in gate.evidence
    ), gate.evidence
    assert "request_seed" in gate.evidence


def test_the_same_tokens_with_other_logprobs_are_named_as_weights(tmp_path):
    gate = _gate(tmp_path, "old_policy")
    assert gate.status is Status.FAIL, gate.evidence
    assert (
        "Cause: weights (or scales): the same sampled token ids got other "
        "logprobs; its export of step 2 equals the reference's: the trainer's "
        "recompute holds other weights" in gate.evidence
    ), gate.evidence


def test_a_stale_scale_after_the_restore_is_named_as_the_engines_weights(tmp_path):
    gate = _gate(tmp_path, "stale_scale")
    assert gate.status is Status.FAIL, gate.evidence
    assert (
        "Cause: the rollout engine's weights: its export of step 2 differs in "
        "['scales'] from the reference's" in gate.evidence
    ), gate.evidence


def test_other_tokens_with_the_same_seeds_and_weights_are_not_called_the_sampling_seeds(tmp_path):
    gate = _gate(tmp_path, "hidden")
    assert gate.status is Status.FAIL, gate.evidence
    assert (
        "Cause: the rollout engine, beyond what its export records: same weights and scales"
        in gate.evidence
    )
    assert "request_seed" not in gate.evidence, gate.evidence
