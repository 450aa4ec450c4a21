"""The dispatch-mode recorder: every aten op, every new storage, every free, with phase and source.

Accounting is at the storage level. An output whose storage is already known (an input's, a view, an
in-place result) allocates nothing; a storage seen for the first time as an *output* is new. A storage
seen for the first time as an *input* existed before the region: it is watched only so that its free
inside the region lowers the live bytes, as the allocator would. Frees are observed through weak
references to the storage's Python object, which PyTorch keeps alive exactly as long as the C++
storage (PyObject preservation), so the callback fires when the memory is returned.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import weakref
from array import array
from collections.abc import Callable, Iterator
from sys import _getframe
from typing import Any

import torch

from memtrim.capture import distributed, storages
from memtrim.capture.facts import ACCUMULATE_GRAD, FactRecorder
from memtrim.capture.fork import DetachableMode
from memtrim.capture.frames import (
    ENGINE,
    INTERNAL,
    OPTIMIZER,
    Walk,
    inside_function_forward,
    runs_code,
    user_site,
)
from memtrim.capture.modules import modules_seen, modules_with_buffers, rename_roots
from memtrim.trace.collector import collector_paused
from memtrim.trace.model import (
    SCALAR_OPS,
    AllocationLog,
    AllocRow,
    Fact,
    FreeRow,
    OpRow,
    Phase,
    Site,
    TraceLog,
)
from memtrim.trace.packed import KEEP_RECENT, SEAL_EVERY

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_current_autograd_node = torch._C._current_autograd_node
_is_grad_enabled = torch.is_grad_enabled
_current_graph_task_id = torch._C._current_graph_task_id
_user_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_CustomFunctionNode = torch.autograd.function.BackwardCFunction
_ENGINE_RUN = torch.autograd.graph._engine_run_backward.__code__
_FORWARD, _BACKWARD, _OPTIMIZER, _OTHER = Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.OTHER
# Rows are named tuples built by tuple.__new__ (a C call; a NamedTuple's own __new__ is Python code).
_row = tuple.__new__


def _metadata(node: Any) -> dict[str, Any]:
    """A node's metadata dict (a property at runtime; torch's stubs call it a method)."""
    metadata: dict[str, Any] = node.metadata
    return metadata


# Key under which a forward op's site is stamped on the autograd node it created, so the backward
# ops that node runs can be attributed to the forward line.
NODE_STAMP = "memtrim.site"
# Key under which a wrapper subclass's node (a DTensor op's) is marked once what it saved was read.
WRAPPER_READ = "memtrim.wrapper-saved"


class _StorageWatch(weakref.ref):
    __slots__ = ("index", "key")
    index: int  # the allocation's row
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


# Per node class: a getter for what the node saved for backward, as a tuple of tensors, lists of
# tensors and Nones (built-in nodes unpack each saved variable as ``_saved_<name>``; a custom
# Function's node keeps its ``ctx.save_for_backward`` tensors in ``saved_tensors``).
_saved_getters: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def saved_getter(node: Any) -> Callable[[Any], tuple[Any, ...]]:
    kind = type(node)
    getter = _saved_getters.get(kind)
    if getter is None:
        if isinstance(node, _CustomFunctionNode):
            getter = operator.attrgetter("saved_tensors")
        else:
            names = [f"_saved_{a[len('_raw_saved_') :]}" for a in dir(node) if a.startswith("_raw_saved_")]
            if len(names) > 1:
                getter = operator.attrgetter(*names)
            elif names:  # attrgetter of one name returns the value, not a tuple
                one = operator.attrgetter(names[0])
                getter = lambda node: (one(node),)  # noqa: E731
            else:
                getter = lambda node: ()  # noqa: E731
        getter = _saved_getters[kind] = getter
    return getter


_LIFT_OPS = frozenset({torch.ops.aten.lift_fresh.default})
# Not recorded: a detach never allocates (its output shares the input's storage), and autograd issues
# them internally (one per parameter when it stores a gradient in .grad), which would tell a reader
# nothing.
_DETACH = torch.ops.aten.detach.default
_detach = _DETACH._op
# Not recorded either: a fake tensor's ``.device`` is answered by dispatching prim.device (FakeTensor
# sets dispatch_device), a query that allocates nothing. Autograd asks it while it builds an op's
# node, before the output holds that node: treated as an op it would stamp the node too early.
_DEVICE = torch.ops.prim.device.default
_device = _DEVICE._op


class _OpInfo:
    """What the recorder needs to know about an op overload, computed once per overload."""

    __slots__ = (
        "after",
        "arg_names",
        "call",
        "func",
        "lifts",
        "name",
        "saves",
        "scalars",
        "special",
        "writes",
        "written_args",
        "written_kwargs",
    )

    def __init__(self, func: Any) -> None:
        self.func = func  # held so that its id, the cache key, stays its own
        # OpOverload.__call__ is a Python frame that only forwards to _op (subclasses may do more)
        self.call = func._op if type(func) is torch._ops.OpOverload else func
        self.name = str(func)
        # torch.tensor(data) builds its tensor below the dispatch modes, then passes it through
        # lift_fresh so that modes see it: that input is new, not something from before the region.
        self.lifts = func in _LIFT_OPS
        # what a collective's arguments say about its buffers (memtrim.capture.distributed)
        self.after = distributed.AFTER_OPS.get(self.name)
        # the Python numbers of elementwise arithmetic (logits / 30.0): kept for the loss rule's fix text
        self.scalars = self.name in SCALAR_OPS
        self.arg_names = [arg.name for arg in func._schema.arguments] if self.scalars else []
        self.special = self.lifts or self.after is not None
        self.written_args: list[int] = []
        self.written_kwargs: list[str] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                if arg.kwarg_only:
                    self.written_kwargs.append(arg.name)
                else:
                    self.written_args.append(i)
        self.writes = bool(self.written_args or self.written_kwargs)
        # A view op's node saves no tensors (a view's gradient never needs the values), so it is not
        # read for what it saved.
        returns = func._schema.returns
        self.saves = self.writes or not returns or any(r.alias_info is None for r in returns)


# By id(func): OpOverload.__hash__ is a Python method, too slow for a per-op lookup. Shared by all
# recorders so that each track() does not rebuild it.
_infos: dict[int, _OpInfo] = {}


def _new_info(func: Any) -> _OpInfo:
    info = _infos[id(func)] = _OpInfo(func)
    return info


class Recorder(DetachableMode):
    """Records into ``trace``; see :func:`memtrim.track` for the public entry point."""

    # told of allocations outside the dispatcher (memtrim.capture.outside)
    listens_outside = True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disabling shim by default; it costs ~1 us per op
        # and only matters when the mode is used inside a torch.compile'd function.
        return False

    def __init__(self, trace: TraceLog, fake_mode: Any = None) -> None:
        super().__init__()
        self.trace = trace
        # the FakeTensorMode below this one (track(fake=True)): it gives tensors from before the
        # region fake twins with storages of their own, which are the same memory
        self._fake_mode = fake_mode
        self._twins: list[torch.Tensor] = []
        self._clock = itertools.count()
        self._watches: dict[int, _StorageWatch] = {}
        # the lists and dicts rows are written to (the logs pack older rows every SEAL_EVERY ops)
        self._ops = trace.ops.writing_rows()
        self._recorded = trace.recorded = AllocationLog()
        self._rows, self._frees, facts = self._recorded.writing()
        self._seal_at = SEAL_EVERY + KEEP_RECENT
        # an output of the last op, whose autograd node (made after dispatch returns) is still to be
        # stamped, and the op's number
        self._pending: tuple[weakref.ref[torch.Tensor], int, bool] | None = None
        self._last_phase = _OTHER
        self._engine_walk: tuple[int, Walk] = (-1, (None, INTERNAL, None))
        # forward ops run under the user's saved-tensor hooks, whose nodes are not read
        self._under_user_hooks: set[int] = set()
        # Watches of freed storages, queued by their weakref callback: list.append, C code, so that a
        # Ctrl-C can never land inside memtrim's callback and be swallowed there. Ticked at the next
        # op (or event) boundary, which keeps their order against allocations.
        self._freed: list[_StorageWatch] = []
        self._queue_free = self._freed.append
        # storages seen that hold no memory (meta, wrapper subclasses): key -> weak reference
        self._no_memory: dict[int, weakref.ref[Any]] = {}
        # ops the engine ran for an AccumulateGrad node
        self._accumulating: set[int] = set()
        self._accumulated = array("q")  # (those of them before the last seal)
        self._facts = FactRecorder(self._watches, facts, self._watch_one_preexisting)
        # blocks a collective made where no mode sees them (gloo's reduce-scatter clone), each
        # (bytes, dtype, device, row) until its storage is first seen
        self._unseen: list[tuple[int, Any, Any, int]] = []
        # blocks a functional collective's work holds until its output is waited on (gloo's clone of
        # a functional reduce-scatter's input): the output's storage key -> their rows
        self._until_wait: dict[int, list[int]] = {}
        self._call_site: Site | None = None  # the call site of the op whose after-hook is running
        self._open = True

    def __enter__(self) -> Recorder:
        self._facts.install()
        try:
            return super().__enter__()
        except BaseException:
            self._facts.remove()
            raise

    def __exit__(self, *exc: object) -> None:
        self._facts.remove()
        super().__exit__(*exc)

    # -- ops ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # The hottest code in memtrim: one call per aten op. Keep it flat; move rare cases out.
        if func is _DETACH:
            if type(node := _current_autograd_node()) is ACCUMULATE_GRAD and self._open:
                self._accumulate_grad(node, args[0] if args else None)  # stealing the gradient?
            return _detach(*args, **kwargs) if kwargs else _detach(*args)
        if func is _DEVICE:
            return _device(*args)
        if kwargs is None:
            kwargs = {}
        if not self._open:
            return func(*args, **kwargs)
        if types and distributed.desugars(types):
            self._read_wrapper_nodes(args, kwargs)
            return NotImplemented  # a DTensor runs the op on its local tensors, which are recorded
        if self._freed:
            self._drain_frees()
        if (pending := self._pending) is not None:
            self._pending = None
            self._stamp_node(*pending)
        info = _infos.get(id(func)) or _new_info(func)

        caller = _getframe(0).f_back
        if caller is None:
            # No Python frame calls the op: one of autograd's device threads (CUDA backward), the
            # only threads that run ops under a mode their Python code did not enter.
            call_site, between, module = None, ENGINE, None
        elif caller.f_code is _ENGINE_RUN and (task := _current_graph_task_id()) != -1:
            # Every op the engine runs for one backward call sees the same, suspended frames above
            # it: walk them once per graph task.
            walk = self._engine_walk
            if walk[0] != task:
                walk = self._engine_walk = (task, user_site(caller))
            call_site, between, module = walk[1]
        else:
            call_site, between, module = user_site(caller)
        inputs: list[int] = []  # rows of the storages the op reads: the data flow diagnoses follow
        if not info.lifts:
            watches = self._watches
            try:
                for t in (*args, *kwargs.values()) if kwargs else args:
                    if isinstance(t, _Tensor):
                        storage = t.untyped_storage()
                        watch = watches.get(storage._cdata)
                        if watch is not None:
                            inputs.append(watch.index)
                        else:
                            inputs += self._watch_preexisting(t, storage)  # new: from before
                    elif isinstance(t, (list, tuple)) and t and type(t[0]) is not int:
                        self._watch_inputs(t, inputs)  # int[] (sizes, dims) never holds a tensor: skipped
            except (RuntimeError, NotImplementedError, TypeError):
                # sparse/nested/opaque tensors have no single storage: account what can be
                inputs.clear()
                self._watch_inputs((*args, *kwargs.values()), inputs)

        node = _current_autograd_node()
        grad_enabled = _is_grad_enabled()
        site = call_site
        if node is not None:
            phase = _BACKWARD
            node_name = node.name()
            # An op the engine ran for a built-in node has no user frame of its own: point at the
            # forward line that made the node. Code inside a custom backward keeps its own line.
            if between == ENGINE or call_site is None:
                stamped = _metadata(node).get(NODE_STAMP)
                if stamped is not None:
                    site, module = stamped
                elif type(node) is ACCUMULATE_GRAD:  # what it makes is the leaf's new .grad
                    self._accumulating.add(len(self._ops))
                    self._facts.accumulating(node)
        else:
            node_name = None
            if between == ENGINE:
                phase = _BACKWARD
            elif between == OPTIMIZER:
                phase = _OPTIMIZER
            elif grad_enabled or inside_function_forward(caller) or self._in_pack_hook(caller):
                phase = _FORWARD  # grad mode is off inside a custom Function's forward and pack hooks
            else:
                phase = _OTHER
        self._last_phase = phase

        ops = self._ops
        seq = len(ops)
        if seq >= self._seal_at:
            self._seal()
        ops.append(_row(OpRow, (next(self._clock), info.name, phase, site, node_name, module, tuple(inputs))))
        written = self._written_sizes(info, args, kwargs) if info.writes else None
        try:
            out = info.call(*args, **kwargs)
        except BaseException:
            self.trace.failed_op = self.trace.ops[seq]
            raise
        if self._freed:
            self._drain_frees()
        if written:
            self._record_resizes(written, seq, call_site)
        if info.special:
            self._after_special(info, args, kwargs, out, seq, call_site)
        elif info.scalars:
            self._record_scalars(info, args, kwargs, seq)

        # Autograd gives the outputs a node after this returns; it is stamped at the next op. One
        # output is enough: the differentiable outputs of an op share their node. Inside a custom
        # Function's forward grad mode is off, but the Function's node lands on what it returns.
        stamp = grad_enabled or phase is _FORWARD
        if stamp and _user_saved_hooks(False) is not None:
            self._under_user_hooks.add(seq)
        watches, rows = self._watches, self._rows
        for t in (out,) if isinstance(out, _Tensor) else _tensors(out):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                self._new_parts(t, seq, call_site)  # sparse: its index and value tensors
            else:
                key = storage._cdata
                if key not in watches and (nbytes := storage.nbytes()):
                    if type(t) is not _Tensor or t.is_meta:
                        self._new_parts(t, seq, call_site)  # subclass, meta: storages.parts
                    else:
                        try:
                            shape = t.shape
                        except RuntimeError:  # a strided nested tensor has no sizes
                            self._new_parts(t, seq, call_site)
                        else:
                            # a new storage (_new_allocation and _start_watch, inlined)
                            watch = watches[key] = _StorageWatch(storage, self._queue_free)
                            watch.index, watch.key = len(rows), key
                            rows.append(
                                _row(
                                    AllocRow,
                                    (seq, nbytes, t.dtype, shape, t.device, next(self._clock), call_site),
                                )
                            )
            if stamp and (t.is_floating_point() or t.is_complex()):
                self._pending = (weakref.ref(t), seq, info.saves)
                stamp = False
        return out

    def _watch_inputs(self, values: Any, inputs: list[int]) -> None:
        """Start watching input storages not seen before, and add every input's row to ``inputs``
        (the general, slower path)."""
        watches = self._watches
        for t in _tensors(values):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                for part, part_storage in storages.parts(t):  # sparse: its index and value tensors
                    watch = watches.get(part_storage._cdata)
                    inputs.append((watch or self._watch_one_preexisting(part, part_storage)).index)
                continue
            watch = watches.get(storage._cdata)
            if watch is not None:
                inputs.append(watch.index)
            else:
                inputs += self._watch_preexisting(t, storage)

    def _accumulate_grad(self, node: Any, gradient: Any) -> None:
        """A detach under an AccumulateGrad node. Run by the engine itself (no Python frame between),
        it steals the incoming gradient as the leaf's .grad; one called from a hook on the leaf (an
        optimizer stepping in backward) is not a gradient."""
        try:
            caller = _getframe(2)  # __torch_dispatch__'s caller
        except ValueError:  # no Python frame at all: an autograd device thread
            caller = None
        if caller is None or caller.f_code is _ENGINE_RUN:
            self._facts.accumulated(node, gradient)

    def _after_special(
        self, info: _OpInfo, args: Any, kwargs: Any, out: Any, seq: int, call_site: Site | None
    ) -> None:
        if info.lifts:
            self._record_lifted(out, seq, call_site)
        if info.after is not None:
            self._call_site = call_site
            # reading what a collective's buffers are must never break the program
            with contextlib.suppress(Exception):
                info.after(self, args, kwargs, out, seq)

    def _record_scalars(self, info: _OpInfo, args: Any, kwargs: Any, seq: int) -> None:
        """Keep the finite Python numbers among the op's arguments, by argument name (a bool, a
        symbolic number or a non-finite one is not kept: a rule then sees no value and stays silent)."""
        # on the per-op path of every add and mul: a tensor-tensor call costs one type check per argument
        found = None
        for i, value in enumerate(args):
            kind = type(value)
            if kind is float or kind is int:
                names = info.arg_names
                found = found or []
                found.append((names[i] if i < len(names) else str(i), value))
        for name, value in kwargs.items() if kwargs else ():
            kind = type(value)
            if kind is float or kind is int:
                found = found or []
                found.append((name, value))
        if found is None:
            return
        kept = []
        for name, value in found:
            try:
                number = float(value)
            except OverflowError:  # an int Python cannot make a float of must never break the program
                continue
            if math.isfinite(number):
                kept.append((name, number))
        if kept:
            self.trace.scalars[seq] = tuple(kept)

    def _record_lifted(self, out: Any, seq: int, call_site: Site | None) -> None:
        # lift_fresh returns its input; under FakeTensorMode, the input's fake twin: the output is what
        # the program goes on using in both
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage._cdata not in self._watches and storage.nbytes():
                self._start_watch(storage, self._new_allocation(t, storage.nbytes(), seq, call_site))

    def _new_allocation(self, t: torch.Tensor, nbytes: int, seq: int, call_site: Site | None) -> int:
        rows = self._rows
        shape = t.shape if not t.is_nested else storages.row_shape(t, t.untyped_storage())
        rows.append(_row(AllocRow, (seq, nbytes, t.dtype, shape, t.device, next(self._clock), call_site)))
        return len(rows) - 1

    def _new_parts(self, t: torch.Tensor, seq: int, call_site: Site | None) -> None:
        """Record the new storages of an output that is not a plain dense tensor (storages.parts)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            storage = None
        if storage is not None and storage._cdata in self._no_memory:
            return
        parts = storages.parts(t)
        if storage is not None and not any(s._cdata == storage._cdata for _, s in parts):
            self._hold_no_memory(storage)  # a wrapper's or meta placeholder: never looked at again
        for part, part_storage in parts:
            key = part_storage._cdata
            if key not in self._watches and (nbytes := part_storage.nbytes()):
                rows = self._rows
                shape = storages.row_shape(part, part_storage)
                rows.append(
                    _row(
                        AllocRow, (seq, nbytes, part.dtype, shape, part.device, next(self._clock), call_site)
                    )
                )
                self._start_watch(part_storage, len(rows) - 1)

    def _hold_no_memory(self, storage: Any) -> None:
        key = storage._cdata
        # the callback, dict.pop with a default, is C code: no Ctrl-C can land in it
        self._no_memory[key] = weakref.ref(storage, functools.partial(self._no_memory.pop, key))

    def _watch_preexisting(self, t: torch.Tensor, storage: Any) -> list[int]:
        """Watch an input's storage not seen before as one from before the region; the rows of what
        holds its memory (its parts for a subclass or nested tensor, none for a meta tensor)."""
        kind = type(t)
        if kind is _Parameter and not t.is_meta and not t.is_nested and storages.holds_data(storage):
            # a parameter of a plain tensor, as most are: its storage is its memory (every parameter
            # comes here once per region, so it skips storages.parts' general search)
            return [self._watch_one_preexisting(t, storage).index]
        if kind is not _Tensor or t.is_meta or t.is_nested:
            # a parameter, a subclass (a DTensor parameter is of type DTensor), meta, nested: what
            # holds its memory (an FSDP parameter's storage may be resized to nothing)
            if storage._cdata in self._no_memory:
                return []
            parts = storages.parts(t)
            if not any(s._cdata == storage._cdata for _, s in parts):
                self._hold_no_memory(storage)
            watches, found = self._watches, []
            for part, part_storage in parts:
                watch = watches.get(part_storage._cdata) or self._watch_one_preexisting(part, part_storage)
                found.append(watch.index)
            return found
        return [self._watch_one_preexisting(t, storage).index]

    def _watch_one_preexisting(self, t: torch.Tensor, storage: Any) -> _StorageWatch:
        if self._unseen and (claimed := self._claim_unseen(t, storage)) is not None:
            return claimed
        rows = self._rows
        shape = storages.row_shape(t, storage)
        rows.append(_row(AllocRow, (-1, storage.nbytes(), t.dtype, shape, t.device, -1, None)))
        watch = self._start_watch(storage, len(rows) - 1)
        self._facts.preexisting(t, watch.index)
        if self._fake_mode is not None:
            self._watch_fake_twin(t, watch.index)
        return watch

    def _watch_fake_twin(self, t: torch.Tensor, index: int) -> None:
        """Under FakeTensorMode, a real tensor from before the region is used through a fake twin
        that the mode's converter makes and memoises while the twin lives. Held here until the end,
        every op gets the same twin, whose storage is the real one's memory, not a new allocation."""
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return
        mode = self._fake_mode
        try:
            twin = mode.fake_tensor_converter.from_real_tensor(mode, t)
            storage = twin.untyped_storage()
        except Exception:
            return  # a tensor the mode cannot convert: the op itself will say so
        self._twins.append(twin)
        if storage._cdata not in self._watches:
            # no free callback: the twin lives until the end, and the real storage's free counts
            watch = _StorageWatch(storage)
            watch.index, watch.key = index, storage._cdata
            self._watches[watch.key] = watch

    def _start_watch(self, storage: Any, index: int) -> _StorageWatch:
        watch = _StorageWatch(storage, self._queue_free)
        watch.index = index
        watch.key = storage._cdata
        self._watches[watch.key] = watch
        return watch

    def _seal(self) -> None:
        """Pack all but the latest rows (memtrim.trace.packed): a long run's recording stays small."""
        # A seal makes thousands of short-lived tuples: with the collector running, they would set
        # off collections that walk the whole heap (the program's and the recording's).
        with collector_paused():
            self.trace.ops.seal(len(self._ops) - KEEP_RECENT)
            self._recorded.seal(len(self._rows) - KEEP_RECENT)
        self._accumulated.extend(self._accumulating)
        self._accumulating.clear()
        self._seal_at = len(self._ops) + SEAL_EVERY

    def tick(self) -> int:
        """A tick of this recorder's clock for an event of its own (a region's start or end), after the
        frees queued so far: a tensor dropped before the event is freed before it."""
        if self._freed:
            self._drain_frees()
        return next(self._clock)

    def _drain_frees(self) -> None:
        """Tick the frees queued since the last op, in the order they happened."""
        freed, frees, watches = self._freed, self._frees, self._watches
        clock, phase = self._clock, self._last_phase
        done = len(freed)  # (another thread may append meanwhile: that one is ticked next time)
        for i in range(done):
            watch = freed[i]
            frees[watch.index] = _row(FreeRow, (next(clock), phase))
            if watches.get(watch.key) is watch:
                del watches[watch.key]
        del freed[:done]

    # -- resize_ and out= -------------------------------------------------------------------------
    def _written_sizes(self, info: _OpInfo, args: Any, kwargs: Any) -> list[tuple[torch.Tensor, int, int]]:
        """(tensor, its storage's key, its bytes) for each tensor the op writes, before it runs."""
        written = [args[i] for i in info.written_args if i < len(args)]
        written += [kwargs[name] for name in info.written_kwargs if name in kwargs]
        sizes = []
        for t in written:
            for tensor in _tensors(t):
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                key = storage._cdata
                if key not in self._no_memory:  # meta, wrappers: known by now, as inputs are watched
                    sizes.append((tensor, key, storage.nbytes()))
        return sizes

    def _record_resizes(
        self, written: list[tuple[torch.Tensor, int, int]], seq: int, call_site: Site | None
    ) -> None:
        for t, key, before in written:
            storage = t.untyped_storage()
            if storage._cdata != key:
                # set_: the tensor now views another storage, which the op did not allocate; one not
                # seen before existed before the region (set_ onto a storage object, say)
                if storage._cdata not in self._watches and storage.nbytes():
                    self._watch_preexisting(t, storage)
                continue
            after = storage.nbytes()
            if after == before:
                continue
            # The allocator hands out a new block and frees the old one; the StorageImpl stays.
            self._resized(storage, t, before, after, seq, self.trace.ops.row(seq).phase, call_site)

    def _resized(
        self,
        storage: Any,
        t: torch.Tensor | None,
        before: int,
        after: int,
        seq: int,
        phase: Phase,
        call_site: Site | None,
    ) -> None:
        """A storage's block went from ``before`` to ``after`` bytes: a new block is allocated, then the
        old one freed, as the allocator does (a storage not watched yet existed before the region); a
        storage resized to 0 holds nothing until it grows again."""
        key = storage._cdata
        watch = self._watches.get(key)
        if watch is None and before:
            rows = self._rows
            rows.append(_row(AllocRow, (-1, before, torch.uint8, (before,), storage.device, -1, None)))
            self._start_watch(storage, len(rows) - 1)
            watch = self._watches[key]
        old = None if watch is None else watch.index
        if after:
            rows = self._rows
            if t is None:
                row = (seq, after, torch.uint8, (after,), storage.device, next(self._clock), call_site)
                rows.append(_row(AllocRow, row))
                new = len(rows) - 1
            else:
                new = self._new_allocation(t, after, seq, call_site)
            if watch is None:
                self._start_watch(storage, new)
            else:
                watch.index = new
        elif watch is not None:
            del self._watches[key]  # drops the weak reference: no second free
        if old is not None:
            self._frees[old] = FreeRow(next(self._clock), phase)

    # -- torch.distributed (memtrim.capture.distributed's hooks call these) -----------------------
    def tag_storage(self, t: torch.Tensor, fact: Fact) -> None:
        self._facts.tag(t, fact)

    def phase_of(self, seq: int) -> Phase:
        phase: Phase = self.trace.ops.row(seq).phase
        return phase

    def describe(self, t: torch.Tensor) -> None:
        """``t`` views a storage that a ``resize_`` allocated (known then only as bytes, and under fake
        mode on the meta device): its row takes ``t``'s dtype, shape and device."""
        watch = self._watches.get(t.untyped_storage()._cdata)
        if watch is None or (row := self._recorded.row(watch.index)).seq < 0:
            return
        if row.dtype is torch.uint8 and row.shape == (row.bytes,) and t.nbytes == row.bytes:
            self._rows[watch.index] = row._replace(dtype=t.dtype, shape=t.shape, device=t.device)

    def made_unseen(
        self, like: torch.Tensor, fact: Fact, seq: int, held_by: torch.Tensor | None = None
    ) -> None:
        """A block shaped like ``like`` that the op made where no mode sees it; its storage is claimed
        when first seen, so that its free is observed. ``held_by``: a functional collective's output
        whose wait frees it (its storage is never seen): freed when that output is waited on."""
        nbytes = like.untyped_storage().nbytes()
        index = self._new_allocation(like, nbytes, seq, self._call_site)
        self._recorded.add_fact(index, fact)
        if held_by is None:
            self._unseen.append((nbytes, like.dtype, like.device, index))
        else:
            self._until_wait.setdefault(held_by.untyped_storage()._cdata, []).append(index)

    def waited(self, t: torch.Tensor, seq: int) -> None:
        """A functional collective's output ``t`` was waited on: the blocks its work held are freed."""
        rows = self._until_wait.pop(t.untyped_storage()._cdata, ())
        for index in rows:
            self._frees[index] = FreeRow(next(self._clock), self.trace.ops.row(seq).phase)

    def _claim_unseen(self, t: torch.Tensor, storage: Any) -> _StorageWatch | None:
        nbytes = storage.nbytes()
        for i, (size, dtype, device, index) in enumerate(self._unseen):
            if size == nbytes and dtype == t.dtype and device == t.device:
                del self._unseen[i]
                return self._start_watch(storage, index)
        return None

    def record_outputs(self, out: Any, seq: int) -> None:
        """Record ``out``'s new storages now (the op's facts are about to be added to them)."""
        for t in _tensors(out):
            if type(t) is not _Tensor and not self.trace.fake:
                continue
            storage = t.untyped_storage()
            if storage._cdata not in self._watches and (nbytes := storage.nbytes()):
                self._start_watch(storage, self._new_allocation(t, nbytes, seq, self._call_site))

    # -- autograd -------------------------------------------------------------------------------
    def _stamp_node(self, ref: weakref.ref[torch.Tensor], seq: int, marks_saved: bool) -> None:
        """Stamp the node that the last op's output got with that op's site, and mark what the node
        saved for backward.

        Called at the next op (autograd makes a node after the op's dispatch returns). What a node
        saved is read from the node itself (``_saved_self``, ``saved_tensors``...), not through
        saved-tensor hooks: hooks cost a Python call per saved tensor and, under a dispatch mode, a
        detach per unpack, and they change what autograd holds. Nodes made while the user's own
        saved-tensor hooks were active are not read: unpacking would run those hooks (a checkpoint's
        unpack recomputes the forward).
        """
        t = ref()
        node = None if t is None else t.grad_fn
        if node is None:
            return
        metadata = _metadata(node)
        if NODE_STAMP not in metadata:
            row = self._ops[seq] or self.trace.ops.row(seq)  # (None: packed)
            metadata[NODE_STAMP] = (row.site, row.module)
            # (a custom Function that returns a view of what it made gets its node on that view)
            if (marks_saved or isinstance(node, _CustomFunctionNode)) and seq not in self._under_user_hooks:
                self._mark_saved(node)

    def _read_wrapper_nodes(self, args: Any, kwargs: dict[str, Any]) -> None:
        """Mark what autograd saved for the ops that made a wrapper subclass op's inputs (a DTensor's
        ``mm`` saves its DTensor operands: their local tensors are what is held).

        Such a node lands on the wrapper the op returned, which no mode sees (the op ran on local
        tensors, below autograd): it is read when that wrapper is handed to the next wrapper op. Not
        while the user's saved-tensor hooks are active, nor for a node whose local tensors were made
        under them: unpacking would run those hooks (a checkpoint's unpack recomputes the forward).
        """
        if not _is_grad_enabled() or _user_saved_hooks(False) is not None:
            return
        for t in _tensors((*args, *kwargs.values()) if kwargs else args):
            if type(t) is _Tensor or (node := t.grad_fn) is None:
                continue
            metadata = _metadata(node)
            if WRAPPER_READ in metadata or NODE_STAMP in metadata:
                continue
            metadata[WRAPPER_READ] = True
            made = []
            for _part, storage in storages.parts(t):
                watch = self._watches.get(storage._cdata)
                if watch is None:
                    break
                made.append(self._recorded.row(watch.index).seq)
            else:
                if made and not self._under_user_hooks.intersection(made):
                    self._mark_saved(node)

    def _mark_saved(self, node: Any) -> None:
        try:
            values = (_saved_getters.get(type(node)) or saved_getter(node))(node)
        except Exception:
            # Released already (backward ran without retain_graph), or a node kind that cannot be
            # read: reading is best effort and must never break the program being tracked.
            return
        watches, saved = self._watches, self._recorded.saved  # pre-region storages: ignored when read
        try:
            for value in values:
                if isinstance(value, _Tensor):
                    watch = watches.get(value.untyped_storage()._cdata)
                    if watch is not None:
                        saved.add(watch.index)
                    elif type(value) is not _Tensor:  # a subclass: its inner tensors
                        self._mark_saved_tensors([part for part, _ in storages.parts(value)])
                elif value:  # a list of tensors (and Nones)
                    self._mark_saved_tensors(value)
        except (RuntimeError, NotImplementedError, TypeError):
            # sparse/nested/opaque tensors have no single storage: mark what can be
            self._mark_saved_tensors(values)

    def _mark_saved_tensors(self, values: Any) -> None:
        for t in _tensors(values):
            try:
                watch = self._watches.get(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError, TypeError):
                self._mark_saved_tensors([part for part, _ in storages.parts(t)])  # sparse
                continue
            if watch is not None:
                self._recorded.saved.add(watch.index)

    def _in_pack_hook(self, caller: Any) -> bool:
        """True inside the pack hook of the user's saved-tensor hooks (which autograd runs with grad
        mode off, while it saves a forward op's tensor): what it makes is kept for backward."""
        hooks = _user_saved_hooks(False)
        if hooks is None:
            return False
        code = getattr(hooks[0], "__code__", None)
        return code is not None and runs_code(caller, code)

    # -- lifetime -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Stop observing. Storages still watched are what was alive at the end (or at the failure)."""
        if not self._open and self.trace.finished:
            return
        if self._freed:
            self._drain_frees()
        if (pending := self._pending) is not None:
            self._pending = None
            self._stamp_node(*pending)
        with contextlib.suppress(Exception):  # FSDP's private state is read best effort
            for t, fact in distributed.fsdp_facts(modules_seen()):
                self._facts.tag(t, fact)
        self._facts.finish(modules_with_buffers())
        self._facts.remove()
        rename_roots(self.trace.ops)  # model.encoder(...) and model.decoder(...): paths from model
        self._open = False
        if accumulating := self._accumulating.union(self._accumulated):
            recorded = self._recorded
            for index, seq in enumerate(recorded.seqs()):
                if seq in accumulating:
                    recorded.add_fact(index, Fact.GRADIENT)
        # What autograd saved under the user's own saved-tensor hooks could not be read from the
        # nodes: fall back to lifetime (autograd frees what it saved as backward consumes it).
        if under_hooks := self._under_user_hooks:
            recorded = self._recorded
            for index, row in enumerate(recorded.rows):
                free = recorded.frees.get(index)
                if row.seq in under_hooks and free is not None and free.phase is _BACKWARD:
                    recorded.saved.add(index)
        self.trace.end_tick = next(self._clock)
        self._watches.clear()
        self._twins.clear()
        self.trace.finished = True

    # -- outside the dispatcher -----------------------------------------------------------------
    def storage_resized(self, storage: Any, before: int, after: int) -> None:
        """``UntypedStorage.resize_`` ran (memtrim.capture.outside): FSDP's free and re-allocation."""
        if not self._open or (storage.device.type == "meta" and not self.trace.fake):
            return  # (a fake tensor's storage is a meta storage that stands for the real one's block)
        seq, phase, call_site = self._outside_op("UntypedStorage.resize_")
        self._resized(storage, None, before, after, seq, phase, call_site)

    def tensor_made(self, tensor: torch.Tensor, name: str) -> None:
        """A tensor made below the dispatcher (``torch.get_rng_state``): a new allocation."""
        if not self._open or type(tensor) is not _Tensor:
            return
        if self._freed:  # a storage freed since the last op may have left its key to this new one
            self._drain_frees()
        storage = tensor.untyped_storage()
        if storage._cdata in self._watches or not storage.nbytes():
            return
        seq, _, call_site = self._outside_op(name)
        self._start_watch(storage, self._new_allocation(tensor, storage.nbytes(), seq, call_site))

    def _outside_op(self, name: str) -> tuple[int, Phase, Site | None]:
        """Log a call that did not pass through the dispatcher as an op; the phase and site follow
        the same rules as ``__torch_dispatch__``'s (inlined there)."""
        if self._freed:
            self._drain_frees()
        if (pending := self._pending) is not None:
            self._pending = None
            self._stamp_node(*pending)
        caller = _getframe(2)
        call_site, between, module = user_site(caller)
        node = _current_autograd_node()
        site, node_name = call_site, None
        if node is not None:
            phase, node_name = _BACKWARD, node.name()
            if between == ENGINE or call_site is None:
                site, module = _metadata(node).get(NODE_STAMP) or (site, module)
        elif between == ENGINE:
            phase = _BACKWARD
        elif between == OPTIMIZER:
            phase = _OPTIMIZER
        elif _is_grad_enabled() or inside_function_forward(caller):
            phase = _FORWARD
        else:
            phase = _OTHER
        self._last_phase = phase
        ops = self._ops
        ops.append(_row(OpRow, (next(self._clock), name, phase, site, node_name, module, ())))
        return len(ops) - 1, phase, call_site

    def set_recording(self, on: bool) -> None:
        """Record from now on, or not (memtrim.capture.steps: outside the chosen steps)."""
        self._open = on
        self._facts.recording = on  # no storage watched outside the window (a parameter made there)

    def forked(self) -> None:
        """In a forked child: the parent's recording is not this process's; stop and leave the stack."""
        self._open = False
        self._pending = None
        self._watches.clear()
        self._freed.clear()
        super().forked()
