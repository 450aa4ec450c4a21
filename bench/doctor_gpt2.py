"""The doctor on the issue's GPT-2 step, each finding's fix applied and measured.

``GPT2Config(n_layer=4, n_embd=256, n_head=4)``, vocabulary 50257, batch 4 x 256 tokens, one AdamW step
(transformers 5.17, random weights). One run of the step as a user writes it (holding the model's
output), the findings memtrim gives, then for the logits findings the fixed step, measured under
torch.profiler and memtrim in the same run:

- kept-output: ``loss = model(...).loss`` (the output is not held through backward);
- logits-cross-entropy: the chunked linear + cross-entropy with the prescribed ``chunk_size``
  (``memtrim.fixes.chunked_linear_cross_entropy`` where installed, else the tests' plain-PyTorch
  stand-in with the same memory plan).

Prints, per fix: the predicted peak (the finding's what-if), the measured peak (torch.profiler), and
the bytes alive at the peak on transformers' loss lines. About two minutes on a 2-core CPU.

    python bench/doctor_gpt2.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.nn.functional as F
import transformers

import memtrim
from memtrim.units import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from groundtruth import profiler_memory

try:
    from memtrim.fixes import chunked_linear_cross_entropy  # type: ignore[attr-defined]
except ImportError:  # before memtrim.fixes is merged: the same memory plan, in plain PyTorch
    from doctor_support import ChunkedLinearCrossEntropy

    def chunked_linear_cross_entropy(  # type: ignore[misc]
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, chunk_size: int
    ) -> torch.Tensor:
        return ChunkedLinearCrossEntropy.apply(hidden, weight, None, target, chunk_size)


VOCAB, WIDTH, BATCH, TOKENS = 50257, 256, 4, 256


def loss_lines(trace: memtrim.Trace) -> int:
    return sum(g.bytes for g in trace.live_at_peak() if g.site and "transformers/loss/" in g.site.file)


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=TOKENS)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    held: list[object] = []

    def measured(body: Callable[[], object]) -> tuple[memtrim.Trace, int]:
        model.load_state_dict(weights)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with profiler_memory() as truth, memtrim.track() as trace:
            held.append(body())
            opt.step()
            opt.zero_grad()
        held.clear()
        return trace, truth.peak

    def original() -> object:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out

    before, before_peak = measured(original)
    print(
        f"GPT-2 step as written: peak {format_bytes(before_peak)} (torch.profiler), memtrim "
        f"{format_bytes(before.peak_bytes)}; transformers' loss lines at the peak "
        f"{format_bytes(loss_lines(before))}"
    )
    report = before.report()
    print(report[report.index("How to cut it") :])
    print()
    for d in before.diagnoses():
        if d.rule == "kept-output":

            def fixed() -> object:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                return loss

        elif d.rule == "logits-cross-entropy":
            chunk = int(d.fix.split("chunk_size=")[1].split(")")[0])

            def fixed(chunk: int = chunk) -> object:
                hidden = model.transformer(input_ids=ids).last_hidden_state.reshape(-1, WIDTH)
                target = F.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
                loss = chunked_linear_cross_entropy(hidden, model.lm_head.weight, target, chunk_size=chunk)
                loss.backward()
                return loss

        else:
            continue
        after, after_peak = measured(fixed)
        predicted, measured_drop = d.peak_before - d.peak_after, before_peak - after_peak
        print(
            f"{d.rule}: predicted peak {format_bytes(d.peak_after)}, measured {format_bytes(after_peak)} "
            f"({format_bytes(before_peak)} -> {format_bytes(after_peak)}; predicted drop off by "
            f"{100 * abs(predicted - measured_drop) / measured_drop:.1f}%); loss lines at the new peak "
            f"{format_bytes(loss_lines(after))}"
        )


if __name__ == "__main__":
    main()
