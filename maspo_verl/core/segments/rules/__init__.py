"""The segment rules, one module each: every ``SegmentRule`` defined here is registered on import of
``maspo_verl.core.segments`` (``maspo_verl.core.segments.registry.discover``). A new rule is a new module here plus a
preset in ``hydra_configs/loss/`` (``docs/examples/spike_rule.py`` is a complete one)."""
