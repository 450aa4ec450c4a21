"""The seed systems memtrim ships as working, verified cases.

- :mod:`memtrim.cases.heads`: per-head attention results (seed 001).
- :mod:`memtrim.cases.gsq`: a GSQ-style 2-bit Gumbel-softmax weight quantizer (seed 000).
"""
