"""The policy update and the warm start: the trainer's step (`trainer.py`), the clipped policy loss
(`loss.py`), trees to training sequences and packed rows (`sequences.py`), exact tree attention
(`tree_attention.py`) and supervised fine-tuning on demonstrations (`sft.py`). Named `training`, not
`train`, so that `trace_rl.train` stays the exported function after any of these is imported."""
