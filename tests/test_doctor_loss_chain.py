"""``logits-cross-entropy`` with elementwise ops between the lm_head and the loss (a softcap, a
temperature, a scale of the hidden states, a bias): the finding fires with the chain's numbers, the fix
it prints (evaluated as printed) keeps the loss and its gradients (``memtrim.verify``) and lands where
predicted (torch.profiler); a chain the chunked loss cannot reproduce gets no finding."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from doctor_support import assert_fix_measures, findings, measure
from torch import nn

import memtrim
import memtrim.fixes
from memtrim.trace import TraceFormatError
from memtrim.verify import verify

BATCH, SEQ, WIDTH, VOCAB = 4, 64, 64, 4096
TOKENS = BATCH * SEQ
Chain = Callable[[torch.Tensor], torch.Tensor]


class TinyLM(nn.Module):
    """An embedding and a bias-free head; ``chain`` runs on the logits, ``scale`` on the hidden states."""

    def __init__(self, chain: Chain = lambda z: z, scale: float | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.chain, self.scale = chain, scale

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.hidden(ids)
        if self.scale is not None:
            h = h * self.scale  # T5's tied-embedding scale: before the head
        return self.chain(self.head(h))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(
        0, VOCAB, (BATCH, SEQ), generator=gen
    )


CHAINS = {
    # name: (chain on the logits, scale of the hidden states, expected logit_scale, expected softcap)
    "softcap": (lambda z: torch.tanh(z / 30.0) * 30.0, None, 1.0, 30.0),  # Gemma 2's final-logit softcap
    "temperature": (lambda z: z / 0.7, None, float(1 / Fraction(0.7)), None),
    "softcap-temperature": (
        lambda z: (z / 0.7).tanh() * 2.5,
        None,
        float(Fraction(2.5) / Fraction(0.7)),
        2.5,
    ),
    "hidden-scale": (lambda z: z, WIDTH**-0.5, 0.125, None),  # T5: hidden * d_model ** -0.5
    "negated-softcap": (lambda z: -(torch.tanh(z * 0.5) * 4.0) + 1.0, None, -2.0, 4.0),
}


def _printed_call(fix: str) -> str:
    found = re.search(r"loss = (memtrim\.fixes\.chunked_linear_cross_entropy\(.*?\)), hidden ", fix)
    assert found, fix
    return found.group(1)


def _arguments(call: str) -> tuple[float, float | None]:
    scale = re.search(r"logit_scale=([-0-9.e]+)", call)
    cap = re.search(r"softcap=([-0-9.e]+)", call)
    return (float(scale.group(1)) if scale else 1.0), (float(cap.group(1)) if cap else None)


@pytest.mark.parametrize("name", list(CHAINS))
def test_the_chain_is_recognised_and_its_printed_fix_keeps_the_loss_and_lands_where_predicted(
    name: str,
) -> None:
    chain, scale, logit_scale, softcap = CHAINS[name]
    torch.manual_seed(0)
    model = TinyLM(chain, scale)
    ids, target = _batch()

    def original() -> None:
        F.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()

    before = measure(original)
    (finding,) = findings(before.trace, "logits-cross-entropy")
    call = _printed_call(finding.fix)
    assert "model.head.weight, target" in call
    assert _arguments(call) == (logit_scale, softcap), call
    assert finding.code is None  # plain code: the fix is the user's own line rewritten
    # the chain's intermediates are gone in the fused form: every [tokens, vocab] buffer of the step
    logits_sized = [
        a for a in before.trace.allocations if a.bytes == TOKENS * VOCAB * 4 and not a.preexisting
    ]
    assert {a.id for a in logits_sized} <= {a.id for a in finding.allocations}

    def fixed() -> None:
        scope = {"memtrim": memtrim, "model": model, "hidden": model.hidden(ids), "target": target}
        eval(call, scope).backward()  # the printed call, as printed

    model.zero_grad(set_to_none=True)
    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "logits-cross-entropy") == []

    # loss and gradients: the printed call against the program's own arithmetic (a float64 oracle), on
    # a smaller batch and vocabulary so that the oracle is quick
    labels = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))

    def reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            h = h * scale
        return F.cross_entropy(chain(h @ w.T).flatten(0, 1), labels.flatten())

    def candidate(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        holder = argparse.Namespace(head=argparse.Namespace(weight=w))
        return eval(call, {"memtrim": memtrim, "model": holder, "hidden": h, "target": labels})

    h = torch.randn(2, 8, WIDTH, requires_grad=True)
    w = torch.randn(512, WIDTH, requires_grad=True)
    verify(reference, candidate, (h, w), mode="reference", dtypes=[torch.float32], progress=False).assert_ok()


def test_a_bias_added_after_the_head_is_the_fixs_bias() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    bias = torch.randn(VOCAB, requires_grad=True)
    ids, target = _batch()

    def original() -> None:
        logits = model.head(model.hidden(ids)) + bias  # planted: bias
        F.cross_entropy(logits.flatten(0, 1), target.flatten()).backward()

    (finding,) = findings(measure(original).trace, "logits-cross-entropy")
    assert "bias=bias" in finding.fix
    assert f"bias the [{VOCAB}] bias added at test_doctor_loss_chain.py:" in finding.fix
    assert "logit_scale" not in finding.fix and "softcap" not in finding.fix
    assert "with a bias (+ bias)" in finding.problem


def _noise(z: torch.Tensor) -> torch.Tensor:
    return z + torch.randn_like(z)


UNREPRODUCIBLE: dict[str, Chain] = {
    "noise of the logits' shape": _noise,
    "sin": torch.sin,
    "a shift inside the tanh": lambda z: torch.tanh(z / 30.0 + 1.0) * 30.0,
    "a 0-dim tensor scale": lambda z: z * torch.tensor(2.0),
    "two tanhs": lambda z: torch.tanh(torch.tanh(z)),
    "a scale by zero": lambda z: z * 0.0,
    "an in-place temperature": lambda z: z.div_(0.7),  # no new buffer: the matmul's output itself changes
}


@pytest.mark.parametrize("name", list(UNREPRODUCIBLE))
def test_a_chain_the_chunked_loss_cannot_reproduce_gets_no_finding(name: str) -> None:
    torch.manual_seed(0)
    model = TinyLM(UNREPRODUCIBLE[name])
    ids, target = _batch()
    trace = measure(lambda: F.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()).trace
    assert findings(trace, "logits-cross-entropy") == []


def test_the_scalars_survive_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyLM(CHAINS["softcap"][0])
    ids, target = _batch()
    with memtrim.track() as trace:
        F.cross_entropy(model(ids).flatten(0, 1), target.flatten()).backward()
    assert sorted(trace.log.scalars.values()) == [(("other", 30.0),)] * 4  # forward / and *, their backward
    trace.save(str(tmp_path / "t.json"))
    loaded = memtrim.load(str(tmp_path / "t.json"))
    assert loaded.log.scalars == trace.log.scalars
    assert [d.fix for d in findings(loaded, "logits-cross-entropy")] == [
        d.fix for d in findings(trace, "logits-cross-entropy")
    ]
    text = (
        (tmp_path / "t.json")
        .read_text()
        .replace('"scalars": [', '"scalars": [[999999, [["other", 1.0]]],', 1)
    )
    with pytest.raises(TraceFormatError, match=r"scalars\[0\] op number"):
        memtrim.trace.loads(text)


# -- plain code that shifts the logits before the loss (logits[:, :-1] against labels[:, 1:]) --------
Cut = Callable[[torch.Tensor], torch.Tensor]
SLICES: dict[str, tuple[Cut, Cut, str]] = {
    # name: (the logits the program's loss reads, its labels of the ids, the index the fix prints)
    "shift": (lambda z: z[:, :-1, :].contiguous(), lambda y: y[:, 1:], "[:, :-1]"),
    "shift, reshaped": (lambda z: z[..., :-1, :].reshape(-1, z.shape[-1]), lambda y: y[:, 1:], "[:, :-1]"),
    "from the second": (lambda z: z[:, 1:].float(), lambda y: y[:, :-1], "[:, 1:]"),
    "narrow": (lambda z: z.narrow(1, 0, SEQ - 2).contiguous(), lambda y: y[:, 2:], f"[:, :{SEQ - 2}]"),
    "every other": (lambda z: z[:, ::2].contiguous(), lambda y: y[:, ::2], "[:, ::2]"),
    "softcapped, then shifted": (
        lambda z: (torch.tanh(z / 30.0) * 30.0)[:, :-1].contiguous(),
        lambda y: y[:, 1:],
        "[:, :-1]",
    ),
}


@pytest.mark.parametrize("name", list(SLICES))
def test_a_copy_of_a_slice_of_the_logits_slices_the_hidden_states_in_the_fix(name: str) -> None:
    """A label shift written in the training code: the loss reads a copy of ``logits[:, :-1]``. The fix
    takes the same rows of the hidden states (the index printed from the slice's recorded numbers);
    evaluated as printed it keeps the loss and gradients and lands where predicted, counting the full
    logits and the full-size gradient backward's slice makes for them."""
    sliced, shifted, index = SLICES[name]
    torch.manual_seed(0)
    model = TinyLM()
    ids, _ = _batch()
    target = shifted(ids)

    def original() -> None:
        logits = sliced(model(ids))
        F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)).backward()

    before = measure(original)
    (finding,) = findings(before.trace, "logits-cross-entropy")
    call = _printed_call(finding.fix)
    expected = f"memtrim.fixes.chunked_linear_cross_entropy(hidden{index}, model.head.weight"
    assert call.startswith(expected), call
    assert f"target the {list(target.shape)} labels the loss reads".replace("'", "") in finding.fix
    assert f"hidden the [{BATCH}, {SEQ}, {WIDTH}] input of" in finding.fix
    # every logits-sized buffer, the full ones before the slice and the sliced ones, is gone in the fix
    sizes = {TOKENS * VOCAB * 4, target.numel() * VOCAB * 4}
    made = [a for a in before.trace.allocations if a.bytes in sizes and not a.preexisting]
    assert {a.id for a in made} <= {a.id for a in finding.allocations}

    def fixed() -> None:
        scope = {"memtrim": memtrim, "model": model, "hidden": model.hidden(ids), "target": target}
        eval(call, scope).backward()

    model.zero_grad(set_to_none=True)
    after = measure(fixed)
    assert_fix_measures(finding, before, after)
    assert findings(after.trace, "logits-cross-entropy") == []

    gen = torch.Generator().manual_seed(1)
    small = torch.randint(0, 512, (2, 8), generator=gen)
    labels = shifted(small)
    chain = SLICES[name][0]

    def reference(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(chain(h @ w.T).reshape(-1, 512), labels.reshape(-1))

    def candidate(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        holder = argparse.Namespace(head=argparse.Namespace(weight=w))
        return eval(call, {"memtrim": memtrim, "model": holder, "hidden": h, "target": labels})

    if name != "narrow":  # narrow(1, 0, SEQ - 2) is of the big batch's length; its index is too
        h = torch.randn(2, 8, WIDTH, requires_grad=True)
        w = torch.randn(512, WIDTH, requires_grad=True)
        fp32 = [torch.float32]
        verify(reference, candidate, (h, w), mode="reference", dtypes=fp32, progress=False).assert_ok()


UNSLICEABLE: dict[str, Cut] = {
    "the vocabulary cut": lambda z: z[..., :-1].contiguous(),
    "two slices joined": lambda z: torch.cat([z[:, :8], z[:, 16:]], dim=1),
    "a row picked": lambda z: z[:, -1].contiguous(),
}


@pytest.mark.parametrize("name", list(UNSLICEABLE))
def test_a_cut_of_the_logits_the_hidden_states_cannot_take_gets_no_finding(name: str) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ids, _ = _batch()

    def original() -> None:
        logits = UNSLICEABLE[name](model(ids))
        rows = logits.reshape(-1, logits.shape[-1])
        F.cross_entropy(rows, ids.flatten()[: rows.shape[0]] % rows.shape[-1]).backward()

    assert findings(measure(original).trace, "logits-cross-entropy") == []


# -- a transformers model: Gemma 2's softcapped head, on a 3-step loop ---------------------------------
def test_gemma2_three_steps_the_reported_entry_names_the_softcapped_logits() -> None:
    """As ``memtrim run --region step`` records and picks: the entry with the highest absolute peak; its
    findings include the loss, as chunked_loss(model) (which applies config.final_logit_softcapping)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers = pytest.importorskip("transformers")
    from memtrim.capture.regions import capture_region
    from memtrim.cli import _choose_entry

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=SEQ, final_logit_softcapping=30.0,
        sliding_window=SEQ,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM(config)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with capture_region("step") as captured:
        for _ in range(3):
            with memtrim.region("step"):
                optimizer.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
    traces = [memtrim.Trace(log) for log in captured.traces]
    reported = _choose_entry(traces, argparse.Namespace(entry=None, region="step"))
    assert reported is not traces[0]  # the first step makes AdamW's state; a later one is higher
    (loss,) = findings(reported, "logits-cross-entropy")
    assert loss.code is not None and "memtrim.fixes.chunked_loss(model" in loss.code
    assert "softcapped (/ 30.0, tanh, * 30.0)" in loss.problem
    assert "the softcap 30.0 from config.final_logit_softcapping" in loss.fix


def test_a_transformers_logit_scale_chunked_loss_would_drop_gets_the_function_form() -> None:
    """Cohere multiplies its logits by ``config.logit_scale`` before the model's own loss: chunked_loss(model)
    applies no such scale, so the finding prints causal_lm_cross_entropy with it (and no patch to apply);
    evaluated as printed on the decoder's hidden states it is the model's loss, gradients included."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CohereConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ, logit_scale=0.0625,
    )  # fmt: skip
    model = transformers.CohereForCausalLM(config)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    trace = measure(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward()).trace
    (finding,) = findings(trace, "logits-cross-entropy")
    assert finding.code is None and "chunked_loss(model) would drop" in (finding.note or "")
    found = re.search(r"loss = (memtrim\.fixes\.causal_lm_cross_entropy\(.*?\)), hidden ", finding.fix)
    assert found, finding.fix
    call = found.group(1)
    assert "model.lm_head.weight, labels, logit_scale=0.0625" in call, call

    model.zero_grad(set_to_none=True)
    reference = model(input_ids=ids, labels=ids, use_cache=False).loss
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    loss = eval(call, {"memtrim": memtrim, "model": model, "hidden": hidden, "labels": ids})
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6)
