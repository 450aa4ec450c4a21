"""What each allocation is *for* — weights, gradients, optimizer state, activations, temporaries — decided
from what the recorder saw it used as (:class:`~memtrim.trace.Fact`), then from its lifetime.

A registry of small rules tried in order, first match wins; an allocation no rule claims is ``other``.
Roles answer the first question a user asks ("how much is weights, gradients, optimizer state,
activations and temporaries?"); categories (:mod:`memtrim.analysis.categories`) keep the lifetime view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum

from memtrim.analysis.categories import Category
from memtrim.registry import Registry
from memtrim.trace.model import Allocation, Fact, Phase


class Role(str, Enum):
    """What an allocation is for."""

    PARAMETER = "parameter"
    """An ``nn.Parameter``, or a leaf tensor that requires grad."""
    SHARDED_PARAMETER = "sharded_parameter"
    """This rank's shard of a parameter sharded over ranks (FSDP2's DTensor parameters)."""
    UNSHARDED_PARAMETER = "unsharded_parameter"
    """A whole parameter gathered from every rank's shard for compute (FSDP2's all-gather outputs,
    freed again by resharding)."""
    ALL_GATHER_BUFFER = "all_gather_buffer"
    """The flat tensor an all-gather wrote (FSDP2 copies it out into the unsharded parameters)."""
    REDUCE_SCATTER_BUFFER = "reduce_scatter_buffer"
    """The flat tensor a reduce-scatter read (FSDP2's unsharded gradients), and gloo's copy of it."""
    GRADIENT_BUCKET = "gradient_bucket"
    """A flat tensor of gradients all-reduced in backward (DDP's buckets)."""
    GRADIENT = "gradient"
    """A leaf's ``.grad`` (what autograd accumulates into it)."""
    OPTIMIZER_STATE = "optimizer_state"
    """Held in an optimizer's ``state`` (Adam's ``exp_avg``, a momentum buffer, ``step``)."""
    ACTIVATION = "activation"
    """A forward result alive after the forward: saved by autograd for backward, or kept by the program
    (the logits of a model's output: "kept after forward" in the reports)."""
    BUFFER = "buffer"
    """An ``nn.Module`` buffer (running statistics, masks)."""
    TEMPORARY = "temporary"
    """Made and freed within one phase, and none of the above."""
    INPUT = "input"
    """Existed before the region (data, or anything else the region was handed)."""
    OUTPUT = "output"
    """Made in the region and still alive at its end."""
    OTHER = "other"
    """None of the above: outlived its phase, freed before the end."""

    def __str__(self) -> str:
        return self.value


RoleRule = Callable[[Allocation, Category], "Role | None"]

ROLE_RULES: Registry[str, RoleRule] = Registry(
    "role rule", "memtrim.analysis.roles.ROLE_RULES.register(name)"
)
"""Tried in registration order; the first rule that answers decides. Unanswered: ``other``."""


def _fact_rule(fact: Fact, role: Role) -> RoleRule:
    def rule(a: Allocation, _: Category) -> Role | None:
        return role if fact in a.facts else None

    rule.__qualname__ = f"fact_rule[{fact.value}]"
    return rule


# What the recorder saw beats lifetime: a gradient alive at the end is a gradient, not an output.
# What torch.distributed uses a block for comes first: FSDP2's unsharded parameters are also the
# module's parameters while they exist, and its sharded ones are parameters everywhere.
ROLE_RULES.register("unsharded_parameter")(_fact_rule(Fact.UNSHARDED_PARAMETER, Role.UNSHARDED_PARAMETER))
ROLE_RULES.register("sharded_parameter")(_fact_rule(Fact.SHARDED_PARAMETER, Role.SHARDED_PARAMETER))
ROLE_RULES.register("all_gather_buffer")(_fact_rule(Fact.ALL_GATHER_BUFFER, Role.ALL_GATHER_BUFFER))
ROLE_RULES.register("reduce_scatter_buffer")(
    _fact_rule(Fact.REDUCE_SCATTER_BUFFER, Role.REDUCE_SCATTER_BUFFER)
)
ROLE_RULES.register("gradient_bucket")(_fact_rule(Fact.GRADIENT_BUCKET, Role.GRADIENT_BUCKET))
ROLE_RULES.register("parameter")(_fact_rule(Fact.PARAMETER, Role.PARAMETER))
ROLE_RULES.register("gradient")(_fact_rule(Fact.GRADIENT, Role.GRADIENT))
ROLE_RULES.register("optimizer_state")(_fact_rule(Fact.OPTIMIZER_STATE, Role.OPTIMIZER_STATE))
ROLE_RULES.register("buffer")(_fact_rule(Fact.BUFFER, Role.BUFFER))


@ROLE_RULES.register("activation")
def _activation(a: Allocation, category: Category) -> Role | None:
    return Role.ACTIVATION if category is Category.SAVED else None


@ROLE_RULES.register("kept-after-forward")
def _kept_after_forward(a: Allocation, category: Category) -> Role | None:
    # a forward result the program held past the forward without autograd saving it (the logits in a
    # model's output): an activation all the same, which the reports say was kept after forward
    return Role.ACTIVATION if category is Category.KEPT and a.phase is Phase.FORWARD else None


@ROLE_RULES.register("gradient-by-lifetime")
def _gradient_by_lifetime(a: Allocation, category: Category) -> Role | None:
    # made in backward and alive after it: a gradient, also where no .grad was seen to hold it
    return Role.GRADIENT if category is Category.GRADIENT else None


@ROLE_RULES.register("input")
def _input(a: Allocation, category: Category) -> Role | None:
    return Role.INPUT if a.preexisting else None


@ROLE_RULES.register("temporary")
def _temporary(a: Allocation, category: Category) -> Role | None:
    return Role.TEMPORARY if category is Category.TEMPORARY else None


@ROLE_RULES.register("output")
def _output(a: Allocation, category: Category) -> Role | None:
    return Role.OUTPUT if a.free_tick is None else None


def role_of(a: Allocation, category: Category) -> Role:
    for rule in ROLE_RULES.values():
        found = rule(a, category)
        if found is not None:
            return found
    return Role.OTHER


# What the built-in rules read (facts, the category, the phase, whether it existed before the region
# and whether it is alive at the end): while only they are registered, allocations alike in these get
# one answer, computed once (as :func:`~memtrim.analysis.categories.categorize_all`).
_BUILT_IN = frozenset(ROLE_RULES.values())


def roles_of(allocations: Sequence[Allocation], categories: Sequence[Category]) -> tuple[Role, ...]:
    """:func:`role_of` of each allocation with its category, in order."""
    if not set(ROLE_RULES.values()) <= _BUILT_IN:
        return tuple(map(role_of, allocations, categories))
    known: dict[tuple[object, ...], Role] = {}
    found = []
    for a, category in zip(allocations, categories, strict=True):
        key = (a.facts, category, a.phase, a.preexisting, a.free_tick is None)
        role = known.get(key)
        if role is None:
            role = known[key] = role_of(a, category)
        found.append(role)
    return tuple(found)
