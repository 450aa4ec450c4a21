"""memtrim.fit on tiny training programs at two budgets: the plan, predicted vs measured peak, cost, numerics.

Each program is one AdamW training step (forward, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``) after a warm-up step, so the optimizer state exists and the step is a
steady one. Budgets are 70% and 45% of the step's unplanned peak (memtrim's headline: what the step
allocates on top of what existed before it). For each:

- plan: the levers ``memtrim.fit(step, budget)`` chose (or the floor, when none fits);
- predicted: the peak the search replayed on the recording with the plan's levers;
- measured: torch.profiler's CPU allocation events for one step run inside ``memtrim.applied(plan)``
  (every block, also those an op makes and frees inside itself), peak above the step's start;
- cost: the levers' extra work (recompute FLOPs); keeps: the least any lever keeps;
- numerics: the plan's numeric check (``pass`` bit for
  bit for exact levers; ``memtrim.verify.verify_fix`` within its rounding budget for reference ones).

Run: python bench/fit.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import memtrim
from memtrim.units import format_bytes

BUDGETS = (0.70, 0.45)
Step = Callable[[], None]


def profiled_peak(step: Step) -> int:
    """Peak bytes above the start of ``step`` from torch.profiler's CPU allocation events."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            continue
        stack.extend(node.children)
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def training_step(model: nn.Module, loss: Callable[[], torch.Tensor]) -> Step:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -- the programs -------------------------------------------------------------------------------------
def _causal_lm(model: nn.Module, vocab: int) -> Step:
    ids = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(0))
    return training_step(model, lambda: model(input_ids=ids, labels=ids).loss)


def gpt2() -> Step:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=128, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return _causal_lm(transformers.GPT2LMHeadModel(config), 8192)


def _decoder_config(cls: type, **extra: object) -> object:
    options: dict[str, object] = {
        "vocab_size": 8192,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    return cls(**(options | extra))


def llama() -> Step:
    import transformers

    return _causal_lm(transformers.LlamaForCausalLM(_decoder_config(transformers.LlamaConfig)), 8192)


def qwen3() -> Step:
    import transformers

    config = _decoder_config(transformers.Qwen3Config, head_dim=32)
    return _causal_lm(transformers.Qwen3ForCausalLM(config), 8192)


def gemma2() -> Step:
    import transformers

    config = _decoder_config(transformers.Gemma2Config, head_dim=32, attn_implementation="eager")
    return _causal_lm(transformers.Gemma2ForCausalLM(config), 8192)


def mistral() -> Step:
    import transformers

    config = _decoder_config(transformers.MistralConfig, attn_implementation="eager")
    return _causal_lm(transformers.MistralForCausalLM(config), 8192)


def qwen2_eager() -> Step:
    """Eager attention at a longer sequence: the saved [batch, heads, seq, seq] scores set the peak."""
    import transformers

    config = _decoder_config(
        transformers.Qwen2Config, attn_implementation="eager", max_position_embeddings=512
    )
    model = transformers.Qwen2ForCausalLM(config)
    ids = torch.randint(0, 8192, (2, 512), generator=torch.Generator().manual_seed(0))
    return training_step(model, lambda: model(input_ids=ids, labels=ids).loss)


def qwen3_batch16() -> Step:
    """A narrow vocabulary at batch 16: the activations of two layers set the peak, not the logits."""
    import transformers

    config = _decoder_config(transformers.Qwen3Config, head_dim=32, vocab_size=512, num_hidden_layers=2)
    model = transformers.Qwen3ForCausalLM(config)
    ids = torch.randint(0, 512, (16, 128), generator=torch.Generator().manual_seed(0))
    return training_step(model, lambda: model(input_ids=ids, labels=ids).loss)


def t5() -> Step:
    import transformers

    config = transformers.T5Config(
        vocab_size=8192, d_model=128, d_kv=32, d_ff=256, num_layers=3, num_heads=4, decoder_start_token_id=0
    )
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))
    return training_step(model, lambda: model(input_ids=ids, labels=ids).loss)


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def mlp() -> Step:
    model = nn.Sequential(*[Residual(128, 512) for _ in range(6)], nn.Linear(128, 10))
    x, y = torch.randn(2048, 128), torch.randint(0, 10, (2048,))
    return training_step(model, lambda: nn.functional.cross_entropy(model(x), y))


def wide_mlp() -> Step:
    """Few rows through wide layers: gradients and the optimizer step's temporaries set the peak."""
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)], nn.Linear(1024, 10))
    x, y = torch.randn(16, 1024), torch.randint(0, 10, (16,))
    return training_step(model, lambda: nn.functional.cross_entropy(model(x), y))


def conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())


