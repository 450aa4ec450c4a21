"""The doctor on real third-party models: ``transformers`` tiny configs built from scratch (random
weights, nothing downloaded), one training step each. The loss/logits findings name the lines in
transformers' loss code and the lm_head, and applying each fix measures the predicted drop against
torch.profiler."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # tiny configs make it warn about token ids

import pytest
import torch
import torch.nn.functional as F
import transformers
from doctor_support import (
    ChunkedLinearCrossEntropy,
    Measured,
    assert_fix_measures,
    chunk_from,
    findings,
    measure,
)
from torch.utils.checkpoint import checkpoint
from transformers.loss import loss_utils
from transformers.models.bert import modeling_bert
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama

from memtrim.trace.model import Site

BATCH, TOKENS = 2, 64


def source_line(function: Callable[..., object], needle: str) -> Site:
    """The line of ``function``'s source that contains ``needle`` (once)."""
    function = inspect.unwrap(function)  # transformers wraps forward in decorators
    lines, first = inspect.getsourcelines(function)
    hits = [first + i for i, text in enumerate(lines) if needle in text]
    assert len(hits) == 1, (function, needle, hits)
    return Site(inspect.getsourcefile(function) or "", hits[0], function.__name__)


def doctor_gpt2(vocab: int = 16384, width: int = 64, layers: int = 2) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=TOKENS, n_embd=width, n_layer=layers, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def doctor_llama(vocab: int = 16384, width: int = 64) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=TOKENS,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def doctor_bert(vocab: int = 16384, width: int = 64) -> transformers.BertForMaskedLM:
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * width, max_position_embeddings=TOKENS,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def doctor_vit() -> transformers.ViTForImageClassification:
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=128, num_labels=10,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


class Step:
    """One AdamW training step of ``model`` on a fixed batch, re-runnable from the same weights."""

    def __init__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
        self.model, self.batch = model, batch
        self.weights = {k: v.clone() for k, v in model.state_dict().items()}
        self.held: list[object] = []  # what the step's caller keeps, as a training loop's variable would

    def run(
        self, program: Callable[[torch.nn.Module, dict[str, torch.Tensor]], object], **adamw: bool
    ) -> Measured:
        self.model.load_state_dict(self.weights)
        self.model.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, **adamw)

        def step() -> None:
            self.held.append(program(self.model, self.batch))
            opt.step()
            opt.zero_grad()

        try:
            return measure(step)
        finally:
            self.held.clear()


def whole_output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
    out = model(**batch)
    out.loss.backward()
    return out  # the caller holds the ModelOutput, logits and all


