"""memtrim.fixes.checkpoint_modules: activation checkpointing by module name, bit-exact and undoable.

Exactness goes through ``memtrim.verify(mode="exact")`` (outputs and the input's gradient) plus
``torch.equal`` on every parameter's gradient, on a plain model with dropout and on small ``transformers``
GPT-2 and Llama models built from configs (random weights, nothing downloaded). Memory is held in bytes
against torch.profiler, predicted from the shapes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from groundtruth import profiler_memory
from torch import nn

from memtrim.fixes import checkpoint_modules, glob_to_regex
from memtrim.verify import verify

BATCH, WIDTH, LAYERS = 64, 32, 3
QUIET = {"memory": False, "progress": False}


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(self.act(self.up(x))))


class Stack(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def param_grads(model: nn.Module, run: Callable[[], Any], seed: int = 0) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = run()
    (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_bit_exact(
    plain: nn.Module, wrapped: nn.Module, call: Callable[[nn.Module, Any], Any], x: Any
) -> None:
    """verify(mode="exact") on outputs and the input's gradient, then torch.equal on parameter grads."""
    r = verify(
        lambda v: call(plain, v), lambda v: call(wrapped, v), (x,), mode="exact", dtypes=("fp32",), **QUIET
    )
    r.assert_ok()
    assert all(c.held == "exact" for c in r.cases) and len(r.cases) == 4 * 3  # layouts x seeds
    assert {q.name for c in r.cases for q in c.quantities} >= {"grad of input[0]"}
    a = param_grads(plain, lambda: call(plain, x.detach()))
    b = param_grads(wrapped, lambda: call(wrapped, x.detach()))
    assert a.keys() == b.keys() and len(a) >= len(list(plain.parameters())) - 1  # all but unused embeddings
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_plain_model_with_dropout_is_bit_exact() -> None:
    torch.manual_seed(0)
    plain = Stack(dropout=0.2).train()
    wrapped = copy.deepcopy(plain)
    handle = checkpoint_modules(wrapped, "blocks.*")
    assert handle.wrapped == ["blocks.0", "blocks.1", "blocks.2"]
    assert_bit_exact(plain, wrapped, lambda m, x: m(x), torch.randn(BATCH, WIDTH, requires_grad=True))


def test_transformers_gpt2_blocks_are_bit_exact() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg).train()  # dropout 0.1 on embeddings, attention, residuals
    wrapped = copy.deepcopy(plain)
    handle = checkpoint_modules(wrapped, "transformer.h.*")
    assert handle.wrapped == ["transformer.h.0", "transformer.h.1"]
    ids = torch.randint(0, 101, (2, 16))

    def call(m: nn.Module, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = m(inputs_embeds=emb, labels=ids, use_cache=False)
        return out.loss, out.logits

    assert_bit_exact(plain, wrapped, call, torch.randn(2, 16, 32, requires_grad=True))


def test_transformers_llama_layers_are_bit_exact() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=101,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(cfg).train()
    wrapped = copy.deepcopy(plain)
    assert checkpoint_modules(wrapped, "model.layers.*").wrapped == ["model.layers.0", "model.layers.1"]
    ids = torch.randint(0, 101, (2, 16))

    def call(m: nn.Module, emb: torch.Tensor) -> torch.Tensor:
        return m(inputs_embeds=emb, labels=ids, use_cache=False).loss

    assert_bit_exact(plain, wrapped, call, torch.randn(2, 16, 32, requires_grad=True))


def test_a_kv_cache_argument_is_refused_with_the_fix() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg).train()
    handle = checkpoint_modules(model, "transformer.h.*")
    # the model's own default is off while the handle lives, as gradient_checkpointing_enable does
    assert handle.use_cache_disabled == 1 and model.config.use_cache is False
    ids = torch.randint(0, 101, (2, 16))
    model(ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match=r"KV cache .*use_cache=False"):
        model(ids, labels=ids, use_cache=True)  # asked for: the recompute would append to it twice
    with torch.no_grad():
        model(ids, use_cache=True)  # nothing is checkpointed without grad, so a cache is fine there
    handle.undo()
    assert model.config.use_cache is True


