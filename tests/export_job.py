"""Run in .venv-hf (transformers): train a tiny Llama under FSDP2 (2 gloo ranks) or hold a tiny
Mixtral's experts expert-parallel (4 ranks, EP 2 x FSDP 2), commit a step, export it with the
`ckptguard export` command, load the export with transformers' from_pretrained and compare logits
with the trainer's.

A third job exports a one-rank Llama with tied input and output embeddings.

``python tests/export_job.py {fsdp2|expert|tied|all} WORKDIR`` prints one JSON object (the figures
the test asserts on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptguard as cg
import jobexit
from ckptguard.integrations.external import ExternalFiles
from ckptguard.storage import StreamingStorage
from ckptguard.testing import run_ranks, values

TOKENS = torch.tensor([[3, 17, 29, 5, 41, 8, 13, 60], [1, 2, 3, 4, 5, 6, 7, 8]])


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def tied_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _config_writer(config, rank: int):
    def write(directory: Path) -> None:
        if rank == 0:  # one writer of the shared hf/ folder
            config.save_pretrained(directory)

    return write


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.detach().clone()


def _fsdp2_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    config = llama_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for _ in range(2):
        torch.manual_seed(100 + rank)
        batch = torch.randint(0, 64, (2, 8))
        model(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        optim.zero_grad()
    storage = ExternalFiles(StreamingStorage(), {"hf": _config_writer(config, rank)})
    cg.CheckpointManager(root, storage=storage).save(2, {"model": model, "optim": optim})
    logits = _logits(model)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "logits": logits,
        "state": full if rank == 0 else None,
        "sharded": [n for n, p in model.named_parameters() if hasattr(p, "placements")],
    }


def _ep_worker(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    config = mixtral_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference = _logits(model) if rank == 0 else None
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "edp"))
    ep = mesh["ep"].get_local_rank()
    per = config.num_local_experts // 2
    for layer in model.model.layers:  # this EP rank keeps its contiguous block of experts
        experts = layer.mlp.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            block = param.detach()[ep * per : (ep + 1) * per].clone()
            setattr(experts, name, torch.nn.Parameter(block))
        fully_shard(
            experts, mesh=mesh["edp"]
        )  # FSDP inside each EP group: chunk offsets repeat across groups
    spec = cg.ExpertParallel(group=mesh["ep"].get_group())
    storage = ExternalFiles(StreamingStorage(), {"hf": _config_writer(config, rank)})
    cg.CheckpointManager(root, storage=storage, expert_parallel=spec).save(1, {"model": model})
    return {"reference": reference, "ep": ep}


def _export(root: Path, out: Path, *extra: str) -> dict:
    cli = Path(sys.executable).parent / "ckptguard"
    done = subprocess.run(
        [str(cli), "export", str(root), "--hf", str(out), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise SystemExit(f"export failed: {done.stdout} {done.stderr}")
    return json.loads(done.stdout)


def _pretrained(out: Path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(out), **kw)


def fsdp2(work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    ranks = values(run_ranks(_fsdp2_worker, 2, str(work / "ck"), timeout=300))
    trainer = ranks[0]["logits"]
    fp32 = _export(work / "ck", work / "fp32")
    bf16 = _export(work / "ck", work / "bf16", "--dtype", "bf16")
    loaded = _pretrained(work / "fp32", dtype=torch.float32)
    loaded16 = _pretrained(work / "bf16", dtype=torch.float32)
    auto16 = _pretrained(work / "bf16")
    # The trainer's weights rounded to bf16 as the cast rounds them, run in fp32: what the bf16
    # export must give.
    torch.manual_seed(0)
    rounded = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ranks[0]["state"].items()})
    return {
        "ranks_agree": bool(torch.equal(ranks[0]["logits"], ranks[1]["logits"])),
        "sharded_params": len(ranks[0]["sharded"]),
        "fp32_bitwise": bool(torch.equal(_logits(loaded), trainer)),
        "bf16_equals_rounded": bool(torch.equal(_logits(loaded16), _logits(rounded))),
        "bf16_max_abs_diff": float((_logits(loaded16) - trainer).abs().max()),
        "bf16_auto_dtype": str(next(auto16.parameters()).dtype),
        "fp32_files": fp32["files"],
        "bf16_copied": bf16["copied"],
        "trainer_logits_nonzero": bool(trainer.abs().sum() > 0),
    }


def expert(work: Path) -> dict:
    ranks = values(run_ranks(_ep_worker, 4, str(work / "ck"), timeout=300))
    result = _export(work / "ck", work / "out")
    loaded = _pretrained(work / "out", dtype=torch.float32)
    index = json.loads((work / "out" / "model.safetensors.index.json").read_text())
    return {
        "ep_ranks": sorted({r["ep"] for r in ranks}),
        "bitwise": bool(torch.equal(_logits(loaded), ranks[0]["reference"])),
        "expert_names": sorted(k for k in index["weight_map"] if "experts" in k),
        "ep_keys": sorted(
            k
            for k in json.loads((work / "ck" / "step_00000001" / "manifest.json").read_text())[
                "layout_free"
            ]["model"]
            if "#ep" in k
        ),
        "tensors": result["tensors"],
    }


def tied(work: Path) -> dict:
    """A model whose LM head is its input embedding (tie_word_embeddings): one rank, trained,
    exported."""
    from transformers import AutoModelForCausalLM

    config = tied_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=batch, labels=batch).loss.backward()
    optim.step()
    storage = ExternalFiles(StreamingStorage(), {"hf": _config_writer(config, 0)})
    cg.CheckpointManager(work / "ck", storage=storage).save(1, {"model": model, "optim": optim})
    _export(work / "ck", work / "out")
    loaded = _pretrained(work / "out", dtype=torch.float32)
    index = json.loads((work / "out" / "model.safetensors.index.json").read_text())
    return {
        "tied_in_trainer": model.lm_head.weight.data_ptr()
        == model.model.embed_tokens.weight.data_ptr(),
        "tied_after_load": loaded.lm_head.weight.data_ptr()
        == loaded.model.embed_tokens.weight.data_ptr(),
        "bitwise": bool(torch.equal(_logits(loaded), _logits(model))),
        "names": sorted(index["weight_map"]),
    }


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    mode, work = sys.argv[1], Path(sys.argv[2])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    jobs = {"fsdp2": fsdp2, "expert": expert, "tied": tied}
    run = list(jobs) if mode == "all" else [mode]
    out = {}
    for name in run:  # one interpreter for both: transformers' import is the expensive part
        (work / name).mkdir()
        out[name] = jobs[name](work / name)
    print(json.dumps(out))
