"""The seed systems memtrim ships as working, verified cases.

- :mod:`memtrim.cases.heads`: per-head attention results (seed 001).
- :mod:`memtrim.cases.gsq`: a GSQ-style 2-bit Gumbel-softmax weight quantizer (seed 000).
- :mod:`memtrim.cases.gpt`: a small GPT-style language model whose training step ``memtrim demo gpt``
  (:mod:`memtrim.cases.gpt_demo`) tracks, fixes with :mod:`memtrim.fixes`, verifies and measures.
"""