def loss_only(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
    loss = model(**batch).loss  # the kept-output prescription
    loss.backward()
    return loss


def _tokens(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _causal_target(labels: torch.Tensor) -> torch.Tensor:
    """What transformers' ForCausalLMLoss compares the logits with: labels shifted left, -100 padded."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)


@pytest.fixture(scope="module")
def gpt2() -> Step:
    torch.manual_seed(0)
    return Step(doctor_gpt2(), _tokens(16384))


@pytest.fixture(scope="module")
def gpt2_before(gpt2: Step) -> Measured:
    return gpt2.run(whole_output)


def test_gpt2_logits_findings_name_the_loss_and_the_lm_head(gpt2_before: Measured) -> None:
    trace = gpt2_before.trace
    loss_line = source_line(loss_utils.fixed_cross_entropy, "nn.functional.cross_entropy(")
    head_line = source_line(modeling_gpt2.GPT2LMHeadModel.forward, "self.lm_head(")
    (ce,) = findings(trace, "logits-cross-entropy")
    assert ce.site == loss_line and head_line in ce.sites
    # the model's own loss (ForCausalLMLoss): the fix is the model patched, not a hand-written loss
    assert ce.fix.startswith("memtrim.fixes.chunked_loss(model, chunk_size=")
    assert ce.code is not None and "memtrim.fixes.chunked_loss(model" in ce.code
    assert "GPT2LMHeadModel" in dict(ce.binds)["model"]
    (kept,) = findings(trace, "kept-output")
    assert kept.site == head_line and kept.module == "GPT2LMHeadModel.lm_head"
    assert [a.shape for a in kept.allocations] == [(BATCH * TOKENS, 16384)]
    # the report's "How to cut it" names both, largest saving first
    report = trace.report()
    cut = report[report.index("How to cut it") :]
    assert cut.index("loss_utils.py") < cut.index("modeling_gpt2.py")


def test_gpt2_keeping_only_the_loss_measures_the_kept_output_prediction(
    gpt2: Step, gpt2_before: Measured
) -> None:
    (kept,) = findings(gpt2_before.trace, "kept-output")
    after = gpt2.run(loss_only)
    assert_fix_measures(kept, gpt2_before, after)
    assert findings(after.trace, "kept-output") == []


def test_gpt2_chunked_loss_measures_the_logits_prediction(gpt2: Step, gpt2_before: Measured) -> None:
    (ce,) = findings(gpt2_before.trace, "logits-cross-entropy")
    chunk = chunk_from(ce)

    def chunked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
        hidden = model.transformer(input_ids=batch["input_ids"]).last_hidden_state
        target = _causal_target(batch["labels"])
        loss = ChunkedLinearCrossEntropy.apply(
            hidden.reshape(-1, 64), model.lm_head.weight, None, target, chunk
        )
        loss.backward()
        return loss

    after = gpt2.run(chunked)
    assert_fix_measures(ce, gpt2_before, after)
    assert findings(after.trace, "logits-cross-entropy") == []


def test_gpt2_chunked_loss_code_as_printed_measures_the_logits_prediction(
    gpt2: Step, gpt2_before: Measured
) -> None:
    (ce,) = findings(gpt2_before.trace, "logits-cross-entropy")
    assert ce.code is not None
    scope: dict[str, object] = {"model": gpt2.model}
    exec(ce.code, scope)  # the finding's code, as printed, on the program's own model
    try:
        after = gpt2.run(whole_output)  # the user's step, unchanged (.logits is None now)
    finally:
        scope["handle"].remove()  # type: ignore[attr-defined]
    assert_fix_measures(ce, gpt2_before, after)
    assert findings(after.trace, "logits-cross-entropy") == []


def test_gpt2_cache_and_optimizer_findings_and_their_fixes() -> None:
    # a narrow vocabulary: the step's AdamW temporaries set the peak, while the KV cache still holds
    # the keys and values it copied
    torch.manual_seed(0)
    step = Step(doctor_gpt2(vocab=256, width=128), _tokens(256))
    before = step.run(whole_output)
    (cache,) = findings(before.trace, "cache-in-training")
    assert cache.site is not None and cache.site.file.endswith("transformers/cache_utils.py")
    assert cache.site.function == "update" and "use_cache=False" in cache.fix
    assert len(cache.allocations) == 2 * 2  # keys and values of both layers

    def no_cache(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return out

    after = step.run(no_cache)
    assert_fix_measures(cache, before, after)
    assert findings(after.trace, "cache-in-training") == []

    (optimizer,) = findings(before.trace, "optimizer-step")
    assert "fused=True" in optimizer.fix
    assert_fix_measures(optimizer, before, step.run(whole_output, fused=True))


def test_llama_bf16_upcast_and_logits_findings_and_their_fixes() -> None:
    torch.manual_seed(0)
    step = Step(doctor_llama().to(torch.bfloat16), _tokens(16384))
    before = step.run(whole_output)
    trace = before.trace
    upcast_line = source_line(loss_utils.ForCausalLMLoss, "logits = logits.float()")
    (upcast,) = findings(trace, "upcast-copy")
    assert upcast.site == upcast_line and "bfloat16 -> float32" in upcast.problem
    (ce,) = findings(trace, "logits-cross-entropy")
    assert ce.site == source_line(loss_utils.fixed_cross_entropy, "nn.functional.cross_entropy(")
    assert source_line(modeling_llama.LlamaForCausalLM.forward, "self.lm_head(") in ce.sites
    assert "and its upcast" in ce.problem

    def narrow_loss(logits, labels, vocab_size, **kwargs):  # type: ignore[no-untyped-def]
        # ForCausalLMLoss with the upcast line dropped: the prescription "stay in bfloat16"
        return loss_utils.fixed_cross_entropy(logits.view(-1, vocab_size), _causal_target(labels))

    def in_bf16(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
        model.loss_function = narrow_loss
        try:
            return whole_output(model, batch)
        finally:
            del model._loss_function

    assert_fix_measures(upcast, before, step.run(in_bf16))

    def chunked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state.reshape(-1, 64)
        loss = ChunkedLinearCrossEntropy.apply(
            hidden, model.lm_head.weight, None, _causal_target(batch["labels"]), chunk_from(ce)
        )
        loss.backward()
        return loss

    assert_fix_measures(ce, before, step.run(chunked))


def test_bert_masked_lm_logits_finding_names_the_decoder_and_its_bias() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 16384, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))
    step = Step(doctor_bert(), {"input_ids": ids, "labels": ids})
    before = step.run(whole_output)
    (ce,) = findings(before.trace, "logits-cross-entropy")
    assert ce.site == source_line(modeling_bert.BertForMaskedLM.forward, "masked_lm_loss = loss_fct(")
    assert source_line(modeling_bert.BertLMPredictionHead.forward, "self.decoder(") in ce.sites
    assert "model.cls.predictions.decoder.weight" in ce.fix and "bias=" in ce.fix

    def chunked(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> object:
        sequence = model.bert(input_ids=batch["input_ids"]).last_hidden_state
        hidden = model.cls.predictions.transform(sequence).reshape(-1, 64)
        decoder = model.cls.predictions.decoder
        loss = ChunkedLinearCrossEntropy.apply(
            hidden, decoder.weight, decoder.bias, batch["labels"].reshape(-1), chunk_from(ce)
        )
        loss.backward()
        return loss

    assert_fix_measures(ce, before, step.run(chunked))


def test_vit_classifier_has_no_logits_findings() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batch = {
        "pixel_values": torch.randn(8, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 10, (8,), generator=gen),
    }
    trace = Step(doctor_vit(), batch).run(whole_output).trace
    assert findings(trace, "logits-cross-entropy") == [] and findings(trace, "upcast-copy") == []


def test_gpt2_blocks_are_checkpoint_candidates_where_module_paths_name_them() -> None:
    torch.manual_seed(0)
    model = doctor_gpt2(vocab=256, width=128, layers=4)
    ids = torch.randint(0, 256, (8, TOKENS), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    before = measure(step)
    if not any(".h.0" in (row.module or "") for row in before.trace.ops.rows):
        # paths like GPT2LMHeadModel.transformer.GPT2Block cannot tell the blocks apart: no advice
        assert findings(before.trace, "checkpoint-candidates") == []
        pytest.skip("the recorder's module paths name no container indices yet (transformer.h.0)")
    (candidates,) = findings(before.trace, "checkpoint-candidates")
    assert 'checkpoint_modules(model, ["transformer.h.*"])' in candidates.fix
    model.zero_grad(set_to_none=True)
    blocks = model.transformer.h
    for block in blocks:
        inner = block.forward
        block.forward = lambda *a, inner=inner, **k: checkpoint(inner, *a, use_reentrant=False, **k)
    try:
        after = measure(step, rng_states=len(blocks))
    finally:
        for block in blocks:
            del block.forward
    assert_fix_measures(candidates, before, after)


def test_the_chunk_size_is_the_prescriptions_own() -> None:
    fixes = pytest.importorskip("memtrim.fixes")
    from memtrim.doctor.rules.loss import chunk_size

    for tokens, vocab, hidden, dtype in [
        (1024, 50257, 768, torch.float32),
        (8192, 128256, 4096, torch.bfloat16),
    ]:
        assert chunk_size(tokens, vocab, hidden, str(dtype).removeprefix("torch.")) == fixes.auto_chunk_size(
            tokens, vocab, hidden, dtype
        )
