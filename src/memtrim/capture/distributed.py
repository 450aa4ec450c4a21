"""torch.distributed under the recorder: tensors that stand for other tensors' memory, what a
collective's buffers are, what FSDP2 and DDP use storages as, and which rank a trace is.

- **Wrapper subclasses.** A ``DTensor`` (FSDP2's parameters, gradients and optimizer state) and an
  ``AsyncCollectiveTensor`` (what a functional collective returns before it is waited on) hold no
  memory of their own: their storage is a placeholder whose ``nbytes()`` is the global size and whose
  data pointer is invalid. Their local tensors hold the memory. The recorder returns
  ``NotImplemented`` for an op on them (as torch's own ``FSDPMemTracker`` does), so the subclass
  runs the op on its local tensors and the recorder records those ops, which make the allocations.
  Autograd's node for such an op (a DTensor ``mm``, which saves its DTensor operands) lands on the
  wrapper it returned, below which the local ops ran without one: the recorder reads what that node
  saved when the wrapper is handed to the next wrapper op, and marks the local tensors saved.
- **Collectives** (``c10d.allreduce_``, ``c10d._allgather_base_``, ``_c10d_functional.all_reduce``,
  ...) are ops like any other: recorded with the user line that issued them (FSDP's and DDP's
  frames are torch's, so that is the ``model(x)`` or ``loss.backward()`` line), their buffers as the
  op's inputs, and a functional collective's output as the allocation it makes. An async work
  handle holds its tensors until torch releases them; the free is observed then, as any free is.
- **Facts** a collective tells (:data:`AFTER_OPS`, each read once per op call, from the op's own
  arguments): an all-gather into one tensor writes an ``all_gather_buffer`` (FSDP2's flat buffer);
  FSDP2's ``fsdp.split_with_sizes_copy`` copies it out into the ``unsharded_parameter`` tensors; a
  reduce-scatter reads a ``reduce_scatter_buffer``; an all-reduce run in backward reduces a
  ``gradient_bucket`` (DDP's buckets; under a communication hook, which may all-reduce a compressed
  copy, also the ``GradBucket``'s own buffer, found in the hook's frame). At the region's end,
  FSDP2's own state names the sharded parameters, the unsharded ones and the sharded gradients
  (:func:`fsdp_facts`).
- **gloo's reduce-scatter** works on a clone of its input, made inside the op where no dispatch mode
  sees it (``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` all-reduces the clone, and the work's
  ``wait()`` copies this rank's chunk out). It is recorded as made by the collective; the clone is
  claimed when it is first seen (the chunk the wait copies from), so its free is observed too. A
  functional reduce-scatter (``_c10d_functional.reduce_scatter_tensor``: the backward of
  ``all_gather_single_autograd``) waits inside ``wait_tensor``, where no mode sees the copy: its clone
  is freed when its output is waited on.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Protocol

import torch

from memtrim.trace.model import Fact, Phase

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_NO_STORAGE = (RuntimeError, NotImplementedError, TypeError)


# -- wrapper subclasses ------------------------------------------------------------------------------
def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor._api")
    return getattr(module, "DTensor", None)


def _async_collective_type() -> type | None:
    module = sys.modules.get("torch.distributed._functional_collectives")
    return getattr(module, "AsyncCollectiveTensor", None)


def _desugared_types() -> tuple[type, ...]:
    return tuple(t for t in (_dtensor_type(), _async_collective_type()) if t is not None)


# by the ``types`` tuple a dispatch mode is handed: whether the op runs on a wrapper that holds no memory
_desugars: dict[tuple[type, ...], bool] = {}


def desugars(types: tuple[type, ...]) -> bool:
    """True when an op's tensor subclasses include a DTensor or an AsyncCollectiveTensor: the recorder
    lets the subclass run it on its local tensors. A subclass type can only exist once its module is
    imported, so an answer, once given, stays true."""
    found = _desugars.get(types)
    if found is None:
        wrappers = _desugared_types()
        found = _desugars[types] = bool(wrappers) and any(issubclass(t, wrappers) for t in types)
    return found


def placed_fact(t: torch.Tensor, fact: Fact) -> Fact:
    """The fact a subclass tensor's parts get: a parameter that is a DTensor sharded over ranks (a
    ``Shard`` placement: FSDP2's parameters) is this rank's ``sharded_parameter``."""
    dtensor = _dtensor_type()
    sharded = fact is Fact.PARAMETER and dtensor is not None and isinstance(t, dtensor)
    if sharded and any(p.is_shard() for p in t.placements):  # type: ignore[attr-defined]
        return Fact.SHARDED_PARAMETER
    return fact


# -- what collectives tell -----------------------------------------------------------------------------
class Listener(Protocol):
    """What the hooks below need of the recorder."""

    def tag_storage(self, t: torch.Tensor, fact: Fact) -> None: ...
    def phase_of(self, seq: int) -> Phase: ...
    def made_unseen(
        self, like: torch.Tensor, fact: Fact, seq: int, held_by: torch.Tensor | None = None
    ) -> None: ...
    def waited(self, t: torch.Tensor, seq: int) -> None: ...
    def record_outputs(self, out: Any, seq: int) -> None: ...
    def describe(self, t: torch.Tensor) -> None: ...


After = Callable[[Listener, Any, dict[str, Any], Any, int], None]
"""``hook(recorder, args, kwargs, out, seq)``: run after the op returned, before its outputs are read."""


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, _Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _tag_all(rec: Listener, value: Any, fact: Fact) -> None:
    for t in _tensors(value):
        rec.tag_storage(t, fact)


def _clones_input(process_group: Any, t: torch.Tensor) -> bool:
    """Whether the backend that reduce-scatters ``t`` for ``process_group`` (boxed, or a functional
    collective's group name) is gloo (which clones it)."""
    try:
        if isinstance(process_group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(process_group)  # type: ignore[arg-type]
        else:
            group = torch._C._distributed_c10d.ProcessGroup.unbox(process_group)
        backend = group._get_backend(t.device)
        return isinstance(backend, torch.distributed.ProcessGroupGloo)
    except Exception:  # no gloo in this build, a group without that device, a fake group
        return False


def _all_gather_into_tensor(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # c10d::_allgather_base_(Tensor output_tensor, Tensor input_tensor, ProcessGroup, ...)
    _tag_all(rec, args[0], Fact.ALL_GATHER_BUFFER)


def _all_gather_into_tensors(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # c10d::allgather_into_tensor_coalesced_(Tensor[] outputs, Tensor[] inputs, ProcessGroup, ...)
    _tag_all(rec, args[0], Fact.ALL_GATHER_BUFFER)


def _reduce_scatter_tensors(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # c10d::_reduce_scatter_base_(Tensor output, Tensor input, ProcessGroup, ReduceOp, ...) and
    # c10d::reduce_scatter_tensor_coalesced_(Tensor[] outputs, Tensor[] inputs, ProcessGroup, ...)
    inputs = list(_tensors(args[1]))
    for t in inputs:
        rec.tag_storage(t, Fact.REDUCE_SCATTER_BUFFER)
    if inputs and _clones_input(args[2], inputs[0]):
        for t in inputs:
            rec.made_unseen(t, Fact.REDUCE_SCATTER_BUFFER, seq)


_HOOK_FRAMES = 16
"""How far up the Python stack an all-reduce in backward looks for the DDP comm hook it runs in."""


def _comm_hook_bucket() -> torch.Tensor | None:
    """The flat bucket of the DDP communication hook this all-reduce runs in, if any: the buffer of the
    ``GradBucket`` a frame up the stack was handed (``fp16_compress_hook(state, bucket)`` all-reduces
    a compressed copy of ``bucket.buffer()``, and the reducer copies the gradients in and out of that
    buffer, not of the copy)."""
    grad_bucket = getattr(torch._C._distributed_c10d, "GradBucket", None)
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_HOOK_FRAMES):
        if frame is None or grad_bucket is None:
            return None
        for value in frame.f_locals.values():
            if isinstance(value, grad_bucket):
                buffer: torch.Tensor = value.buffer()
                return buffer
        frame = frame.f_back
    return None


def _all_reduce(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # c10d::allreduce_(Tensor[] tensors, ProcessGroup, ...): in backward, DDP's buckets (or, under a
    # communication hook, what the hook all-reduces for the bucket, and the bucket itself)
    if rec.phase_of(seq) is Phase.BACKWARD:
        _tag_all(rec, args[0], Fact.GRADIENT_BUCKET)
        bucket = _comm_hook_bucket()
        if bucket is not None:
            rec.tag_storage(bucket, Fact.GRADIENT_BUCKET)


def _fsdp_copy_out(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # fsdp::split_with_sizes_copy(Tensor all_gather_output, SymInt[] sizes, int dim, *, Tensor(a!)[] out):
    # each out tensor's storage was just allocated by resize_ (FSDPParam.alloc_all_gather_outputs)
    for t in _tensors(kwargs.get("out", ())):
        rec.describe(t)
        rec.tag_storage(t, Fact.UNSHARDED_PARAMETER)


def _functional_gather(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # _c10d_functional::all_gather_into_tensor(Tensor input, ...) -> Tensor: a new buffer
    rec.record_outputs(out, seq)
    _tag_all(rec, out, Fact.ALL_GATHER_BUFFER)


def _functional_reduce_scatter(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # _c10d_functional::reduce_scatter_tensor(Tensor input, str reduce_op, int group_size,
    # str group_name) -> Tensor (all_gather_single_autograd's backward): a new output; gloo
    # reduce-scatters a clone of the input, which the work holds until the output is waited on
    rec.record_outputs(out, seq)
    inputs = list(_tensors(args[0]))
    for t in inputs:
        rec.tag_storage(t, Fact.REDUCE_SCATTER_BUFFER)
    if inputs and isinstance(out, _Tensor) and _clones_input(args[3], inputs[0]):
        rec.made_unseen(inputs[0], Fact.REDUCE_SCATTER_BUFFER, seq, held_by=out)


def _functional_wait(rec: Listener, args: Any, kwargs: dict[str, Any], out: Any, seq: int) -> None:
    # _c10d_functional::wait_tensor(Tensor tensor) -> Tensor: the work is done and released
    for t in _tensors(args[0]):
        rec.waited(t, seq)


AFTER_OPS: dict[str, After] = {
    "c10d._allgather_base_.default": _all_gather_into_tensor,
    "c10d.allgather_into_tensor_coalesced_.default": _all_gather_into_tensors,
    "c10d._reduce_scatter_base_.default": _reduce_scatter_tensors,
    "c10d.reduce_scatter_tensor_coalesced_.default": _reduce_scatter_tensors,
    "c10d.allreduce_.default": _all_reduce,
    "fsdp.split_with_sizes_copy.default": _fsdp_copy_out,
    "_c10d_functional.all_gather_into_tensor.default": _functional_gather,
    "_c10d_functional.all_gather_into_tensor_coalesced.default": _functional_gather,
    "_c10d_functional.reduce_scatter_tensor.default": _functional_reduce_scatter,
    "_c10d_functional.wait_tensor.default": _functional_wait,
}
"""By op name (``str(func)``): what the recorder reads after the op ran."""


# -- FSDP2's own state at the region's end -------------------------------------------------------------
def fsdp_facts(modules: Iterable[torch.nn.Module]) -> Iterator[tuple[torch.Tensor, Fact]]:
    """What FSDP2 (``fully_shard``) holds for the FSDP trees ``modules`` belong to: each parameter's
    shard (padded, as FSDP stores it), its unsharded tensors (the all-gather outputs) and its sharded
    gradient. A module seen running finds its whole tree (FSDP's root shares one context with every
    state under it). Read from FSDP's private state, so any surprise there yields nothing."""
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    module_type = getattr(fsdp, "FSDPModule", None)
    if module_type is None:
        return
    states: dict[int, Any] = {}
    for module in modules:
        if isinstance(module, module_type):
            try:
                state = module._get_fsdp_state()
                for found in (state, *state._state_ctx.all_states):
                    states[id(found)] = found
            except Exception:
                continue
    for state in states.values():
        try:
            group = state._fsdp_param_group
            params = [] if group is None else list(group.fsdp_params)
        except Exception:
            continue
        for param in params:
            try:
                yield param._sharded_param_data, Fact.SHARDED_PARAMETER
                for t in param.all_gather_outputs:
                    yield t, Fact.UNSHARDED_PARAMETER
                grad = param.sharded_param.grad
                if grad is not None:
                    yield grad, Fact.GRADIENT
            except Exception:
                continue


# -- which rank -------------------------------------------------------------------------------------
def world() -> dict[str, Any] | None:
    """This process's rank, the world size and the backend: from the default process group when one is
    initialised, else from the variables torchrun sets (``RANK``, ``WORLD_SIZE``); None for a run on
    one process."""
    dist = torch.distributed
    try:
        if dist.is_available() and dist.is_initialized():
            found: dict[str, Any] = {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "backend": str(dist.get_backend()),
            }
            run_id = os.environ.get("TORCHELASTIC_RUN_ID")
            if run_id:
                found["run_id"] = run_id
            return found
    except Exception:
        pass
    return world_from_environment()


def world_from_environment() -> dict[str, Any] | None:
    """Rank and world size as torchrun gives them to each process (None outside torchrun)."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    if size <= 1:
        return None
    found: dict[str, Any] = {"rank": rank, "world_size": size}
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id:
        found["run_id"] = run_id
    return found


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank ``rank`` of a world of ``world_size`` that exists only here: the default
    process group is torch's fake one (backend ``"fake"``, whose collectives return at once and move
    no data). With ``memtrim.track(fake=True)`` inside, an FSDP2 or DDP program's per-rank memory at
    that world size is estimated in one CPU process, as torch's ``FSDPMemTracker`` does."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "a default process group exists already: call fake_world() before init_process_group()"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
