"""The ``chunked-head-loss`` lever of memtrim.plan: a plain-code ``F.cross_entropy`` of a model's head
(``model(x).logits.view(-1, V)``, with shifts and ``.float()`` on the way) predicted on the recording,
applied by ``memtrim.applied`` and by the code the plan prints, measured with torch.profiler's allocation
events, and proven by ``memtrim.verify.verify_fix`` on the head's own weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from groundtruth import profiler_memory
from torch import nn

import memtrim
from memtrim.cases import gpt
from memtrim.plan.search import options_of

CFG = gpt.GPTConfig(vocab=8192, context=32, width=48, layers=2, heads=2)


def _profiled_peak(step: object) -> int:
    with profiler_memory() as truth:
        step()  # type: ignore[operator]
    return truth.peak_in_window


def _gpt_step() -> tuple[gpt.GPT, object]:
    model = gpt.GPT(CFG, seed=0)
    optimizer = gpt.optimizer(model)
    x, y = gpt.batch(CFG, 4)

    def step() -> None:
        gpt.original_step(model, optimizer, x, y)

    step()  # AdamW's state exists from here on, as in every later step of a loop
    return model, step


def test_fit_chunks_a_plain_code_loss_at_70_and_45_percent_and_the_printed_code_does_the_same() -> None:
    model, step = _gpt_step()
    unplanned = _profiled_peak(step)
    for fraction in (0.70, 0.45):
        budget = int(unplanned * fraction)
        plan = memtrim.fit(step, budget=budget)
        assert [(lever.lever, lever.target) for lever in plan.levers] == [
            ("chunked-head-loss", "GPT.lm_head")
        ]
        assert plan.levers[0].keeps == "reference"
        with memtrim.applied(plan):
            measured = _profiled_peak(step)
        assert "forward" not in model.lm_head.__dict__  # undone on exit
        print(f"{fraction}: unplanned {unplanned} budget {budget} predicted {plan.predicted_peak} {measured}")
        assert measured <= budget
        assert abs(measured - plan.predicted_peak) <= 0.05 * measured
        assert plan.numerics.verdict == "pass", plan.numerics
        assert "chunked-head-loss on GPT.lm_head: passed" in plan.numerics.note
        assert 0 < plan.numerics.max_differences["budget_used"] <= 1

        # the code the plan prints, run as printed with the user's model bound to ``model``
        code = plan.code()
        assert code.startswith("handle = memtrim.fixes.chunked_head_loss(model.lm_head, chunk_size=")
        namespace = {"memtrim": memtrim, "model": model}
        exec(code, namespace)
        by_hand = _profiled_peak(step)
        namespace["handle"].remove()  # type: ignore[attr-defined]
        assert abs(by_hand - measured) <= 0.01 * measured


class _Decoder(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab)  # with a bias


class _TinyLM(nn.Module):
    """A plain-PyTorch LM of another shape: an MLP body, a nested head with a bias, and a loss of the
    fp32 upcast of bfloat16 logits (labels shifted by the data loader, as nanoGPT's are)."""

    def __init__(self, vocab: int = 6000, width: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.decoder = _Decoder(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.body(h)
        return self.decoder.proj(self.decoder.norm(h))


def test_a_nested_head_with_a_bias_and_an_upcast_is_found_applied_and_proven() -> None:
    torch.manual_seed(0)
    model = _TinyLM().to(torch.bfloat16)
    data = torch.randint(0, 6000, (3, 51), generator=torch.Generator().manual_seed(0))
    ids, labels = data[:, :-1], data[:, 1:]

    def step() -> None:
        logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, 6000), labels.reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    (option,) = [o for o in options_of(trace.analysis) if o.lever == "chunked-head-loss"]
    assert option.target == "_TinyLM.decoder.proj"
    assert option.params["module"] == "decoder.proj" and option.params["upcast"] is True
    assert option.cost == 2.0 * 3 * 50 * 40 * 6000  # the logits once more in backward
    plan = memtrim.fit(step, budget=trace.analysis.peak_with(option.edits))
    assert [lever.lever for lever in plan.levers] == ["chunked-head-loss"]
    with memtrim.applied(plan):
        measured = _profiled_peak(step)
    logits_bytes = 3 * 50 * 6000 * 4  # the fp32 copy of the logits, which the unplanned step made
    print(f"unplanned {trace.peak_bytes} predicted {plan.predicted_peak} profiled {measured}")
    assert trace.peak_bytes - measured >= logits_bytes
    assert abs(measured - plan.predicted_peak) <= 0.05 * measured
    assert plan.numerics.verdict == "pass", plan.numerics


def test_a_saved_plan_applies_again_and_a_head_that_is_not_an_nn_linear_is_left_alone(
    tmp_path: object,
) -> None:
    _, step = _gpt_step()
    plan = memtrim.fit(step, budget=int(_profiled_peak(step) * 0.7))
    path = f"{tmp_path}/plan.json"
    plan.save(path)
    loaded = memtrim.load_plan(path)
    assert loaded.levers[0].params == plan.levers[0].params
    with memtrim.applied(loaded):
        again = _profiled_peak(step)
    assert abs(again - plan.predicted_peak) <= 0.05 * again

    class OwnHead(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T  # not nn.Linear's forward: the lever does not know it

    other = gpt.GPT(CFG, seed=0)
    other.lm_head = OwnHead(CFG.width, CFG.vocab, bias=False)
    other.lm_head.weight = other.tok_emb.weight
    before = type(other.lm_head).forward
    x, _ = gpt.batch(CFG, 4)
    with memtrim.applied(loaded):
        logits = other(x).logits
    assert type(logits) is torch.Tensor and type(other.lm_head).forward is before
    assert "forward" not in other.lm_head.__dict__


def test_the_doctors_finding_names_the_patch_and_the_patch_as_printed_lands_on_the_plans_peak() -> None:
    import re

    model, step = _gpt_step()
    with memtrim.track() as trace:
        step()  # type: ignore[operator]
    (finding,) = [d for d in trace.diagnoses() if d.rule == "logits-cross-entropy"]
    found = re.search(
        r"(handle = memtrim\.fixes\.chunked_head_loss\(model\.lm_head, chunk_size=\d+\))", finding.note
    )
    assert found, finding.note
    (option,) = [o for o in options_of(trace.analysis) if o.lever == "chunked-head-loss"]
    namespace = {"memtrim": memtrim, "model": model}
    exec(found.group(1), namespace)
    measured = _profiled_peak(step)
    namespace["handle"].remove()  # type: ignore[attr-defined]
    predicted = trace.analysis.peak_with(option.edits)
    assert abs(measured - predicted) <= 0.05 * measured
    assert measured < 0.5 * trace.peak_bytes


class _Tagger(nn.Module):
    """An LSTM tagger: its batch_first output is not contiguous, so its nn.Linear head runs ``mm`` and
    then adds its bias (no ``addmm``): the bias is the head's own, not the user's arithmetic."""

    def __init__(self, vocab: int = 3000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.out = nn.Linear(64, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.embed(ids))[0])


def test_a_head_that_adds_its_own_bias_after_mm_is_chunked_and_the_printed_code_lands_on_it() -> None:
    torch.manual_seed(0)
    model = _Tagger()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 3000, (4, 48), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with memtrim.track() as trace:
        step()
    names = {row.op for row in trace.log.ops.rows}
    assert "aten.mm.default" in names and "aten.addmm.default" not in names  # (the head's form)
    plan = memtrim.fit(step, budget=int(trace.peak_bytes * 0.7))
    assert [(lever.lever, lever.target) for lever in plan.levers] == [("chunked-head-loss", "_Tagger.out")]
    with memtrim.applied(plan):
        measured = _profiled_peak(step)
    assert measured <= plan.budget
    assert abs(measured - plan.predicted_peak) <= 0.05 * measured
    assert plan.numerics.verdict == "pass", plan.numerics
    namespace = {"memtrim": memtrim, "model": model}
    exec(plan.code(), namespace)
    by_hand = _profiled_peak(step)
    namespace["handle"].remove()  # type: ignore[attr-defined]
    assert abs(by_hand - measured) <= 0.01 * measured


class _OwnHead(nn.Module):
    def __init__(self, width: int, vocab: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.bias = nn.Parameter(torch.zeros(vocab)) if bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # not an nn.Linear: chunked_head_loss cannot patch it
        return h @ self.weight.T + self.bias if self.bias is not None else h @ self.weight.T


@pytest.mark.parametrize("bias", [True, False])
def test_a_head_of_ones_own_gets_no_head_loss_option(bias: bool) -> None:
    # (before, without a bias, memtrim.fit planned it: predicted 3.17 MB, measured 6.96 MB unchanged)
    torch.manual_seed(0)
    embed, head = nn.Embedding(3000, 64), _OwnHead(64, 3000, bias)
    ids = torch.randint(0, 3000, (4, 48), generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(embed, head)
    with memtrim.track() as trace:
        F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    assert "chunked-head-loss" not in {o.lever for o in options_of(trace.analysis)}
    # the doctor still finds the logits and prescribes the function form
    found = [d for d in trace.diagnoses() if d.rule == "logits-cross-entropy"]
    assert found and "chunked_head_loss" not in str(found[0])
