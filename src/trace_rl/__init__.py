"""trace-rl: agentic RL with tree-structured rollouts and exact rollout-budget allocation (TRACE)."""

__version__ = "0.1.0"
