"""Roles on real third-party models (``transformers`` tiny configs, one AdamW training step each),
asserted in bytes against the models' own tensors, autograd's own pack hook and torch.profiler."""

from __future__ import annotations

import pytest
import torch
from groundtruth import profiler_memory
from models import CORPUS, TinyModel, new_optimizer, train_step

import memtrim
from memtrim.analysis.roles import Role
from memtrim.trace.model import Phase

IDS = [m.name for m in CORPUS]


def tensor_bytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


def packed_activation_bytes(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, batch_is_input: bool
) -> int:
    """Bytes of the distinct storages autograd's own pack hook receives in an untracked forward and
    loss, leaving out the parameters and buffers, and the batch where it existed before the tracked
    region (memtrim calls those ``input``). The graph is kept until the end, so no saved storage
    dies and hands its address to another. The loss the program holds through backward is a forward
    result kept after the forward: an activation too (it is no saved tensor, so it is added here)."""
    given = (*model.parameters(), *model.buffers(), *(batch.values() if batch_is_input else ()))
    before = {t.untyped_storage()._cdata for t in given}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in before:
            packed[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    packed[loss.untyped_storage()._cdata] = loss.untyped_storage().nbytes()
    total = sum(packed.values())
    del loss
    return total


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """exp_avg + exp_avg_sq + step of every parameter, read from the optimizer itself."""
    state = optimizer.state.values()
    assert all(set(s) == {"exp_avg", "exp_avg_sq", "step"} for s in state)
    return tensor_bytes(t for s in state for t in (s["exp_avg"], s["exp_avg_sq"], s["step"]))


@pytest.mark.parametrize("tiny", CORPUS, ids=IDS)
def test_roles_of_a_training_step_on_a_model_built_before_the_region(tiny: TinyModel) -> None:
    torch.manual_seed(0)
    model, batch = tiny.build(), tiny.batch()
    optimizer = new_optimizer(model)
    activations = packed_activation_bytes(model, batch, batch_is_input=True)
    model.zero_grad(set_to_none=True)

    with profiler_memory() as truth, memtrim.track() as trace:
        train_step(model, optimizer, batch)

    params = list(model.parameters())
    assert all(p.grad is not None for p in params)
    analysis = trace.analysis
    ends = analysis.breakdown_at_phase_end
    buffers = dict(model.named_buffers())
    for phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER):
        # the weights existed before the region: counted, and marked as such
        assert ends[phase].preexisting[Role.PARAMETER] == tensor_bytes(params)
        assert Role.PARAMETER not in ends[phase].made
        assert ends[phase].total(Role.BUFFER) == tensor_bytes(buffers[n] for n in tiny.buffers_used)
    assert ends[Phase.BACKWARD].made[Role.GRADIENT] == tensor_bytes(p.grad for p in params)
    assert ends[Phase.OPTIMIZER].made[Role.GRADIENT] == tensor_bytes(p.grad for p in params)
    assert ends[Phase.OPTIMIZER].made[Role.OPTIMIZER_STATE] == state_bytes(optimizer)
    assert Role.OPTIMIZER_STATE not in ends[Phase.BACKWARD].made

    made = [a for a in trace.allocations if not a.preexisting]
    assert sum(a.bytes for a in made if analysis.role(a) is Role.ACTIVATION) == activations > 0

    at_peak = analysis.breakdown_at_peak
    assert sum(at_peak.made.values()) - at_peak.preexisting_freed == trace.peak_bytes == truth.peak


@pytest.mark.parametrize("tiny", CORPUS, ids=IDS)
def test_roles_of_a_training_step_on_a_model_built_inside_the_region(tiny: TinyModel) -> None:
    torch.manual_seed(0)
    with profiler_memory() as truth, memtrim.track() as trace:
        model, batch = tiny.build(), tiny.batch()
        optimizer = new_optimizer(model)
        train_step(model, optimizer, batch)

    params = list(model.parameters())
    analysis = trace.analysis
    ends = analysis.breakdown_at_phase_end
    for phase in (Phase.BACKWARD, Phase.OPTIMIZER):
        assert ends[phase].made[Role.PARAMETER] == tensor_bytes(params)
        assert ends[phase].made[Role.GRADIENT] == tensor_bytes(p.grad for p in params)
        assert Role.PARAMETER not in ends[phase].preexisting
    assert ends[Phase.OPTIMIZER].made[Role.OPTIMIZER_STATE] == state_bytes(optimizer)
    buffers = dict(model.named_buffers())
    assert ends[Phase.OPTIMIZER].made.get(Role.BUFFER, 0) == tensor_bytes(buffers.values())
    assert sum(a.bytes for a in trace.allocations if analysis.role(a) is Role.ACTIVATION) == (
        packed_activation_bytes(model, batch, batch_is_input=False)
    )
    at_peak = analysis.breakdown_at_peak
    assert sum(at_peak.made.values()) - at_peak.preexisting_freed == trace.peak_bytes == truth.peak


@pytest.mark.parametrize("tiny", CORPUS, ids=IDS)
def test_module_paths_are_the_names_named_modules_gives(tiny: TinyModel) -> None:
    torch.manual_seed(0)
    model, batch = tiny.build(), tiny.batch()
    with memtrim.track() as trace:
        train_step(model, new_optimizer(model), batch)
    root = type(model).__name__
    names = {name for name, _ in model.named_modules()}
    paths = {a.module for a in trace.allocations if a.module is not None}
    assert f"{root}.{tiny.layer_path}" in paths
    for path in paths:
        head, _, rest = path.partition(".")
        assert head == root
        # a loss module made inside a forward is owned by no one: it keeps its class name
        assert rest in names or rest in {"CrossEntropyLoss"}, path
