"""Token-in / token-out generation engines.

- `engine.base`: the `Engine` protocol, `SamplingParams`, `Completion` (log-prob and stop-string
  semantics are defined there).
- `engine.hf.HFEngine`: transformers in-process, CPU or GPU (imports torch; import it from
  `trace_rl.engine.hf`, so this package stays light).
- `engine.openai_server.OpenAIEngine`: an OpenAI-compatible vLLM / SGLang server (stdlib only).
"""

from .base import Completion, Engine, EngineError, FinishReason, SamplingParams
from .openai_server import OpenAIEngine

__all__ = ["Completion", "Engine", "EngineError", "FinishReason", "OpenAIEngine", "SamplingParams"]