# -- memory, in bytes, against torch.profiler ----------------------------------------------------------
def test_checkpointing_frees_each_blocks_activations_after_forward() -> None:
    """Alive after forward, per block: unwrapped, up's output and GELU's output (4 x WIDTH each, saved
    for backward) and the block's output; wrapped, only the output (and the RNG state checkpoint keeps
    to replay dropout). The profiler's net bytes equal these predictions exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(LAYERS)))
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    saved = LAYERS * 2 * BATCH * 4 * WIDTH * 4
    outputs = LAYERS * BATCH * WIDTH * 4
    rng_state = torch.get_rng_state().numel()
    peaks = {}
    for wrap in (False, True):
        handle = checkpoint_modules(model, "*") if wrap else None
        with profiler_memory() as fwd:
            y = model(x)
        assert sum(fwd.deltas) == (outputs + LAYERS * rng_state if wrap else outputs + saved)
        with profiler_memory() as step:
            model(x).sum().backward()
        peaks[wrap] = step.peak
        del y
        model.zero_grad(set_to_none=True)
        x.grad = None
        if handle is not None:
            handle.undo()
    assert peaks[True] < peaks[False]


# -- behaviour ----------------------------------------------------------------------------------------
def test_globs_match_one_name_per_star_and_any_with_two() -> None:
    assert glob_to_regex("transformer.h.*").fullmatch("transformer.h.3")
    assert not glob_to_regex("transformer.h.*").fullmatch("transformer.h.3.attn")
    assert glob_to_regex("**.attn").fullmatch("transformer.h.3.attn")
    assert glob_to_regex("**.attn").fullmatch("attn")
    assert glob_to_regex("blocks.[02]").fullmatch("blocks.2")
    assert not glob_to_regex("blocks.[!02]").fullmatch("blocks.2")
    assert not glob_to_regex("blocks.?").fullmatch("blocks.10")


def test_regex_patterns_and_nested_matches() -> None:
    model = Stack()
    handle = checkpoint_modules(model, [re.compile(r"blocks\.[01]"), "blocks.*.up"])
    assert handle.wrapped == ["blocks.0", "blocks.1", "blocks.2.up"]
    assert handle.inside_wrapped == ["blocks.0.up", "blocks.1.up"]
    handle.undo()


def test_undo_restores_the_forward_it_found_and_is_idempotent() -> None:
    model = Stack()
    hook_calls = []
    inner = model.blocks[1].forward

    def library_hook(x: torch.Tensor) -> torch.Tensor:  # another library's instance-level forward
        hook_calls.append(1)
        return inner(x)

    model.blocks[1].forward = library_hook  # type: ignore[method-assign]
    x = torch.randn(4, WIDTH, requires_grad=True)
    with checkpoint_modules(model, "blocks.*") as handle:
        assert len(handle) == 3
        model(x).sum().backward()
    assert len(hook_calls) == 2  # forward, and the recompute in backward
    assert "forward" not in model.blocks[0].__dict__
    assert model.blocks[1].__dict__["forward"] is library_hook
    handle.undo()
    model(x)
    assert len(hook_calls) == 3


def test_nothing_is_recomputed_without_grad() -> None:
    model = Stack()
    calls = []
    model.blocks[0].up.register_forward_hook(lambda *a: calls.append(1))
    handle = checkpoint_modules(model, "blocks.*")
    with torch.no_grad():
        model(torch.randn(4, WIDTH))
    assert len(calls) == 1
    model(torch.randn(4, WIDTH, requires_grad=True)).sum().backward()
    assert len(calls) == 3
    handle.undo()


def test_deepcopy_of_a_wrapped_model_runs_the_copy() -> None:
    model = Stack()
    checkpoint_modules(model, "blocks.*")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    x = torch.randn(4, WIDTH, requires_grad=True)
    assert not torch.equal(twin(x), model(x))
    plain = copy.deepcopy(twin)
    for m in plain.modules():
        m.__dict__.pop("forward", None)
    torch.testing.assert_close(twin(x), plain(x), rtol=0, atol=0)


def test_bad_patterns_and_double_wrapping_are_clear_errors() -> None:
    model = Stack()
    with pytest.raises(ValueError, match=r"no module name matches 'model\.blocks\.\*'.*'blocks\.\*'"):
        checkpoint_modules(model, "model.blocks.*")
    with pytest.raises(TypeError, match=r"str \(glob\) or re\.Pattern"):
        checkpoint_modules(model, [3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one"):
        checkpoint_modules(model, [])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        checkpoint_modules("model", "*")  # type: ignore[arg-type]
    first = checkpoint_modules(model, "blocks.0")
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_modules(model, "blocks.*")
    assert "forward" not in model.blocks[1].__dict__  # the failed call undid what it had wrapped
    model.blocks[0].forward = lambda x: x  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="replaced after checkpoint_modules"):
        first.undo()
