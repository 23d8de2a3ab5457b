"""How a model is prompted when the run config does not say: its turn format, its worked examples, its
sampling temperature (`PromptProfile`, chosen per model by `profile_for`).

Why per model: a pretrained instruct model follows the prompt shapes its own training showed it, not
ours. A model taught Hermes-style tool calls (the Qwen2 and Qwen3 families) writes
`<tool_call>{"name": …, "arguments": …}</tool_call>`, so it gets the `json` format. SmolLM2-135M-Instruct
was taught no tool format at all: told the rules alone, it answers the question in prose, and at
temperature 1 its prose drifts into noise, so without a warm start it wrote almost no valid action
and RL had nothing to learn from. Shown worked examples (whole episodes of other questions, as earlier
turns of the chat) and sampled at 0.7, it copies the format for its first turn; after an observation it
wrote prose again until each turn was opened with `<think>` for it (`experiments/protocol_share.py`,
docs/results/protocol_share).

A profile fills only what the config leaves open (`task.format: auto`, `task.few_shot: null`,
`task.open_thought: null`, `rollout.temperature: null`); a value the config sets always wins. Worked examples apply only to a run
without a warm start: a warm-started policy has learnt the format from its demonstrations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptProfile:
    """What a model is prompted with by default."""

    format: str = "tag"
    """The ReAct turn format (`trace_rl.agent.protocol`): `tag` or `json`."""
    few_shot: int = 0
    """Worked examples before the question when the run has no warm start."""
    open_thought: bool = False
    """Whether each of the model's turns is opened with `<think>` for it."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts and the sampled evaluation."""
    why: str = "no profile: the defaults"


DEFAULT = PromptProfile()

PRESET_PROFILES: dict[str, PromptProfile] = {
    "tiny": PromptProfile(why="made here and always warm-started on the tag format"),
    "smollm2-135m": PromptProfile(
        format="tag",
        few_shot=2,
        open_thought=True,
        temperature=0.7,
        why="taught no tool format: two worked examples, each turn opened with <think>, and temperature 0.7 "
            "make most of its turns valid actions",
    ),
}
"""Profiles of the presets, by `model.name`."""

FAMILY_PROFILES: dict[str, PromptProfile] = {
    family: PromptProfile(format="json", why="trained on Hermes-style <tool_call> JSON")
    for family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
}
"""Profiles of model families, by the `model_type` of a model folder's config.json (or a hub id's name)."""


def profile_for(name: str) -> PromptProfile:
    """The profile of `model.name`: a preset's, else its family's (read from a local folder's config.json,
    or guessed from a hub id), else the defaults."""
    if name in PRESET_PROFILES:
        return PRESET_PROFILES[name]
    config = Path(name).expanduser() / "config.json"
    if config.is_file():
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        return FAMILY_PROFILES.get(str(model_type), DEFAULT)
    lowered = name.lower()
    for family in sorted(FAMILY_PROFILES, key=len, reverse=True):
        if family.split("_")[0] in lowered.replace("-", "").replace(".", ""):
            return FAMILY_PROFILES[family]
    return DEFAULT
