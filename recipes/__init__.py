"""Recompute recipes: choose activation recompute for megatron-core training with measurements.

The package, top to bottom (imports only point down; ``tests/test_layout.py`` checks it):

- ``run/``      the controller (compose, validate, launch, record), the console, the per-rank worker
- ``analyze/``  results into a report, the advisor, W&B logging
- ``predict/``  the estimator (activation terms per layer), the paper's formulas, the one fit rule
- ``measure/``  the activation ledger, checkpoint counts, label resolution, memory traces, FLOPs
- ``build/``    the megatron-core model (attention, experts, GatedDeltaNet), parallel helpers,
                upstream workarounds and the CPU compatibility layer
- ``data/``     mock and indexed datasets, preprocessing
- ``recompute.py`` the vocabulary (families, labels, ledger kinds, options), ``config.py`` the Hydra
  schema, ``validate/`` the rules (a module a concern), ``results.py`` result.json, ``errors.py`` and ``files.py`` leaves
"""
