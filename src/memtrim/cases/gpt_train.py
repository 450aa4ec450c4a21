"""``python -m memtrim.cases.gpt_train``: three AdamW steps of the GPT demo's model, written as a user's
training script is (plain PyTorch; nothing of memtrim in the loop). ``make demo`` fits it to a budget:
``memtrim fit --budget 96MiB -m memtrim.cases.gpt_train``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memtrim.cases import gpt


def main(steps: int = 3) -> None:
    torch.manual_seed(0)
    cfg = gpt.DEMO
    model = gpt.GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = gpt.batch(cfg, 4)
    for step in range(steps):
        logits = model(x).logits
        loss = F.cross_entropy(logits.view(-1, cfg.vocab), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
