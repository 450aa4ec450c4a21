"""``fsdp-reshard-after-forward`` on a transformers Llama trained with FSDP2 on 2 gloo ranks: each
probe's setting and its fix, measured under torch.profiler and memtrim at once.

``LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
num_key_value_heads=2, vocab_size=1000)``, random weights (nothing downloaded), batch 2 x 16 tokens, the
loss from ``labels=``, plain SGD; each decoder layer ``fully_shard``ed, then the root. A warm step (the
second) is measured on each rank (``tests/distributed_programs.measure_settled``: again while gloo's
worker thread moved a collective buffer's free). Prints, per probe and rank: whether the rule fired, the
modules it named, its predicted peak after the fix, and the peak torch.profiler measured with the fix
applied; and whether ``all-gather-saved-for-backward`` fired (it must never on FSDP2's bytes).

    python bench/doctor_fsdp.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import distributed_programs as dp

from memtrim.doctor.rules.common import module_expression

WORLD = 2
RULE, GATHER_RULE = "fsdp-reshard-after-forward", "all-gather-saved-for-backward"

LOSS_OUTSIDE = {"outside": True}
"""The loss computed outside the model on 8 x 64 tokens (the root's forward ends before it), instead
of from ``labels=`` on 2 x 16 tokens."""
PROBES: list[tuple[str, dict[str, Any]]] = [  # layers: each decoder layer's reshard_after_forward
    ("1 all layers False", {"layers": (False, False)}),
    ("1b same, loss outside", {"layers": (False, False), **LOSS_OUTSIDE}),
    ("2 layer 0 False only", {"layers": (False, True)}),
    ("2b same, loss outside", {"layers": (False, True), **LOSS_OUTSIDE}),
    ("3 all True (root default)", {"layers": (True, True)}),
    ("3b same, loss outside", {"layers": (True, True), **LOSS_OUTSIDE}),
    ("4 root alone, default", {"layers": None}),
    ("4b same, loss outside", {"layers": None, **LOSS_OUTSIDE}),
    ("5 int 1 (= False on 2 ranks)", {"layers": (1, 1)}),
    ("5 int 2 (= True on 2 ranks)", {"layers": (2, 2)}),
    ("6 set_reshard_after_backward(False)", {"layers": (True, True), "after_backward": False}),
    ("7 bf16 params, layers False", {"layers": (False, False), "bf16": True}),
    ("7b same, loss outside", {"layers": (False, False), "bf16": True, **LOSS_OUTSIDE}),
    ("8 checkpointed layers, False", {"layers": (False, False), "checkpoint": True}),
    ("8b same, loss outside", {"layers": (False, False), "checkpoint": True, **LOSS_OUTSIDE}),
]


def fixed_setting(setting: dict[str, Any], modules: list[str] | None) -> dict[str, Any]:
    """``setting`` with ``reshard_after_forward=True`` for the modules a finding named (``modules``;
    None where the rule was silent: every layer and the root, and FSDP2's default after backward, to
    measure what a silent rule would have left)."""
    fixed = {k: v for k, v in setting.items() if k != "after_backward" or modules is not None}
    layers = setting["layers"]
    if layers is not None:
        named = {int(m.rsplit(".", 1)[1]) for m in modules or () if ".layers." in m}
        fixed["layers"] = tuple(True if modules is None or i in named else r for i, r in enumerate(layers))
    if modules is None or any("." not in m for m in modules):
        fixed["root"] = True
    return fixed


def llama_run(rank: int, setting: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    model = LlamaForCausalLM(config)
    if setting.get("checkpoint"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs: dict[str, Any] = {}
    if setting.get("bf16"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if setting["layers"] is not None:
        for layer, reshard in zip(model.model.layers, setting["layers"], strict=True):
            fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=setting.get("root"), **kwargs)
    if setting.get("after_backward") is False:
        model.set_reshard_after_backward(False)  # type: ignore[operator]
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outside = bool(setting.get("outside"))
    shape = (8, 64) if outside else (2, 16)
    ids = torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        if outside:
            logits = model(input_ids=ids).logits
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    step()
    optimizer.zero_grad()
    result = dp.measure_settled(step, before=optimizer.zero_grad)
    trace = result.pop("trace")
    found = dp.diagnoses(trace)
    for d, diagnosis in zip(found, trace.diagnoses(), strict=True):
        d["modules"] = list(dict.fromkeys(a.module for a in diagnosis.allocations))
    unsharded = [a for a in trace.allocations if str(trace.role(a)) == "unsharded_parameter"]
    return {
        "memtrim_peak": result["memtrim_peak"],
        "profiler_peak": result["profiler_peak"],
        "settled": result["memtrim_deltas"] == result["profiler_deltas"],
        "attempts": result["attempts"],
        "fsdp": [d for d in found if d["rule"] == RULE],
        "gather": [d for d in found if d["rule"] == GATHER_RULE],
        "rules": sorted({d["rule"] for d in found}),
        "peak_phase": str(trace.analysis.peak.phase),
        "unsharded_made": sum(a.bytes for a in unsharded if not a.preexisting),
    }


def ranks_main(rank: int, world: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    dp.init(rank, world, port)
    results = []
    for _, setting in PROBES:
        run = llama_run(rank, setting)
        # the fix as rank 0's finding names it, applied on every rank (their collectives must agree)
        named = [run["fsdp"][0]["modules"] if run["fsdp"] else None]
        torch.distributed.broadcast_object_list(named, src=0)
        results.append({"run": run, "fixed": llama_run(rank, fixed_setting(setting, named[0]))})
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(ranks_main, args=(WORLD, dp.free_port(), out), nprocs=WORLD, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    if os.environ.get("DOCTOR_FSDP_JSON"):
        Path(os.environ["DOCTOR_FSDP_JSON"]).write_text(json.dumps(ranks))
    print(f"{'probe':37} {'rank':>4} {'peak':>9}  {'fires':5} {'predicted':>9} {'measured':>9}  verdict")
    for n, (probe, _) in enumerate(PROBES):
        for rank, results in enumerate(ranks):
            run, fixed = results[n]["run"], results[n]["fixed"]
            findings = run["fsdp"]
            predicted = str(findings[0]["peak_after"]) if findings else "-"
            verdict = _verdict(run, fixed, findings)
            if run["gather"] or fixed["gather"]:
                verdict += "; all-gather-saved-for-backward FIRED"
            print(
                f"{probe:37} {rank:>4} {run['profiler_peak']:>9}  {'yes' if findings else 'no':5} "
                f"{predicted:>9} {fixed['profiler_peak']:>9}  {verdict}"
            )
            for d in findings if rank == 0 else ():
                print(f"{'':42}named: {', '.join(module_expression(m) or m for m in d['modules'])}")


def _verdict(run: dict[str, Any], fixed: dict[str, Any], findings: list[dict[str, Any]]) -> str:
    """Silent: right where the fix (every layer and the root resharded) saves under 1% of the peak.
    Fires: right where the predicted drop is within 10% of the measured one (fixed as named)."""
    unsettled = "" if run["settled"] and fixed["settled"] else " (gloo moved a free)"
    peak = run["profiler_peak"]
    measured = peak - fixed["profiler_peak"]
    if not findings:
        if measured > 0.01 * peak:
            return f"missed: the fix saves {measured} B" + unsettled
        return f"right: silent (the fix saves {measured} B)" + unsettled
    predicted = findings[0]["peak_before"] - findings[0]["peak_after"]
    if measured <= 0:
        return f"WRONG: the fix saves nothing ({measured} B)" + unsettled
    off = abs(predicted - measured) / measured
    return f"{'right' if off <= 0.10 else 'WRONG'}: drop {predicted} predicted ({off:.1%} off)" + unsettled


if __name__ == "__main__":
    main()
