"""verl adapter (extra `verl`, verl >= 0.9.1 with its V1 trainer): TRACE's allocation, trees and tree
advantages inside verl's own training loop, on verl's own rollout replicas.

- `TraceAgentLoopManager` (`manager.py`): set as `actor_rollout_ref.rollout.agent.agent_loop_manager_class=
  trace_rl.integrations.verl.manager.TraceAgentLoopManager`;
  plans each training batch with TRACE (Stage 1 across its prompts, Stage 2 across every prefix of
  its trees), generates through verl's `LLMServerClient` (`engine.py`, sticky per tree), and writes
  one TransferQueue row per leaf with its own reward, its tree advantages and node ids;
- `TracePPOTrainer` (`trainer.py`): trainer mode `trace` (`trainer.v1.trainer_mode=trace`), verl's
  synchronous trainer training those advantages;
- `data.py`: the parquet files verl's dataset reads, one row per trace-rl task (`trace-rl verl-data`,
  which needs pyarrow but not verl).

Importing `trainer.py` registers the trainer mode; the `verl.plugins` entry point (pyproject.toml)
imports it inside every verl process, so `trainer.v1.trainer_mode=trace` resolves there. The recipe
is `examples/verl_trace.sh`.
"""
