"""The experiments area: the latent-tree simulator (`sim.py`), the allocation benchmark on it
(`bench.py`), method comparisons over seeds (`compare.py`, `trace-rl compare`) and rerunning a run
with its own code (`reproduce.py`)."""
