"""memtrim where people already work: a pytest plugin (memory budgets per test) and trainer callbacks.

Nothing here is imported by ``import memtrim``: each module needs its framework (pytest, transformers,
lightning) and is imported by name — ``memtrim.integrations.transformers`` — or, for the pytest plugin,
by pytest itself through the ``pytest11`` entry point. See docs/pytest-and-trainers.md.
"""
