"""Launchers: how the controller starts a run's worker processes (torchrun here, Slurm via Hydra)."""
