"""The run folder on disk (`rundir.py`): its layout, metrics, trees, checkpoints and the one-writer lock,
and the packing of finished runs for `docs/results/`. Storage only: it reads and writes data, never a
model or a trainer, so the trainer, the reports and the research scripts all stand on it."""
