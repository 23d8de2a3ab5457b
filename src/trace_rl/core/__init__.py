"""The algorithm, free of models and I/O: rollout trees (`tree.py`), the contrastive values
(`contrast.py`), the exact Stage-1 / Stage-2 solvers (`solvers.py`) and the allocations they are
compared with (`baselines.py`), group mixing under a posterior (`mixing.py`), allocation under a token
budget (`token_budget.py`) and the tree advantage estimators (`advantage.py`)."""
