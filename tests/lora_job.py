"""Run in .venv-hf (transformers + peft): a LoRA job on a tiny Llama saved adapter-only with
LoraCheckpoint, resumed in a fresh model (bitwise), refused on another base, another adapter config
and a base merged in memory, exported merged once (`ckptguard export --merged`) and compared with
peft's own merge; a merge applied twice and a base replaced by a merged one are caught.

``python tests/lora_job.py WORKDIR`` prints one JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import ckptguard as cg
import jobexit
from ckptguard.integrations import peft as cpeft
from ckptguard.ops import merge

TOKENS = torch.tensor([[3, 17, 29, 5, 41, 8, 13, 60]])


def base_model(seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def lora(base_dir: Path, r: int = 4):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(7)
    peft_model = get_peft_model(
        model, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    return peft_model, torch.optim.AdamW(
        [p for p in peft_model.parameters() if p.requires_grad], lr=1e-2, foreach=False
    )


def train(model, optim, steps: range) -> None:
    for step in steps:
        torch.manual_seed(1000 + step)
        batch = torch.randint(0, 64, (2, 8))
        model(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        optim.zero_grad()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.clone()


def refused(call) -> str:
    try:
        call()
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not refused"


def main(work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    base_model(0).save_pretrained(work / "base")
    base_model(1).save_pretrained(work / "base2")
    root = work / "ck"
    model, optim = lora(work / "base")
    ck = cpeft.LoraCheckpoint(cg.CheckpointManager(root), model, optim, base_dir=work / "base")
    train(model, optim, range(1, 3))
    ck.save(2)
    train(model, optim, range(3, 5))
    straight = logits(model)
    out: dict = {
        "saved_keys": sorted(
            json.loads((root / "step_00000002/manifest.json").read_text())["layout_free"]["adapter"]
        ),
        "cache": (root / cpeft.CACHE_NAME).exists(),
    }

    # Resumed exactly in a fresh model built from the base files.
    model, optim = lora(work / "base")
    step = cpeft.LoraCheckpoint(
        cg.CheckpointManager(root), model, optim, base_dir=work / "base"
    ).restore()
    train(model, optim, range(3, 5))
    out["resumed_step"], out["resume_bitwise"] = step, bool(torch.equal(logits(model), straight))

    other, other_optim = lora(work / "base2")
    out["other_base"] = refused(
        cpeft.LoraCheckpoint(
            cg.CheckpointManager(root), other, other_optim, base_dir=work / "base2"
        ).restore
    )
    wider, wider_optim = lora(work / "base", r=8)
    out["other_config"] = refused(
        cpeft.LoraCheckpoint(
            cg.CheckpointManager(root), wider, wider_optim, base_dir=work / "base"
        ).restore
    )
    model, optim = lora(work / "base")
    again = cpeft.LoraCheckpoint(cg.CheckpointManager(root), model, optim, base_dir=work / "base")
    again.restore()
    # merged into the base weights in memory, then the adapter restored again on top
    model.merge_adapter()
    out["merged_in_memory"] = refused(again.restore)

    # Merged once: the export equals peft's own merge of the restored step, bit for bit.
    model, optim = lora(work / "base")
    cpeft.LoraCheckpoint(cg.CheckpointManager(root), model, optim, base_dir=work / "base").restore()
    peft_merged = model.merge_and_unload()
    cli = Path(sys.executable).parent / "ckptguard"
    done = subprocess.run(
        [str(cli), "export", str(root), "2", "--hf", str(work / "merged"), "--merged", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out["export"] = json.loads(done.stdout) if done.returncode == 0 else done.stdout + done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(str(work / "merged"), dtype=torch.float32)
    want = peft_merged.state_dict()
    got = loaded.state_dict()
    out["merged_bitwise"] = sorted(got) == sorted(want) and all(
        torch.equal(got[k], want[k]) for k in want
    )
    out["merged_logits_bitwise"] = bool(torch.equal(logits(loaded), logits(peft_merged)))
    out["merged_differs_from_base"] = not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        AutoModelForCausalLM.from_pretrained(str(work / "base")).state_dict()[
            "model.layers.0.self_attn.q_proj.weight"
        ],
    )
    verify = subprocess.run(
        [str(cli), "verify", str(work / "merged"), "--deep"], capture_output=True, text=True
    )
    out["verify_rc"] = verify.returncode
    proof = subprocess.run([str(cli), "prove", str(root), "--json"], capture_output=True, text=True)
    gates = {g["gate"]: g for g in json.loads(proof.stdout)["gates"]}
    out["prove_lora"] = gates.get("LoRA base and adapter", {}).get("evidence", "absent")

    # Negative controls: the delta added twice by the exporter, and a base replaced by a merged one.
    once = merge.merge_delta

    def twice(w, a, b, scaling, fan):
        once(w, a, b, scaling, fan)
        once(w, a, b, scaling, fan)

    merge.merge_delta = twice
    step_dir = root / "step_00000002"
    out["double_merge"] = refused(lambda: merge.export_merged(step_dir, work / "twice"))
    merge.merge_delta = once
    out["double_merge_published"] = (work / "twice").exists()
    peft_merged.save_pretrained(work / "base")  # the base folder now holds base + adapter
    out["merged_base"] = refused(lambda: merge.export_merged(step_dir, work / "again"))
    return out


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    torch.set_num_threads(1)
    print(json.dumps(main(Path(sys.argv[1]))))
