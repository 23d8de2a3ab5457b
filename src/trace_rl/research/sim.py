"""Latent-tree simulator: multi-turn rollouts whose true success probability is known at every prefix.

Why it exists: allocation quality can only be judged against the truth, and a real agent never tells
us its true success rate. Here it does, while its text still carries the (noisy) clues a text
predictor must learn from, as a real agent's would.

The latent process. Prompt i has a true success probability p0 = σ(z), with log-odds

    z = μ_topic + hop_offset + ε,   ε ~ N(0, prompt_noise²)

Topic means are bimodal like real RL batches: round(hard_share · num_topics) topics are hard
(μ ~ N(-5, 1)), round(easy_share · num_topics) easy (μ ~ N(4.5, 1)), the rest in between
(μ ~ N(0, 1.5)); hop offsets are +1.2, +0.4, -0.4, -1.2
for 1- to 4-hop questions. Each tool turn moves the probability p by a random amount δ:

    up   (chance p):     p ← p + δ (1 − p)
    down (chance 1 − p): p ← p (1 − δ)

A turn is decisive with chance `decisive_share` (δ ~ U(0.6, 0.97): it nearly settles the outcome) and
minor otherwise (δ ~ U(0, 0.25)). The expected next p is p, so p is a martingale: **the true success
probability of any prefix is exactly the p stored at its node** (the chance of stopping does not
depend on the future, so optional stopping keeps it exact). After each tool turn the agent answers
with chance `answer_hazard` (always after `max_turns`); the answer is a leaf with reward ~ Bernoulli(p).

The text. Prompts name two words of their topic (the second is a filler word instead with chance
`text_noise`), their hop count, and filler words. A turn's action tells a decisive step (`open[...]`)
from a minor one (`search[...]`), and its observation says whether it helped (decisive: "the page
states the key fact" / "contradicts the plan"; minor: "a snippet loosely mentions" / "search returned
nothing"). Each of these two clues is hidden with chance `text_noise` (the turn then reads
`lookup[...]` or "the result says something"): text never lies, but it does not always tell. The answer turn's text is the same whatever the reward. The numbers p, δ and ε never
appear in the text; nodes keep p in `info["p_true"]` for the benchmark.

What text cannot tell, even in principle: ε (σ = 1 in log-odds is a sizeable share of a prompt's
difficulty), δ within its class, a hidden clue, and the final Bernoulli draw.
`expected_p0` is the best root estimate from the latent topic and hop count (no text predictor can
beat it), for reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_rl.core.tree import RolloutTree

HOP_OFFSETS = (1.2, 0.4, -0.4, -1.2)
"""Log-odds offset of 1- to 4-hop questions: more hops, harder."""
TOPIC_MEANS = {"hard": (-5.0, 1.0), "easy": (4.5, 1.0), "medium": (0.0, 1.5)}
"""(mean, std) of a topic's log-odds mean μ in each difficulty class."""
DECISIVE_DELTA = (0.6, 0.97)
MINOR_DELTA = (0.0, 0.25)
WORDS_PER_TOPIC = 4
_SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "vu", "zen", "pa", "qui", "sol", "dra", "fen", "gor", "hil", "jas", "nox")


