"""``checkpoint_modules(model, patterns)``: activation checkpointing on the modules you name.

Each matching module's ``forward`` runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
while grad mode is on: its activations are freed after forward and recomputed, one module at a time, in
backward. Results and gradients stay bit-for-bit those of the unwrapped model (same ops in the same order,
RNG state replayed for dropout); the cost is one more forward of each wrapped module.

A module that updates its buffers in its forward (BatchNorm in training mode: ``running_mean``,
``running_var``, ``num_batches_tracked``; anything that writes a buffer in place) would update them a second
time when backward recomputes it — plain ``torch.utils.checkpoint`` does. Here the recompute runs inside a
context that copies those buffers first and writes the copies back after it, so after each step they hold
what the unwrapped model leaves (the cost: one copy of those buffers while a module is recomputed).

A transformers model would hand its blocks a KV cache, which a recompute would append to a second time:
while the handle lives, ``config.use_cache`` is False on every config the model's modules hold (as
transformers' own ``gradient_checkpointing_enable`` does in training; the loss and gradients do not
depend on it); ``undo()`` puts it back. A cache passed explicitly still raises, with the fix.

Patterns match the qualified names of ``model.named_modules()`` as globs over dotted names: ``*``
matches one name (no dot; the model itself is named ``""`` and matches only ``""``), ``**`` any number
of names, ``?`` one character, ``[...]`` a set. ``"transformer.h.*"`` matches GPT-2's blocks
``transformer.h.0`` ... but not ``transformer.h.0.attn``; Llama's are ``"model.layers.*"``. A compiled
``re.Pattern`` is matched with ``fullmatch`` instead. Only the outermost match is wrapped: a module
inside a wrapped one is recomputed with it already.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

Pattern = str | re.Pattern[str]
_INNER = "_memtrim_checkpoint_inner"
"""Attribute holding a forward the instance had of its own before wrapping (another library's hook)."""


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """The regex a dotted-name glob means here (``*``: one name, ``**``: any number of names).

    >>> bool(glob_to_regex("transformer.h.*").fullmatch("transformer.h.11"))
    True
    >>> bool(glob_to_regex("transformer.h.*").fullmatch("transformer.h.11.attn"))
    False
    >>> bool(glob_to_regex("**.mlp").fullmatch("model.layers.3.mlp"))
    True
    """
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if pattern.startswith("**.", i):  # any number of leading names, including none
            out.append(r"(?:[^.]+\.)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif ch == "*":  # one name: never empty, so "*" does not match the root module ("")
            out.append(r"[^.]+")
            i += 1
        elif ch == "?":
            out.append(r"[^.]")
            i += 1
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f"unclosed '[' in pattern {pattern!r}")
            body = pattern[i + 1 : end]
            out.append(
                "[^" + re.escape(body[1:]) + "]" if body.startswith("!") else "[" + re.escape(body) + "]"
            )
            i = end + 1
        else:
            out.append(re.escape(ch))
            i += 1
    return re.compile("".join(out))


@dataclass
class CheckpointHandle:
    """What :func:`checkpoint_modules` wrapped; ``undo()`` (or leaving a ``with`` block) restores them."""

    wrapped: list[str] = field(default_factory=list)
    """Qualified names of the wrapped modules, in ``named_modules()`` order."""
    inside_wrapped: list[str] = field(default_factory=list)
    """Matching modules left alone because a wrapped module contains them."""
    use_cache_disabled: int = 0
    """How many ``config.use_cache`` flags were set to False while the handle lives."""
    _modules: list[nn.Module] = field(default_factory=list, repr=False)
    _previous: list[Any] = field(default_factory=list, repr=False)
    _configs: list[Any] = field(default_factory=list, repr=False)
    _undone: bool = field(default=False, repr=False)

    def undo(self) -> None:
        """Give every wrapped module back the forward it had. Safe to call twice."""
        if self._undone:
            return
        for name, module in zip(self.wrapped, self._modules, strict=True):
            if not _is_wrapped(module):
                raise RuntimeError(
                    f"{name or 'the model'}.forward was replaced after checkpoint_modules wrapped it; "
                    "undo the later wrapper first, then this one (nothing was undone)"
                )
        for module, previous in zip(self._modules, self._previous, strict=True):
            del module.__dict__["forward"]
            module.__dict__.pop(_INNER, None)
            if previous is not None:
                module.forward = previous
        for config in self._configs:
            config.use_cache = True
        self._undone = True

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __len__(self) -> int:
        return len(self.wrapped)


def _is_wrapped(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _checkpointed_forward


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A method bound to the module (not a closure over it), so copy.deepcopy(model) rebinds it to the copy.
    inner = self.__dict__.get(_INNER) or types.MethodType(type(self).forward, self)
    if not torch.is_grad_enabled():  # nothing is saved for backward: checkpointing would only cost time
        return inner(*args, **kwargs)
    cache = _kv_cache_argument(args, kwargs)
    if cache is not None:
        raise RuntimeError(
            f"{type(self).__name__}.forward was passed a KV cache ({cache}): recomputing the module in "
            "backward would append its keys and values to the cache a second time. Call the model with "
            "use_cache=False (or set model.config.use_cache = False) when training with checkpointing"
        )
    restore = _BufferRestore(self)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=restore.contexts, **kwargs)


class _BufferRestore:
    """The buffers a module's forward updates, kept from being updated again by the recompute.

    Which buffers: those of normalization modules that track running statistics in training mode (their
    kernels update ``running_mean``/``running_var`` without bumping the tensor's version counter) and any
    buffer whose version counter moved during the forward (an in-place write)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.buffers = [b for b in module.buffers() if b is not None]
        self.versions = [b._version for b in self.buffers]
        self.updated: list[torch.Tensor] = []

    def contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        return self._forward(), self._recompute()

    @contextlib.contextmanager
    def _forward(self) -> Iterator[None]:
        yield
        moved = {id(b) for b, v in zip(self.buffers, self.versions, strict=True) if b._version != v}
        stats = {
            id(b)
            for m in self.module.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.training and m.track_running_stats
            for b in m.buffers()
            if b is not None
        }
        self.updated = [b for b in self.buffers if id(b) in moved or id(b) in stats]
        self.buffers, self.versions = [], []  # nothing else is needed after the forward

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        with torch.no_grad():
            kept = [b.clone() for b in self.updated]
        try:
            yield
        finally:
            with torch.no_grad():
                for b, value in zip(self.updated, kept, strict=True):
                    b.copy_(value)


def _kv_cache_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name of a transformers-style KV cache among the arguments (duck-typed: ``update`` and
    ``get_seq_length``), or None."""
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None)):
            return f"{where}: {type(value).__name__}"
    return None


