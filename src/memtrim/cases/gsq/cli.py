"""``python -m memtrim.cases.gsq`` / ``memtrim demo gsq``: run the small quantization and print results."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from .function import VARIANTS
from .train import TrainConfig, run

__all__ = ["main"]

_CHOICES = {
    "optimizer": ["lion", "adam"],
    "scale_init": ["mse", "minmax"],
    "logits_dtype": ["float32", "bfloat16"],
    "backward": list(VARIANTS),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m memtrim.cases.gsq",
        description="Quantize a small random MLP block to 2 bits with GSQ (Gumbel-softmax) and compare with "
        "round-to-nearest. Runs data parallel under torchrun (gloo).",
    )
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        default = getattr(defaults, f.name)
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=float if f.name == "lr" else type(default),
            choices=_CHOICES.get(f.name),
            default=default,
            help="default: 1e-3 for lion, 1e-2 for adam" if f.name == "lr" else f"default: {default}",
        )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--export", metavar="PATH", help="save the packed 2-bit codes and scales (torch.save)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    try:
        summary = run(cfg, export=args.export)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank has the same summary
        if args.json:
            print(json.dumps(summary, sort_keys=True))
        else:
            _print_summary(summary)
    return 0


def _print_summary(s: dict[str, object]) -> None:
    cfg = s["config"]
    assert isinstance(cfg, dict)
    print(
        f"GSQ 2-bit, MLP block {cfg['hidden']}x{cfg['intermediate']}, group {cfg['group_size']}, "
        f"{cfg['steps']} steps ({cfg['optimizer']}), {s['world_size']} process(es), {s['seconds']} s"
    )
    print(
        "  block-output MSE   calibration      held-out     "
        f"(target mean square {s['target_mean_square']:.4g})"
    )
    print(f"  GSQ hard 2-bit     {s['hard_mse']:<16.6g} {s['heldout_hard_mse']:.6g}")
    print(f"  RTN 2-bit          {s['rtn_mse']:<16.6g} {s['heldout_rtn_mse']:.6g}")
    print(f"  hard weights sha256 {s['hard_weights_sha256'][:16]}…")  # type: ignore[index]
