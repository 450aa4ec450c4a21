"""Seed case: GSQ's 2-bit Gumbel-softmax quantizer and the seed PR's lean, bit-identical backward."""

from __future__ import annotations

from .cli import main
from .function import CODES, VARIANTS, GumbelSoftmax2Bit, gumbel_soft_weight
from .module import GumbelQuantizer2Bit, pack_2bit, unpack_2bit
from .optim import Lion
from .scales import minmax_scales, mse_scales, rtn_2bit
from .train import TrainConfig, run

__all__ = [
    "CODES",
    "VARIANTS",
    "GumbelQuantizer2Bit",
    "GumbelSoftmax2Bit",
    "Lion",
    "TrainConfig",
    "gumbel_soft_weight",
    "main",
    "minmax_scales",
    "mse_scales",
    "pack_2bit",
    "rtn_2bit",
    "run",
    "unpack_2bit",
]
