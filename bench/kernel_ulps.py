"""How far PyTorch's own erf and GELU kernels err, on each of torch's CPU vector paths, next to the budget
memtrim.verify gives erf (8 ulps of 1: 16 units of roundoff, absolute; see
memtrim/verify/magnitude_rules/functions.py).

    python bench/kernel_ulps.py

Each path runs in its own process (ATEN_CPU_CAPABILITY=avx512|avx2|default; a CPU without a path runs the
best it has). Errors are against float64 on 2,000,001 points of [-5, 5], in units of fp32 roundoff u:
torch.erf relative to its value; F.gelu and gelu_backward as the absolute error of the erf inside them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

U = 2.0**-24
BUDGET = 16  # 2 * FUNCTION_ULPS["erf"] units of roundoff, absolute


def measure() -> dict[str, float]:
    x = torch.linspace(-5, 5, 2_000_001)
    xd = x.double()
    erf = torch.erf(xd / math.sqrt(2))
    erf_err = (torch.erf(x).double() - torch.erf(xd)).abs() / (torch.erf(xd).abs().clamp_min(1e-30) * U)
    gelu_err = (F.gelu(x).double() - F.gelu(xd)).abs() - 2 * U * F.gelu(xd).abs()  # less the final roundings
    inside = (gelu_err.clamp_min(0) / (0.5 * xd.abs() * U))[xd.abs() > 0.25]
    ones = torch.ones_like(x)
    gelu_backward = torch.ops.aten.gelu_backward
    back = (gelu_backward(ones, x).double() - gelu_backward(ones.double(), xd)).abs()
    pdf = xd.abs() * torch.exp(-0.5 * xd * xd) / math.sqrt(2 * math.pi)
    back_u = back / ((0.5 * (1 + erf.abs()) + pdf) * U)
    return {
        "torch.erf (u of its value)": float(erf_err[torch.erf(xd).abs() > 1e-6].max()),
        "erf inside F.gelu (u, absolute)": float(inside.max()),
        "erf inside gelu_backward (u, absolute)": float(back_u.max()),
    }


def main() -> None:
    if os.environ.get("_KERNEL_ULPS_CHILD"):
        print(json.dumps(measure()))
        return
    print(f"torch {torch.__version__}; verify's erf budget: {BUDGET} u absolute")
    for path in ("avx512", "avx2", "default"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": path, "_KERNEL_ULPS_CHILD": "1"}
        out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=True)
        for name, value in json.loads(out.stdout).items():
            print(f"  {path:8s} {name:40s} {value:6.2f}   {value / BUDGET:.2f} of the budget")


if __name__ == "__main__":
    main()
