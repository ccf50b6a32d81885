"""A tiny real HF/TRL training job for the integration tests (run in .venv-hf, not imported).

``python tests/hf_job.py CONFIG.json``; the same command is relaunched after every kill. CONFIG:

- ``out``: the output_dir; ``result``: where rank 0 writes the final params and optimizer state
- ``trainer``: ``grpo`` (TRL GRPOTrainer, a tiny random GPT-2, a word-level tokenizer built here,
  in-memory prompts, a Python reward) or ``causal`` (a plain HF Trainer on a causal LM)
- ``mode``: ``ckptguard`` (the mixin; ``attach`` for ``causal``) or ``hf`` (HF's own checkpoints,
  resumed the usual way: ``resume_from_checkpoint=get_last_checkpoint(out)``)
- ``plan``: kills, in order, as ``WHERE@STEP`` or ``WHERE@STEP@RANK``; ``fired``: a file with one
  line per kill done, so a relaunch arms the next one. ``WHERE`` is a ckptguard fault point
  (``commit.before_rename``...), ``hf:FILE`` (while HF's torch.save is about to write FILE of
  that step's folder) or ``step`` (at the end of that optimizer step, between saves).
- ``epochs``, ``save_steps``, ``save_total_limit``; ckptguard mode: ``resume_mode``,
  ``deterministic`` (the ProofPlan), ``rng_consumer`` (the save draws a random number between
  ckptguard's RNG capture and HF's); GRPO: ``num_iterations``, ``own_sampler`` (TRL's sampler hidden
  in a sampler of ours)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import jobexit  # noqa: E402

torch.set_num_threads(1)

CFG = json.loads(Path(sys.argv[1]).read_text())
RANK = int(os.environ.get("RANK", "0"))
TRAINER = None  # the running trainer, for the kill hooks


def _plan_next() -> tuple[str, int, int | None] | None:
    fired = Path(CFG["fired"]).read_text().splitlines() if Path(CFG["fired"]).exists() else []
    plan = CFG.get("plan", [])
    if len(fired) >= len(plan):
        return None
    parts = plan[len(fired)].split("@")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else None


KILL = _plan_next()


def _maybe_kill(where: str) -> None:
    if KILL is None or TRAINER is None:
        return
    point, step, rank = KILL
    if point == where and TRAINER.state.global_step == step and rank in (None, RANK):
        with open(CFG["fired"], "a") as f:
            f.write(f"{where}@{step}@{RANK}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)


def _arm() -> None:
    if KILL is None:
        return
    point = KILL[0]
    if point.startswith("hf:"):
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)):
                _maybe_kill("hf:" + os.path.basename(str(f)))
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
    elif point != "step":
        from ckptguard import _faults

        _faults.set_hook(point, lambda: _maybe_kill(point))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(29)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    out.padding_side = "left"
    return out


def _model(vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=32,
        n_embd=16,
        n_layer=1,
        n_head=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _common_args() -> dict:
    return {
        "output_dir": CFG["out"],
        "num_train_epochs": CFG.get("epochs", 2),
        "save_steps": CFG.get("save_steps", 2),
        "save_total_limit": CFG.get("save_total_limit"),
        "logging_steps": 1,
        "report_to": [],
        "seed": 42,
        "use_cpu": True,
        "learning_rate": 1e-2,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def _grpo():
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = _tokenizer()
    prompts = [" ".join(f"w{(i * 7 + j) % 29}" for j in range(3)) for i in range(8)]

    def reward(completions, **kw):
        # varies within a group, so most steps have a non-zero advantage and a real update
        return [
            float(sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())) for c in completions
        ]

    args = GRPOConfig(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        num_iterations=CFG.get("num_iterations", 1),
        **_common_args(),
    )
    kw = dict(
        model=_model(len(tokenizer)),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    if CFG["mode"] == "hf":
        return GRPOTrainer(**kw)
    import ckptguard as cg
    from ckptguard.integrations.hf import CkptguardHFMixin

    class Trainer(CkptguardHFMixin, GRPOTrainer):
        def _get_train_sampler(self, dataset=None):
            sampler = super()._get_train_sampler(dataset)
            return _OwnSampler(sampler) if CFG.get("own_sampler") else sampler

    overrides = {
        "timeout_s": 60,
        "proof": cg.ProofPlan(deterministic=bool(CFG.get("deterministic"))),
    }
    return Trainer(
        **kw,
        ckptguard_resume_mode=CFG.get("resume_mode", "auto"),
        ckptguard_config_overrides=overrides,
    )


class _OwnSampler(torch.utils.data.Sampler):
    """A user's sampler that keeps TRL's sampler (and so its generator) under a name of its own:
    not the ``.generator`` / ``.sampler`` convention the mixin finds."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(3, 32, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(8, dtype=torch.long),
            "labels": self.ids[i],
        }


def _causal():
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        per_device_train_batch_size=2,
        ddp_backend="gloo" if "RANK" in os.environ else None,
        **_common_args(),
    )
    trainer = Trainer(model=_model(32), args=args, train_dataset=_Tokens(12))
    if CFG["mode"] == "hf":
        return trainer
    from ckptguard.integrations.hf import attach

    return attach(trainer, resume_mode=CFG.get("resume_mode", "auto"), timeout_s=60)


def main() -> None:
    global TRAINER
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("transformers").setLevel(logging.WARNING)
    from transformers import TrainerCallback

    trainer = _grpo() if CFG["trainer"] == "grpo" else _causal()
    TRAINER = trainer

    class KillAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _maybe_kill("step")

    trainer.add_callback(KillAtStep())
    if CFG.get("rng_consumer"):
        # a save_model override that draws a random number: HF's rng_state.pth is then taken
        # later than ckptguard's copy, and the resume must say so instead of continuing
        real_save_model = trainer.save_model

        def save_model(*args, **kwargs):
            torch.rand(1)
            return real_save_model(*args, **kwargs)

        trainer.save_model = save_model
    _arm()
    if CFG["mode"] == "hf":
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(CFG["out"]) if os.path.isdir(CFG["out"]) else None
        print(f"job: resume_from_checkpoint={last}", file=sys.stderr, flush=True)
        trainer.train(resume_from_checkpoint=last)
    else:
        trainer.train()
    if RANK == 0:
        model = trainer.model
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(
            {
                "params": params,
                "optim": trainer.optimizer.state_dict(),
                "step": trainer.state.global_step,
            },
            CFG["result"],
        )


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    main()
