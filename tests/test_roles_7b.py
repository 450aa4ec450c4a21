"""A Llama-7B-shape training step measured with fake tensors (nothing is allocated): weights and
gradients 12.55 GiB each, and nothing called ``temporary`` larger than one layer's activations."""

from __future__ import annotations

import models  # noqa: F401  (quiets transformers' warnings before it is imported)
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

import memtrim
from memtrim.analysis.roles import Role
from memtrim.trace.model import Phase

SEQ = 2048


def llama_7b(layers: int = 32) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=SEQ,
    )  # fmt: skip


def new_model(config: transformers.LlamaConfig) -> torch.nn.Module:
    model: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def one_layers_activations() -> int:
    """Bytes of the distinct storages autograd's own pack hook receives while the first decoder layer
    runs, in an untracked fake forward of a one-layer model of the same width."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = new_model(llama_7b(layers=1))
        before = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        packed: dict[int, int] = {}
        inside = [False]
        layer = model.model.layers[0]  # type: ignore[index]
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if inside[0] and storage._cdata not in before:
                packed[storage._cdata] = storage.nbytes()
            return t

        ids = torch.randint(0, 32000, (1, SEQ))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        del loss
    return sum(packed.values())


def test_llama_7b_shape_weights_gradients_and_no_huge_temporaries() -> None:
    with memtrim.track(fake=True) as trace:
        model = new_model(llama_7b())
        ids = torch.randint(0, 32000, (1, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()

    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    assert weights == 13_476_831_232  # 6.74e9 bf16 weights: 12.55 GiB
    assert f"{weights / 2**30:.2f}" == "12.55"
    analysis = trace.analysis
    end = analysis.breakdown_at_phase_end[Phase.BACKWARD]
    assert end.made[Role.PARAMETER] == weights
    assert end.made[Role.GRADIENT] == weights == sum(p.grad.numel() * p.grad.element_size() for p in params)

    layer = one_layers_activations()
    assert 100 * 2**20 < layer < 1 * 2**30
    temporaries = [a for a in trace.allocations if analysis.role(a) is Role.TEMPORARY]
    assert temporaries and max(a.bytes for a in temporaries) <= layer
    by_line: dict[object, int] = {}
    for a in analysis.live_at_peak:
        if analysis.role(a) is Role.TEMPORARY:
            by_line[a.site] = by_line.get(a.site, 0) + a.bytes
    assert all(n <= layer for n in by_line.values())
