"""What a device's allocator charges for a request of n bytes: a registry keyed by device type.

The CPU allocator reports the requested size. CUDA's caching allocator rounds every block up to a
multiple of 512 bytes (``kMinBlockSize``), and that rounded size is what
``torch.cuda.max_memory_allocated`` counts. It can charge more when it reuses a cached segment that is
too small to split (at most ~1 MiB extra per block); that depends on allocator history, which a trace
of one region cannot know, so it is left out and said so in the README.
"""

from __future__ import annotations

from collections.abc import Callable

from memtrim.registry import Registry

ChargeRule = Callable[[int], int]

CHARGE_RULES: Registry[str, ChargeRule] = Registry(
    "allocator charge rule", "memtrim.analysis.allocator.CHARGE_RULES.register(device_type)"
)
"""Device type (``"cuda"``) -> bytes charged for a request. Types without a rule are charged exactly."""


@CHARGE_RULES.register("cuda")
def _cuda_block(nbytes: int) -> int:
    if nbytes <= 0:
        return 0
    return -(-nbytes // 512) * 512


def charge_rule(device: str) -> ChargeRule | None:
    """The rule for ``device`` (``"cuda:0"``, ``"cuda"``), or None when it is charged exactly."""
    return CHARGE_RULES.get(device.split(":", 1)[0])


def charged_bytes(nbytes: int, device: str) -> int:
    """Bytes the allocator of ``device`` (e.g. ``"cuda:0"``) charges for ``nbytes``."""
    rule = charge_rule(device)
    return nbytes if rule is None else rule(nbytes)
