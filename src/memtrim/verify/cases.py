"""The case matrix: inputs per (dtype, layout, seed, variant), and the memory layouts that expose bugs.

Layouts, each keeping shapes and (except ``expanded``) values:

* ``contiguous`` — as built.
* ``noncontiguous`` — PyTorch OpInfo's ``noncontiguous_like``: every element sits in the second slot of a
  trailing pair in a larger buffer whose first slots hold NaN (12 for integers, True for bools), so a
  kernel that ignores strides or the storage offset reads NaN and shows it.
* ``transposed`` — column-major (all dims reversed in memory): same values, permuted strides.
* ``expanded`` — a stride-0 broadcast along the first dim longer than 1, so the values repeat along it.
  Only legal where the callables do not write to their inputs; where the reference rejects it, the
  case is skipped and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from memtrim.registry import Registry
from memtrim.trace import dtype_name

DEFAULT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DEFAULT_SEEDS = (0, 1, 2)

InputBuilder = Callable[[torch.dtype, torch.device, int], Any]
InputsSpec = InputBuilder | Sequence[Any] | torch.Tensor


@dataclass(frozen=True)
class Case:
    """One cell of the matrix. ``dtype`` None: the inputs as given (no floating-point tensor to cast)."""

    dtype: torch.dtype | None
    layout: str
    seed: int
    variant: str = "default"
    autocast: bool = False

    @property
    def id(self) -> str:
        dt = dtype_name(self.dtype) if self.dtype is not None else "as-given"
        if self.autocast:
            dt = f"autocast({dt})"
        parts = [dt, self.layout, f"seed={self.seed}"]
        if self.variant != "default":
            parts.insert(0, self.variant)
        return "/".join(parts)


@dataclass
class CancellationProbe:
    """Inputs (used as given) whose exact result or gradient is zero: the candidate must give exact 0."""

    inputs: Sequence[Any]
    grad_outputs: Sequence[torch.Tensor] | None = None
    name: str = "probe"


@dataclass
class CaseInputs:
    """A case's canonical values: contiguous, rounded to the case dtype; laid out afresh for each run."""

    case: Case
    leaves: list[Any]
    spec: Any
    requires_grad: list[bool]

    @property
    def diff_index(self) -> list[int]:
        return [i for i, rg in enumerate(self.requires_grad) if rg]

    def materialize(
        self,
        *,
        layout: str | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> tuple[list[Any], list[tuple[int, torch.Tensor]]]:
        """Fresh leaves (new storage, so one run cannot change another's inputs) in the case's layout.

        ``dtype`` (the oracle's float64) also casts floating-point tensors. Also returns, per
        noncontiguous leaf, its poisoned buffer, whose hidden slots the caller checks after the run.
        """
        layout = layout or self.case.layout
        guards: list[tuple[int, torch.Tensor]] = []
        out: list[Any] = []
        for i, (leaf, rg) in enumerate(zip(self.leaves, self.requires_grad, strict=True)):
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            t = leaf.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            if device is not None:
                t = t.to(device)
            t, base = apply_layout(t, layout)
            if base is not None:
                guards.append((i, base))
            out.append(t.requires_grad_(rg) if rg else t)
        return out, guards

    @property
    def names(self) -> list[str]:
        return leaf_names(self.spec, "input")

    def args(self, leaves: list[Any]) -> tuple[Any, ...]:
        args = tree_unflatten(leaves, self.spec)
        return tuple(args)


def leaf_names(spec: Any, prefix: str) -> list[str]:
    """``output``, ``output[0]``, ``output['a']``: a readable name per leaf of a pytree spec."""
    skeleton = tree_unflatten(list(range(spec.num_leaves)), spec)
    return [f"{prefix}{keystr(path)}" for path, _ in tree_flatten_with_path(skeleton)[0]]


DTYPE_ALIASES: Registry[str, torch.dtype] = Registry(
    "dtype name", "memtrim.verify.cases.DTYPE_ALIASES.add(name, dtype)"
)
"""The names ``dtypes=`` accepts besides ``torch.dtype`` objects."""
for _names, _dtype in (
    (("fp64", "float64", "double"), torch.float64),
    (("fp32", "float32", "float"), torch.float32),
    (("fp16", "float16", "half"), torch.float16),
    (("bf16", "bfloat16"), torch.bfloat16),
):
    for _name in _names:
        DTYPE_ALIASES.add(_name, _dtype)


def parse_dtype(d: torch.dtype | str) -> torch.dtype:
    """``torch.bfloat16`` for ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or the dtype itself.

    >>> parse_dtype("bf16"), parse_dtype("torch.float16"), parse_dtype(torch.float64)
    (torch.bfloat16, torch.float16, torch.float64)
    >>> parse_dtype("fp8")
    Traceback (most recent call last):
    ...
    ValueError: unknown dtype 'fp8'; use a torch.dtype or one of ['bf16', 'bfloat16', 'double', ...]
    """
    if isinstance(d, torch.dtype):
        return d
    name = d.lower().removeprefix("torch.")
    if name not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {d!r}; use a torch.dtype or one of {sorted(DTYPE_ALIASES)}")
    return DTYPE_ALIASES[name]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def noncontiguous_like(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpInfo's construction: ``t`` in the odd slots of a buffer whose even slots hold a poison value.

    Returns the strided view and its buffer (whose ``[..., 0]`` slots must still be poison afterwards).
    """
    if t.is_floating_point() or t.is_complex():
        poison: float | bool | int = math.nan
    elif t.dtype == torch.bool:
        poison = True
    else:
        poison = 12
    buf = t.new_empty((*t.shape, 2))
    buf[..., 0] = poison
    buf[..., 1] = t
    return buf[..., 1], buf


LayoutRule = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
LAYOUT_RULES: Registry[str, LayoutRule] = Registry(
    "layout", "memtrim.verify.cases.LAYOUT_RULES.register(name)"
)
"""Layout name -> ``rule(t)`` giving ``t`` in that layout (new storage) and its poisoned buffer, if any."""


@LAYOUT_RULES.register("contiguous")
def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return t.clone(memory_format=torch.contiguous_format), None


@LAYOUT_RULES.register("noncontiguous")
def _noncontiguous(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return noncontiguous_like(t)


@LAYOUT_RULES.register("transposed")
def _transposed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    perm = list(range(t.dim()))[::-1]
    return t.permute(perm).contiguous().permute(perm), None


@LAYOUT_RULES.register("expanded")
def _expanded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = expand_dim(t)
    if dim is None:
        return t.clone(), None
    return t.narrow(dim, 0, 1).clone().expand(t.shape), None


LAYOUTS: tuple[str, ...] = tuple(LAYOUT_RULES)
"""The default layouts, in the order cases run."""


def apply_layout(t: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t`` laid out as ``layout``, detached, in new storage; plus the poisoned buffer if any.

    >>> t = torch.arange(6.0).view(2, 3)
    >>> [apply_layout(t, name)[0].stride() for name in LAYOUTS]
    [(3, 1), (6, 2), (1, 2), (0, 1)]
    """
    return LAYOUT_RULES.require(layout, f"choose from {LAYOUTS}")(t.detach())


def expand_dim(t: torch.Tensor) -> int | None:
    """The dim the ``expanded`` layout broadcasts along: the first one longer than 1."""
    return next((d for d, s in enumerate(t.shape) if s > 1), None)


def expanded_values(t: torch.Tensor) -> torch.Tensor:
    """The values an expanded layout of ``t`` holds (repeated along :func:`expand_dim`), contiguous."""
    dim = expand_dim(t)
    return t.clone() if dim is None else t.narrow(dim, 0, 1).expand(t.shape).contiguous()


def seed_rngs(seed: int, cuda_devices: Sequence[int] = ()) -> None:
    """``torch.manual_seed(seed)`` for the CPU generator and the given CUDA devices only (torch's own
    also queues a call, with a stack trace, for every accelerator backend not yet initialised)."""
    torch.default_generator.manual_seed(seed)
    for index in cuda_devices:
        torch.cuda.default_generators[index].manual_seed(seed)


class InputError(Exception):
    """The inputs of a case could not be built (bad builder, uncastable tensor)."""


def _cast(
    t: torch.Tensor, dtype: torch.dtype | None, where: str, given: torch.dtype | None = None
) -> torch.Tensor:
    if dtype is None or not (t.is_floating_point() or t.is_complex()):
        return t
    if t.is_complex() and not dtype.is_complex:
        raise InputError(
            f"{where} is {dtype_name(given or t.dtype)} and cannot be cast to {dtype_name(dtype)} without "
            "dropping its imaginary part; pass dtypes= with complex dtypes, or a builder function that "
            "makes real inputs"
        )
    return t.to(dtype)


def _random_like(t: torch.Tensor, seed: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + salt)
    if t.is_complex():
        return torch.randn(t.shape, generator=gen, dtype=torch.complex128)
    return torch.randn(t.shape, generator=gen, dtype=torch.float64)


def build_inputs(spec: InputsSpec, case: Case, device: torch.device) -> CaseInputs:
    """The canonical inputs of ``case``: from a builder ``spec(dtype, device, seed)`` or from examples.

    Example tensors give shapes and ``requires_grad``; their floating-point values are redrawn from the
    seed (standard normal) and rounded to the case dtype; integer, bool and non-tensor arguments are
    passed as given. A builder's tensors are used as returned (cast to the case dtype if they are not).
    """
    dtype = torch.float32 if case.autocast else case.dtype
    if callable(spec) and not isinstance(spec, torch.Tensor):
        try:
            cuda = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):  # seed the builder's draws; leave the caller's RNG be
                seed_rngs(case.seed, cuda)
                built = spec(dtype if dtype is not None else torch.float32, device, case.seed)
        except Exception as exc:
            raise InputError(
                f"the inputs builder raised {type(exc).__name__}: {exc}; fix the builder, or "
                f"leave {dtype_name(dtype) if dtype else 'this dtype'} out of dtypes= if the inputs do not "
                "support it"
            ) from exc
        args = built if isinstance(built, (tuple, list)) else (built,)
        leaves, tspec = tree_flatten(tuple(args))
        fresh = [
            _cast(x, dtype, f"argument leaf {i}").to(device) if isinstance(x, torch.Tensor) else x
            for i, x in enumerate(leaves)
        ]
    else:
        examples = (spec,) if isinstance(spec, torch.Tensor) else tuple(spec)
        leaves, tspec = tree_flatten(examples)
        fresh = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
                values = _random_like(x, case.seed, i)
                target = dtype if dtype is not None else x.dtype
                fresh.append(_cast(values, target, f"argument leaf {i}", x.dtype).to(device))
            elif isinstance(x, torch.Tensor):
                fresh.append(x.detach().clone().to(device))
            else:
                fresh.append(x)
    rgs = [isinstance(x, torch.Tensor) and x.requires_grad for x in leaves]
    fresh = [
        x.detach() if isinstance(x, torch.Tensor) else x for x in fresh
    ]  # canonical values carry no graph
    if case.layout == "expanded":
        fresh = [expanded_values(x) if isinstance(x, torch.Tensor) else x for x in fresh]
    for i, (x, rg) in enumerate(zip(fresh, rgs, strict=True)):
        if rg and isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex()):
            raise InputError(f"argument leaf {i} requires grad but is {dtype_name(x.dtype)}; only floats can")
    return CaseInputs(case, fresh, tspec, rgs)


def default_dtypes(spec: InputsSpec) -> tuple[torch.dtype | None, ...]:
    """fp64, fp32, fp16 and bf16 when the inputs have floating-point tensors; else the inputs as given."""
    if callable(spec) and not isinstance(spec, torch.Tensor):
        return DEFAULT_DTYPES
    examples = (spec,) if isinstance(spec, torch.Tensor) else tuple(spec)
    leaves = [x for x in tree_flatten(examples)[0] if isinstance(x, torch.Tensor)]
    if any(x.is_floating_point() or x.is_complex() for x in leaves):
        return DEFAULT_DTYPES
    return (None,)


def infer_device(spec: InputsSpec) -> torch.device:
    if callable(spec) and not isinstance(spec, torch.Tensor):
        return torch.device("cpu")
    examples = (spec,) if isinstance(spec, torch.Tensor) else tuple(spec)
    for x in tree_flatten(examples)[0]:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def upstream_like(t: torch.Tensor, seed: int, salt: int) -> torch.Tensor:
    """A fixed random tensor shaped and typed like ``t`` (upstream gradients, second-order directions)."""
    return _random_like(t, seed, 7919 + salt).to(dtype=t.dtype, device=t.device)
