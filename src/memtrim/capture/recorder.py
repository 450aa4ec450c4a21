"""The dispatch-mode recorder: every aten op, every new storage, every free, with phase and source.

Accounting is at the storage level. An output whose storage is already known (an input's, a view, an
in-place result) allocates nothing; a storage seen for the first time as an *output* is new. A storage
seen for the first time as an *input* existed before the region: it is watched only so that its free
inside the region lowers the live bytes, as the allocator would. Frees are observed through weak
references to the storage's Python object, which PyTorch keeps alive exactly as long as the C++
storage (PyObject preservation), so the callback fires when the memory is returned.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from sys import _getframe
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrim.capture.frames import (
    ENGINE,
    INTERNAL,
    OPTIMIZER,
    Walk,
    inside_function_forward,
    user_site,
)
from memtrim.capture.modules import ModulePath
from memtrim.trace.model import Allocation, Site, Trace

_Tensor = torch.Tensor
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_current_autograd_node = torch._C._current_autograd_node
_is_grad_enabled = torch.is_grad_enabled
_current_graph_task_id = torch._C._current_graph_task_id
_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__


_dtype_names: dict[torch.dtype, str] = {}
_device_names: dict[torch.device, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: torch.device) -> str:
    name = _device_names.get(device)
    if name is None:
        name = _device_names[device] = str(device)
    return name


def _metadata(node: Any) -> dict[str, Any]:
    """A node's metadata dict (a property at runtime; torch's stubs call it a method)."""
    metadata: dict[str, Any] = node.metadata
    return metadata


# Key under which a forward op's site is stamped on the autograd node it created, so the backward
# ops that node runs can be attributed to the forward line.
NODE_STAMP = "memtrim.site"


class _StorageWatch(weakref.ref):
    __slots__ = ("allocation", "key")
    allocation: Allocation
    key: int


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or results (flat, or in one level of list/tuple)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (list, tuple)):
                yield from _tensors(item)


_LIFT_OPS = frozenset({torch.ops.aten.lift_fresh.default})
# Not recorded: a detach never allocates (its output shares the input's storage), and autograd issues
# one around every tensor it saves for backward, so recording them would double the op count of
# training code and tell a reader nothing.
_DETACH = torch.ops.aten.detach.default


class _OpInfo:
    """What the recorder needs to know about an op overload, computed once per overload."""

    __slots__ = ("call", "func", "lifts", "name", "writes", "written_args", "written_kwargs")

    def __init__(self, func: Any) -> None:
        self.func = func  # held so that its id, the cache key, stays its own
        # OpOverload.__call__ is a Python frame that only forwards to _op (subclasses may do more)
        self.call = func._op if type(func) is torch._ops.OpOverload else func
        self.name = str(func)
        # torch.tensor(data) builds its tensor below the dispatch modes, then passes it through
        # lift_fresh so that modes see it: that input is new, not something from before the region.
        self.lifts = func in _LIFT_OPS
        self.written_args: list[int] = []
        self.written_kwargs: list[str] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                if arg.kwarg_only:
                    self.written_kwargs.append(arg.name)
                else:
                    self.written_args.append(i)
        self.writes = bool(self.written_args or self.written_kwargs)


# By id(func): OpOverload.__hash__ is a Python method, too slow for a per-op lookup. Shared by all
# recorders so that each track() does not rebuild it.
_infos: dict[int, _OpInfo] = {}


class Recorder(TorchDispatchMode):
    """Records into ``trace``; see :func:`memtrim.track` for the public entry point."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disabling shim by default; it costs ~1 us per op
        # and only matters when the mode is used inside a torch.compile'd function.
        return False

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace
        self.modules = ModulePath()
        self._clock = itertools.count()
        self._watches: dict[int, _StorageWatch] = {}
        self._log = trace.ops
        # outputs of forward ops whose autograd node (made after dispatch returns) is still to be stamped
        self._pending: list[weakref.ref[torch.Tensor]] = []
        self._pending_ops: list[int] = []
        self._last_phase = "other"
        self._engine_walk: tuple[int, Walk | None, Walk] = (-1, None, (None, INTERNAL))
        self._quiet = 0
        self._open = True

    # -- ops ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # The hottest code in memtrim: one call per aten op. Keep it flat; move rare cases out.
        if kwargs is None:
            kwargs = {}
        if self._quiet or not self._open or func is _DETACH:
            return func(*args, **kwargs)
        if self._pending:
            self._stamp_nodes()
        info = _infos.get(id(func))
        if info is None:
            info = _infos[id(func)] = _OpInfo(func)

        modules = self.modules
        caller = _getframe(1)
        if caller.f_code is _ENGINE_RUN and (task := _current_graph_task_id()) != -1:
            # Every op the engine runs for one backward call sees the same, suspended frames above
            # it: walk them once per graph task (and innermost module entry).
            walk = self._engine_walk
            if walk[0] != task or walk[1] is not modules.entry:
                walk = self._engine_walk = (task, modules.entry, user_site(caller, modules.entry))
            call_site, between = walk[2]
        else:
            call_site, between = user_site(caller, modules.entry)
        node = _current_autograd_node()
        grad_enabled = _is_grad_enabled()
        if not info.lifts:
            watches = self._watches
            try:
                for t in args if not kwargs else (*args, *kwargs.values()):
                    if isinstance(t, _Tensor):
                        storage = t.untyped_storage()
                        if storage._cdata not in watches:
                            self._watch_preexisting(t, storage)
                    elif isinstance(t, (list, tuple)) and t and type(t[0]) is not int:
                        self._watch_inputs(t)  # int[] (sizes, dims) never holds a tensor: skipped
            except (RuntimeError, NotImplementedError, TypeError):
                # sparse/nested/opaque tensors have no single storage: account what can be
                self._watch_inputs((*args, *kwargs.values()))
        site, module = call_site, modules.path
        node_name = None
        if node is not None or between == ENGINE:
            phase = "backward"
            if node is not None:
                node_name = node.name()
                # An op the engine ran for a built-in node has no user frame of its own: point at the
                # forward line that made the node. Code inside a custom backward keeps its own line.
                if between == ENGINE or call_site is None:
                    site, module = _metadata(node).get(NODE_STAMP, (call_site, module))
        elif between == OPTIMIZER:
            phase = "other"
        elif grad_enabled or inside_function_forward(_getframe(1)):
            phase = "forward"  # grad mode is off inside a custom Function's forward
        else:
            phase = "other"
        self._last_phase = phase

        log = self._log
        seq = len(log.ticks)
        log.ticks.append(next(self._clock))
        log.names.append(info.name)
        log.phases.append(phase)
        log.sites.append(site)
        log.nodes.append(node_name)
        log.modules.append(module)
        written = self._written_sizes(info, args, kwargs) if info.writes else None

        try:
            out = info.call(*args, **kwargs)
        except BaseException:
            self.trace.failed_op = log[seq]
            raise

        if written:
            self._record_resizes(written, seq, call_site)
        if info.lifts:
            self._record_lifted(args, seq, call_site)
        stamp = grad_enabled and phase == "forward"  # autograd makes nodes only with grad mode on
        watches = self._watches
        for t in (out,) if isinstance(out, _Tensor) else _tensors(out):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                pass  # sparse/nested/opaque tensors have no single storage to account
            else:
                if storage._cdata not in watches and (nbytes := storage.nbytes()):
                    self._start_watch(storage, self._new_allocation(t, nbytes, seq, call_site))
            if stamp and (t.is_floating_point() or t.is_complex()):
                self._pending.append(weakref.ref(t))
                self._pending_ops.append(seq)
        return out

    def _watch_inputs(self, values: Any) -> None:
        """Start watching input storages not seen before (the general, slower path)."""
        watches = self._watches
        for t in _tensors(values):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if storage._cdata not in watches:
                self._watch_preexisting(t, storage)

    def _record_lifted(self, args: Any, seq: int, call_site: Site | None) -> None:
        for t in _tensors(args):
            storage = t.untyped_storage()
            if storage._cdata not in self._watches and storage.nbytes():
                self._start_watch(storage, self._new_allocation(t, storage.nbytes(), seq, call_site))

    def _new_allocation(self, t: torch.Tensor, nbytes: int, seq: int, call_site: Site | None) -> Allocation:
        allocations = self.trace.allocations
        log = self._log
        site = log.sites[seq]
        dtype, device = t.dtype, t.device
        alloc = Allocation(
            len(allocations),
            nbytes,
            _dtype_names.get(dtype) or _dtype_name(dtype),
            tuple(t.shape),
            _device_names.get(device) or _device_name(device),
            log.names[seq],
            log.phases[seq],
            next(self._clock),
            None,
            None,
            site,
            call_site if call_site is not site else None,
            log.nodes[seq],
            log.modules[seq],
        )
        allocations.append(alloc)
        return alloc

    def _watch_preexisting(self, t: torch.Tensor, storage: Any) -> None:
        dtype, device = t.dtype, t.device
        alloc = Allocation(
            len(self.trace.allocations),
            storage.nbytes(),
            _dtype_names.get(dtype) or _dtype_name(dtype),
            tuple(t.shape),
            _device_names.get(device) or _device_name(device),
            "(before the region)",
            "other",
            -1,
            preexisting=True,
        )
        self.trace.allocations.append(alloc)
        self._start_watch(storage, alloc)

    def _start_watch(self, storage: Any, alloc: Allocation) -> None:
        watch = _StorageWatch(storage, self._on_free)
        watch.allocation = alloc
        watch.key = storage._cdata
        self._watches[watch.key] = watch

    def _on_free(self, watch: _StorageWatch) -> None:
        if not self._open:
            return
        alloc = watch.allocation
        alloc.free_tick = next(self._clock)
        alloc.free_phase = self._last_phase
        if self._watches.get(watch.key) is watch:
            del self._watches[watch.key]

    # -- resize_ and out= -------------------------------------------------------------------------
    def _written_sizes(self, info: _OpInfo, args: Any, kwargs: Any) -> list[tuple[torch.Tensor, int]]:
        written = [args[i] for i in info.written_args if i < len(args)]
        written += [kwargs[name] for name in info.written_kwargs if name in kwargs]
        sizes = []
        for t in written:
            for tensor in _tensors(t):
                try:
                    sizes.append((tensor, tensor.untyped_storage().nbytes()))
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
        return sizes

    def _record_resizes(
        self, written: list[tuple[torch.Tensor, int]], seq: int, call_site: Site | None
    ) -> None:
        for t, before in written:
            storage = t.untyped_storage()
            after = storage.nbytes()
            if after == before:
                continue
            # The allocator hands out a new block and frees the old one; the StorageImpl stays.
            watch = self._watches.get(storage._cdata)
            new = self._new_allocation(t, after, seq, call_site)
            if watch is not None:
                old = watch.allocation
                old.free_tick = next(self._clock)
                old.free_phase = new.phase
                watch.allocation = new
            else:
                self._start_watch(storage, new)

    # -- autograd -------------------------------------------------------------------------------
    def _stamp_nodes(self) -> None:
        pending, seqs = self._pending, self._pending_ops
        self._pending, self._pending_ops = [], []
        sites, modules = self._log.sites, self._log.modules
        for i, ref in enumerate(pending):
            t = ref()
            if t is None:
                continue
            node = t.grad_fn
            if node is not None:
                metadata = _metadata(node)
                if NODE_STAMP not in metadata:
                    seq = seqs[i]
                    metadata[NODE_STAMP] = (sites[seq], modules[seq])

    def pack_saved(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """saved_tensors_hooks pack: marks the storage as saved for backward.

        Returns a detached alias of a tensor that has a grad_fn, not ``t`` itself: holding ``t`` would
        tie the node to its own output in a reference cycle the garbage collector cannot see. The
        version is kept so that unpacking raises on an in-place change, as autograd does without hooks.
        """
        if self._pending:
            self._stamp_nodes()
        if t.is_leaf:  # no grad_fn; asking is_leaf builds no Python node object, unlike grad_fn
            alias = t  # a leaf or a tensor outside autograd: no node to form a cycle with
        elif type(t) is _Tensor:
            with _DisableTorchDispatch():  # skip every dispatch mode, memtrim's included: ~10x cheaper
                alias = t.detach()
        else:  # a tensor subclass (FakeTensor...) needs its __torch_dispatch__
            self._quiet += 1
            try:
                alias = t.detach()
            finally:
                self._quiet -= 1
        try:
            watch = self._watches.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, TypeError):
            watch = None
        if watch is not None and not watch.allocation.preexisting:
            watch.allocation.saved = True
        return alias, t._version

    @staticmethod
    def unpack_saved(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        alias, version = packed
        if alias._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{type(alias).__name__} {list(alias.shape)}, {alias.dtype}] is at version "
                f"{alias._version}; expected version {version} instead. (Raised by memtrim's saved-tensor "
                "hook; autograd raises the same error without memtrim.)"
            )
        return alias

    # -- lifetime -------------------------------------------------------------------------------
    def finish(self, *, hooks_saw_saves: bool = True) -> None:
        """Stop observing. Storages still watched are what was alive at the end (or at the failure).

        Without saved-tensor hooks, "saved" falls back to lifetime: made in forward, freed in backward
        (autograd frees what it saved as backward consumes it).
        """
        if self._pending:
            self._stamp_nodes()
        self._open = False
        if not hooks_saw_saves:
            for a in self.trace.allocations:
                if a.phase == "forward" and a.free_phase == "backward":
                    a.saved = True
        self.trace.end_tick = next(self._clock)
        self._watches.clear()
        self._pending.clear()
        self._pending_ops.clear()
        self.trace.finished = True