def convnet() -> Step:
    model = nn.Sequential(
        conv_block(3, 32),
        *[conv_block(32, 32) for _ in range(7)],
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    return training_step(model, lambda: nn.functional.cross_entropy(model(x), y))


def gpt_plain() -> Step:
    """The GPT demo's model (vocabulary 50257, tied head) with the loss in plain code:
    ``F.cross_entropy(model(x).logits.view(-1, V), y)``."""
    from memtrim.cases import gpt

    model = gpt.GPT(gpt.DEMO)
    x, y = gpt.batch(gpt.DEMO, 4)
    return training_step(
        model, lambda: nn.functional.cross_entropy(model(x).logits.view(-1, gpt.DEMO.vocab), y.view(-1))
    )


class PlainLM(nn.Module):
    """A bfloat16 LM in plain PyTorch: an MLP body and a nested head with a bias."""

    def __init__(self, vocab: int = 16000, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.body(h))


def lm_bf16_plain() -> Step:
    """Its loss on the fp32 upcast of the bf16 logits, labels shifted by the data loader."""
    model = PlainLM().to(torch.bfloat16)
    data = torch.randint(0, 16000, (4, 129), generator=torch.Generator().manual_seed(0))
    ids, labels = data[:, :-1], data[:, 1:]
    return training_step(
        model, lambda: nn.functional.cross_entropy(model(ids).float().view(-1, 16000), labels.reshape(-1))
    )


def mixtral() -> Step:
    """A mixture of experts: transformers runs its experts through torch._grouped_mm."""
    import transformers

    config = _decoder_config(transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm(transformers.MixtralForCausalLM(config), 8192)


def torch_encoder() -> Step:
    """nn.TransformerEncoder (4 layers) and a Linear head in one nn.Sequential, label smoothing."""
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(128, 10))
    x, y = torch.randn(8, 64, 128), torch.randint(0, 10, (8 * 64,))
    return training_step(
        model, lambda: nn.functional.cross_entropy(model(x).view(-1, 10), y, label_smoothing=0.1)
    )


class LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.out = nn.Linear(128, 5000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.lstm(self.embed(ids))[0])


def lstm() -> Step:
    """An LSTM tagger: its head's nn.Linear runs mm then adds its bias (a non-contiguous input)."""
    model = LSTMTagger()
    ids = torch.randint(0, 5000, (8, 64), generator=torch.Generator().manual_seed(0))
    return training_step(model, lambda: nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))


PROGRAMS: dict[str, Callable[[], Step]] = {
    "gpt2": gpt2,
    "llama": llama,
    "qwen3": qwen3,
    "gemma2": gemma2,
    "mistral": mistral,
    "qwen2-eager": qwen2_eager,
    "qwen3-batch16": qwen3_batch16,
    "t5": t5,
    "mlp": mlp,
    "wide-mlp": wide_mlp,
    "convnet-bn": convnet,
    "gpt-plain": gpt_plain,
    "lm-bf16-plain": lm_bf16_plain,
    "mixtral": mixtral,
    "torch-encoder": torch_encoder,
    "lstm": lstm,
}


# -- one row -----------------------------------------------------------------------------------------
@dataclass
class Row:
    program: str
    share: float
    budget: int
    plan: str
    predicted: int | None = None
    measured: int | None = None
    cost: float = 0.0
    numerics: str = ""
    seconds: float = 0.0
    keeps: str = ""

    @property
    def within(self) -> bool:
        return self.measured is not None and self.measured <= self.budget

    @property
    def error(self) -> float | None:
        if self.measured is None or self.predicted is None:
            return None
        return (self.predicted - self.measured) / self.measured


def run(name: str, share: float) -> Row:
    torch.manual_seed(0)
    step = PROGRAMS[name]()
    step()  # warm up: the optimizer state exists, the measured step is a steady one
    with memtrim.track() as trace:
        step()
    budget = int(trace.peak_bytes * share)
    started = time.perf_counter()
    try:
        plan = memtrim.fit(step, budget=budget)
    except memtrim.NoPlanFits as floor:
        text = str(floor)
        lowest = text.split("lowest the allowed levers reach is ")[1].split(" ")[0:2]
        return Row(name, share, budget, f"no plan fits (lowest {' '.join(lowest)})")
    seconds = time.perf_counter() - started
    with memtrim.applied(plan):
        measured = profiled_peak(step)
    levers: dict[str, int] = {}
    for lever in plan.levers:
        levers[lever.lever] = levers.get(lever.lever, 0) + 1
    described = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in levers.items()) or "(nothing)"
    cost = sum(lever.cost for lever in plan.levers)
    kept = {lever.keeps for lever in plan.levers}
    keeps = next((k for k in ("changes-training", "reference", "exact") if k in kept), "exact")
    return Row(
        name,
        share,
        budget,
        described,
        plan.predicted_peak,
        measured,
        cost,
        plan.numerics.verdict,
        seconds,
        keeps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(PROGRAMS), help="programs to run (default: all)")
    args = parser.parse_args()
    names = args.only or list(PROGRAMS)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"budgets {BUDGETS} of the unplanned peak"
    )
    header = (
        f"{'program':<13} {'budget':>10}  {'plan':<34} {'predicted':>10} {'measured':>10} {'pred-meas':>9}"
    )
    print(header + f" {'fits':>4} {'cost FLOP':>9} {'keeps':>9} {'numerics':>8} {'fit s':>5}")
    rows = []
    for name in names:
        for share in BUDGETS:
            row = run(name, share)
            rows.append(row)
            budget = f"{format_bytes(row.budget)}"
            if row.measured is None:
                print(f"{name:<13} {budget:>10}  {row.plan}")
                continue
            assert row.predicted is not None and row.error is not None
            print(
                f"{name:<13} {budget:>10}  {row.plan:<34} {format_bytes(row.predicted):>10} "
                f"{format_bytes(row.measured):>10} {row.error * 100:>+8.1f}% "
                f"{'yes' if row.within else 'NO':>4} "
                f"{row.cost:>9.2g} {row.keeps:>9} {row.numerics:>8} {row.seconds:>5.1f}"
            )
    feasible = [r for r in rows if r.measured is not None]
    within = sum(r.within for r in feasible)
    close = sum(abs(r.error or 0) <= 0.05 for r in feasible)
    passed = sum(r.numerics == "pass" for r in feasible)
    print(
        f"\n{len(feasible)} of {len(rows)} cases have a plan; measured within budget in {within}, prediction "
        f"within 5% of measured in {close}, numerics pass in {passed}"
    )


if __name__ == "__main__":
    main()
