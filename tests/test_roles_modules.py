"""Module paths are the outermost module's class name, then the name ``named_modules()`` gives."""

from __future__ import annotations

import torch

import memtrim


class _Stack(torch.nn.Module):
    """Iterates its containers instead of calling them, as transformer models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)
        )
        self.heads = torch.nn.ModuleDict({"left": torch.nn.Linear(8, 2), "right": torch.nn.Linear(8, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * 2
        return self.heads["left"](x) + self.heads["right"](x)


def test_iterated_containers_keep_their_indices_and_keys() -> None:
    model = _Stack()
    with memtrim.track() as trace:
        model(torch.randn(4, 8)).sum().backward()
    by_op: dict[str, set[str | None]] = {}
    for a in trace.allocations:
        if not a.preexisting:
            by_op.setdefault(a.op, set()).add(a.module)
    assert by_op["aten.tanh.default"] == {f"_Stack.layers.{i}.1" for i in range(3)}
    assert {"_Stack.heads.left", "_Stack.heads.right"} <= by_op["aten.addmm.default"]
    names = {name for name, _ in model.named_modules()}
    paths = {path for found in by_op.values() for path in found if path is not None}
    assert "_Stack" in paths  # the model's own forward (the multiply, the add)
    assert all(path.split(".", 1)[0] == "_Stack" and path.partition(".")[2] in names for path in paths)
    # backward ops carry the path of the forward op that made their node
    tanh_grads = {a.module for a in trace.allocations if a.node == "TanhBackward0"}
    assert tanh_grads == {f"_Stack.layers.{i}.1" for i in range(3)}


class _Borrows(torch.nn.Module):
    """Calls a module it does not own."""

    def __init__(self, other: torch.nn.Module) -> None:
        super().__init__()
        self.other = [other]  # a plain list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other[0](x)


def test_a_module_its_caller_does_not_own_keeps_its_class_name() -> None:
    act = torch.nn.Softplus()
    with memtrim.track() as trace:
        _Borrows(act)(torch.randn(4))
    assert [a.module for a in trace.allocations if a.op == "aten.softplus.default"] == ["_Borrows.Softplus"]
