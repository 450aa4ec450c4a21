"""Two training steps of a toy attention-output layer whose per-head results are built the broadcast way.

The program the README's pictures come from (`make images`): `memtrim run` on it, as a user would.
"""

import torch

import memtrim

torch.manual_seed(0)
n_pos, n_heads, d_head, d_model = 128, 12, 64, 768
to_z = torch.nn.Linear(d_model, n_heads * d_head)
W_O = torch.nn.Parameter(torch.randn(n_heads, d_head, d_model) / d_head**0.5)
optimizer = torch.optim.Adam([*to_z.parameters(), W_O], lr=1e-3)
x = torch.randn(n_pos, d_model)

for step in range(2):
    with memtrim.region(f"step {step}"):
        z = to_z(x).view(n_pos, n_heads, d_head)
        heads = (z[..., None] * W_O).sum(-2)  # per-head results, the broadcast way
        loss = heads.square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
