"""One process of tests/ops/test_proof_lora.py's LoRA job (a peft adapter needs .venv-hf; one
declared by hand runs in either venv): ``python tests/proof_lora_job.py ROOT FLAVOUR DEFECT``
restores ROOT, exports the merged weights (with ``adapter_probe``), trains to step 3 saving at step
2 on a fresh root, and prints ``RESULT <restored step>``. DEFECT=1: after a restore the adapter's
delta is merged into the base first (base + 2 x delta is exported)."""

from __future__ import annotations

import sys
from typing import Any

import torch

import ckptguard as cg
import jobexit
from ckptguard.integrations.peft import adapter_probe


class _Hand(torch.nn.Module):
    """A hand-written LoRA layer: a frozen base weight plus scaling * B @ A."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(6, 8, generator=g), requires_grad=False)
        self.a = torch.nn.Parameter(torch.randn(2, 8, generator=g))
        self.b = torch.nn.Parameter(torch.randn(6, 2, generator=g) * 0.1)
        self.head = torch.nn.Linear(6, 1)

    def delta(self) -> torch.Tensor:
        return (self.b @ self.a).detach() * 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x @ (self.weight + (self.b @ self.a) * 2.0).T)


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(torch.relu(self.q(x)))


def _peft_model() -> Any:
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q"], init_lora_weights=False)
    return peft.get_peft_model(_Two(), config)


def _export(mgr: cg.CheckpointManager, step: int, model: Any, flavour: str) -> None:
    from ckptguard.integrations.peft import merged_state

    if flavour == "peft":
        payload = merged_state(model)
        mgr.record_export(step, payload, adapter=adapter_probe(payload, model))
    else:
        payload = {
            "weight": model.weight.detach() + model.delta(),
            "head.weight": model.head.weight.detach(),
        }
        mgr.record_export(
            step, payload, adapter=adapter_probe(payload, {"weight": (model.weight, model.delta())})
        )


def _merge_into_base(model: Any, flavour: str) -> None:
    with torch.no_grad():
        if flavour == "peft":
            layer = model.get_base_model().q
            layer.base_layer.weight += layer.get_delta_weight(
                "default"
            )  # merged in place, the flag never set
        else:
            model.weight += model.delta()


def job(root: str, flavour: str, defect: bool) -> int:
    torch.manual_seed(0)
    model = _peft_model() if flavour == "peft" else _Hand()
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    state = {"model": model, "optim": optim}
    mgr = cg.CheckpointManager(root, config=cg.CheckpointConfig(proof=cg.ProofPlan(rl=True)))
    start = mgr.restore(state)
    if start and defect:
        _merge_into_base(model, flavour)
    _export(mgr, start, model, flavour)  # the push after the restore (or at the start)
    for step in range(start + 1, 4 if not start else start + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        mgr.record_step(step, loss=loss)
        if step == 2:
            mgr.save(step, state)
        _export(mgr, step, model, flavour)
    return start


if __name__ == "__main__":
    jobexit.freeze_at_exit()
    torch.set_num_threads(1)
    print(f"RESULT {job(sys.argv[1], sys.argv[2], sys.argv[3] == '1')}")