@dataclass(frozen=True)
class SimConfig:
    """The simulated world. Defaults give uniform allocation an effective ratio near 28% at 6 rollouts
    per prompt (the paper starts from 26.8%): 45% of topics hard, 25% easy, 30% in between."""

    num_topics: int = 32
    """Topics; all prompts of a topic share its difficulty and its words (what a predictor can learn)."""
    hard_share: float = 0.45
    """Share of topics that are hard (most prompts near p0 = 0)."""
    easy_share: float = 0.25
    """Share of topics that are easy (most prompts near p0 = 1)."""
    prompt_noise: float = 1.0
    """Std of each prompt's own log-odds deviation, which no text reveals."""
    max_turns: int = 5
    """Tool turns before the agent must answer."""
    answer_hazard: float = 0.35
    """Chance of answering after each tool turn (before `max_turns`)."""
    decisive_share: float = 0.3
    """Share of tool turns that nearly settle the outcome."""
    text_noise: float = 0.15
    """Chance that a text clue (a prompt's second topic word, a turn's kind, a turn's outcome) is
    hidden. Clues are hidden, never wrong: a tool's output shows what was found."""
    turn_tokens: int = 40
    """Policy tokens a tool turn writes (its mask's ones), so a token budget has something to count:
    a rollout's cost is its number of turns, and a continuation from a deep prefix costs less."""
    answer_tokens: int = 12
    """Policy tokens of the answer turn."""

    def __post_init__(self) -> None:
        if self.num_topics < 1:
            raise ValueError(f"sim.num_topics must be >= 1, got {self.num_topics!r}")
        if not (0.0 <= self.hard_share and 0.0 <= self.easy_share and self.hard_share + self.easy_share <= 1.0):
            raise ValueError(f"sim.hard_share and sim.easy_share must be >= 0 with sum <= 1, got {self.hard_share!r}, {self.easy_share!r}")
        if self.prompt_noise < 0.0:
            raise ValueError(f"sim.prompt_noise must be >= 0, got {self.prompt_noise!r}")
        if self.max_turns < 1:
            raise ValueError(f"sim.max_turns must be >= 1, got {self.max_turns!r}")
        for name in ("turn_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"sim.{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("answer_hazard", "decisive_share", "text_noise"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"sim.{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class SimPrompt:
    task_id: str
    text: str
    p0: float
    """True success probability of a fresh rollout."""
    topic: int
    hops: int


class LatentTreeSimulator:
    """A seeded world (topics, their difficulty and words) that makes prompts and grows rollout trees.

    The world is fixed by `seed`; prompts and rollouts take the generator they should draw from, so
    a benchmark can replay the same prompts under several allocation methods.
    """

    def __init__(self, config: SimConfig | None = None, *, seed: int = 0) -> None:
        self.config = config or SimConfig()
        world = np.random.default_rng([seed, 0x5151])
        cfg = self.config
        # Exactly round(share * num_topics) hard and easy topics, so worlds differ only in the details.
        hard, easy = round(cfg.hard_share * cfg.num_topics), round(cfg.easy_share * cfg.num_topics)
        kind = world.permutation(np.repeat([0, 1, 2], [hard, easy, cfg.num_topics - hard - easy]))
        params = np.array([TOPIC_MEANS["hard"], TOPIC_MEANS["easy"], TOPIC_MEANS["medium"]])[kind]
        self.topic_logit = world.normal(params[:, 0], params[:, 1])
        vocabulary = _pseudo_words(world, cfg.num_topics * WORDS_PER_TOPIC + 160)
        self.topic_words = [vocabulary[i * WORDS_PER_TOPIC : (i + 1) * WORDS_PER_TOPIC] for i in range(cfg.num_topics)]
        self.filler = vocabulary[cfg.num_topics * WORDS_PER_TOPIC :]
        # E[σ(μ + offset + ε)] per (topic, hops), by Gauss-Hermite quadrature over ε.
        nodes, weights = np.polynomial.hermite_e.hermegauss(64)
        z = self.topic_logit[:, None, None] + np.array(HOP_OFFSETS)[None, :, None] + cfg.prompt_noise * nodes
        self._expected_p0 = (1.0 / (1.0 + np.exp(-z))) @ (weights / weights.sum())
        self._prompts = 0

    # ------------------------------------------------------------ prompts

    def sample_prompts(self, count: int, rng: np.random.Generator) -> list[SimPrompt]:
        """`count` fresh prompts (topics drawn uniformly); task ids are unique within this simulator."""
        cfg = self.config
        topics = rng.integers(cfg.num_topics, size=count)
        hops = rng.integers(len(HOP_OFFSETS), size=count)
        z = self.topic_logit[topics] + np.array(HOP_OFFSETS)[hops] + rng.normal(0.0, cfg.prompt_noise, size=count)
        p0 = 1.0 / (1.0 + np.exp(-z))
        prompts = []
        for i in range(count):
            words = list(self.topic_words[topics[i]])
            first, second = rng.choice(WORDS_PER_TOPIC, size=2, replace=False)
            named = [words[first], words[second]]
            if rng.random() < cfg.text_noise:  # the question names its topic only once
                named[1] = self.filler[rng.integers(len(self.filler))]
            f = [self.filler[j] for j in rng.integers(len(self.filler), size=4)]
            text = f"Question ({hops[i] + 1}-hop): what {f[0]} {named[0]} {f[1]} the {named[1]} {f[2]} {f[3]}?"
            prompts.append(SimPrompt(f"sim-{self._prompts}", text, float(p0[i]), int(topics[i]), int(hops[i]) + 1))
            self._prompts += 1
        return prompts

    def expected_p0(self, topic: int, hops: int) -> float:
        """E[p0 | topic, hops]: the root estimate of someone who knows a prompt's latent topic and
        hop count but not its own deviation ε. A ceiling for any predictor that reads the prompt."""
        return float(self._expected_p0[topic, hops - 1])

    def new_tree(self, prompt: SimPrompt) -> RolloutTree:
        """A tree holding only the root; `root.info["p_true"]` is p0."""
        tree = RolloutTree.new(prompt.task_id, prompt.text, meta={"p0": prompt.p0, "topic": prompt.topic, "hops": prompt.hops})
        tree.root.info["p_true"] = prompt.p0
        return tree

    # ------------------------------------------------------------ rollouts

    @staticmethod
    def true_value(tree: RolloutTree, node_id: int) -> float:
        """Exact success probability of a rollout continued from `node_id` (a leaf: its reward)."""
        node = tree.nodes[node_id]
        return float(node.reward) if node.is_terminal else float(node.info["p_true"])

    def rollout(self, tree: RolloutTree, node_id: int, rng: np.random.Generator) -> int:
        """Continue one rollout from `node_id` (root or intermediate prefix) to its answer; return the leaf id.

        Tool turns are appended until the agent answers; the answer leaf carries the reward.
        """
        cfg = self.config
        node = tree.nodes[node_id]
        if node.is_terminal:
            raise ValueError(f"node {node_id} of tree {tree.task_id!r} is a finished rollout; it cannot be continued")
        p = float(node.info["p_true"])
        depth = node.depth
        words = self.topic_words[int(tree.meta["topic"])]
        # One row of uniforms per step, drawn at once (a list of floats is fast to read):
        # answer now?, reward, kind, δ, outcome, hide kind, hide outcome, three word picks.
        for u in rng.random((max(cfg.max_turns - depth, 0) + 1, 10)).tolist():
            if depth >= 1 and (depth >= cfg.max_turns or u[0] < cfg.answer_hazard):
                reward = float(u[1] < p)
                return tree.add_turn(
                    node_id, thought="I have enough to answer", action="answer[final]", reward=reward, info={"p_true": reward},
                    token_ids=[0] * cfg.answer_tokens,
                )
            decisive = u[2] < cfg.decisive_share
            low, high = DECISIVE_DELTA if decisive else MINOR_DELTA
            delta = low + (high - low) * u[3]
            up = u[4] < p
            p = p + delta * (1.0 - p) if up else p * (1.0 - delta)
            kind = "vague" if u[5] < cfg.text_noise else ("decisive" if decisive else "minor")
            outcome = "vague" if u[6] < cfg.text_noise else ("up" if up else "down")
            topic_word = words[int(u[7] * WORDS_PER_TOPIC)]
            filler = self.filler[int(u[8] * len(self.filler))]
            other = self.filler[int(u[9] * len(self.filler))]
            node_id = tree.add_turn(
                node_id,
                thought=f"I need the {topic_word} {filler} next",
                action=f"{_ACTIONS[kind]}[{topic_word} {other}]",
                observation=_OBSERVATIONS[kind, outcome].format(filler),
                info={"p_true": p},
                token_ids=[0] * cfg.turn_tokens,
            )
            depth += 1
        raise AssertionError("unreachable: the last row always answers")  # depth reaches max_turns


_ACTIONS = {"decisive": "open", "minor": "search", "vague": "lookup"}
_OBSERVATIONS = {
    ("decisive", "up"): "the page states the key fact about {}",
    ("decisive", "down"): "the page contradicts the plan on {}",
    ("minor", "up"): "a snippet loosely mentions {}",
    ("minor", "down"): "search returned nothing on {}",
    ("vague", "up"): "the result seems to support {}",
    ("vague", "down"): "the result seems to weaken {}",
    **{(kind, "vague"): "the result says something about {}" for kind in ("decisive", "minor", "vague")},
}
"""Turn text by (kind clue, outcome clue); a hidden clue reads "vague" and tells nothing."""


def _pseudo_words(rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct made-up words of 2-3 syllables (no English word carries a hidden meaning)."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        length = 2 + int(rng.integers(2))
        word = "".join(_SYLLABLES[j] for j in rng.integers(len(_SYLLABLES), size=length))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words