def checkpoint_modules(model: nn.Module, patterns: Pattern | Sequence[Pattern]) -> CheckpointHandle:
    """Run the forward of every module whose qualified name matches ``patterns`` under activation
    checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``); returns a handle to undo it.

    ``patterns``: one or more dotted-name globs (``"transformer.h.*"``, ``"model.layers.*"``,
    ``"**.mlp"``; ``*`` matches one name, ``**`` any number) or compiled regexes (``fullmatch``). A pattern
    that matches nothing raises ``ValueError`` listing names that exist.

    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    >>> handle = checkpoint_modules(model, "[02]")
    >>> handle.wrapped
    ['0', '2']
    >>> handle.undo()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    pats = [patterns] if isinstance(patterns, (str, re.Pattern)) else list(patterns)
    if not pats:
        raise ValueError("patterns must name at least one module pattern, e.g. 'transformer.h.*'")
    compiled = []
    for p in pats:
        if isinstance(p, re.Pattern):
            compiled.append((p.pattern, p))
        elif isinstance(p, str):
            compiled.append((p, glob_to_regex(p)))
        else:
            raise TypeError(f"a pattern must be a str (glob) or re.Pattern, not {type(p).__name__}")
    names = [name for name, _ in model.named_modules()]
    for text, rx in compiled:
        if not any(rx.fullmatch(n) for n in names):
            raise ValueError(f"no module name matches {text!r}; {_suggest(model)}")
    handle = CheckpointHandle()
    for name, module in model.named_modules():
        if not any(rx.fullmatch(name) for _, rx in compiled):
            continue
        if any(name == w or name.startswith(w + ".") or w == "" for w in handle.wrapped):
            handle.inside_wrapped.append(name)
            continue
        if _is_wrapped(module):
            handle.undo()
            raise ValueError(f"{name or 'the model'} is already checkpointed; undo the earlier handle first")
        current = module.__dict__.get("forward")
        if current is not None:
            module.__dict__[_INNER] = current
        module.forward = types.MethodType(_checkpointed_forward, module)
        handle.wrapped.append(name)
        handle._modules.append(module)
        handle._previous.append(current)
    for config in {
        id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
    }.values():
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            handle._configs.append(config)
    handle.use_cache_disabled = len(handle._configs)
    return handle


def _suggest(model: nn.Module) -> str:
    """Names worth trying: the children of the model's ModuleLists (its repeated blocks)."""
    lists = [
        f"'{n}.*'" for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and n
    ]
    some = _first([n for n, _ in model.named_modules() if n], 8)
    hint = f"repeated blocks: {', '.join(_first(lists, 4))}; " if lists else ""
    return f"{hint}names look like {', '.join(repr(n) for n in some)} (see model.named_modules())"


def _first(items: Iterable[str], n: int) -> list[str]:
    out: list[str] = []
    for item in items:
        if len(out) == n:
            break
        out.append(item)
    return out
