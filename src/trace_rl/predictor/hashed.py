"""A fast text-feature success predictor: hashed word n-grams and online logistic regression.

Features of a history (each an index into a hashed weight vector, value 1 per occurrence, so a
repeated n-gram counts twice):

- `p:` word 1..max_ngram-grams of the prompt, for every history (what the task is about: carries
  difficulty across prompts);
- `r:` the same n-grams again, for the root only: all the root head reads (below), and in the shared
  model they carry what is special about roots, so that the `p:` weights, which prefixes use, are
  not bent to fit them;
- `t<field>:` n-grams of every turn so far, per field (thought / action / observation);
- `l<field>:` n-grams of the last turn only (the most recent evidence weighs on its own);
- `d:` the depth (number of turns), capped at 16.

Two logistic regressions z = b + Σ w_j read these features, each trained with AdaGrad on
cross-entropy against fractional targets (tree backup values), with L2 on the weights a minibatch
touches, and each minibatch step capped in what it may do to a logit (below):

- the *shared model* sees every feature above and learns from every example; it answers for
  intermediate prefixes;
- the *root head* has its own weights and bias, reads only the prompt (`r:` n-grams) and learns from
  root examples only; it answers for roots, i.e. Stage 1.

Why a root head: the root value is a function of the prompt alone, Stage 1 hangs on it, and Stage 1
decides between 1% and 10%, where a shared model errs both ways. Trained once per batch (the old
setting), its root estimates are squeezed towards the middle (roots predicted at 3.4% succeed 2.5%
of the time, at 7.2% 5.4%); trained hard enough on roots to reach the extremes (the replay below),
its two weights per prompt word (`p:` and `r:`) over-fit and turn over-confident (predicted 1.4%:
3.8%; 7.3%: 11%), so Stage 1 filters prompts it should sample. The root head, one weight per prompt
n-gram and its own bias, is calibrated there (3.2%: 4.0%; 7.2%: 7.4%) and has the lowest held-out
root error of the three (all figures on the simulator, `trace_rl.research.bench`). The shared model still
learns from roots: that is how its prompt weights, which prefixes use, learn what a prompt is worth
(without them its held-out prefix error rises by a third).

Why replay: each update sees one batch, roots of a batch are few, and Stage 1 stops sampling the
prompts it believes hopeless, so a predictor that forgets old batches also forgets why it believed
that (recent data over-represents the prompts it kept) and drifts back. Both models therefore train
on the root examples of the last `replay_batches` updates as well (kept as prompt text, target and
weight: small, and in the state), and the root head makes `root_epochs` passes over them. On the
simulator this lowers the held-out root error by 16-19%.

Why the step cap: AdaGrad's first steps move every feature they touch by about the learning rate,
whatever its gradient, so one minibatch step moves an example's logit by about lr x (its number of
active features). A simulator prefix lights up about 60 (at most about 100); a real multi-hop
prefix (prompt and turns with long search results) about 500 (up to about 1,000), so on the demo
run the old update took the loss of its very first batch from 0.693 to 8.46 and training diverged
(`predictor/brier` 0.19, 0.34, 0.47, 0.44 over steps 1-4, where a constant 0.5 scores 0.25; replayed
over 20 steps, 0.45 after five warm-up steps, 0.65 on continuations). Each minibatch step is therefore
scaled down, as a whole, until no example of the minibatch has its logit moved by more than
`max_logit_step`: how far a step goes no longer depends on how many features are active. On the
simulator it also helps, since there too the first steps overshoot: replayed on its TRACE trees (2
worlds, 40 batches), continuations from prefixes score a Brier of 0.217 instead of 0.227, and the
worst batch 0.205 instead of 0.267.

Why calibration, and what it reads: before each update the models' logits for the new batch are
out-of-sample predictions. A small logistic regression per head, over the raw logit z and a few
summary features s of the history,

    p = σ(a z + β·s + c),

is fitted on those of the last `calibration_batches` updates (a prior of weight `calibration_prior`
pulls it towards a = 1, β = 0, c = 0, and a stays in [0, `calibration_max_slope`]). It shrinks an
over-confident model (on real trees the fitted slope is about 0.3 on roots and near 0 on prefixes:
out of sample the n-gram models barely generalise there), lets c follow a success rate that moves
as the policy learns, and learns from the summary features what the n-grams cannot express:

- prefixes: how many words of the last action (its markup removed: for a search, the query) appear
  neither in the prompt nor in an earlier observation (exactly 1, 2 or more, or no words at all): a
  query for something the agent has not seen is a guess (on a 20-step demo run, 60% of the prefixes
  whose query words had all appeared before succeeded, 6% of the others); whether the last action
  repeats an earlier one; the prompt's length in words (9-12, 13-16, 17 or more: longer questions
  have more hops; 1-2-hop questions succeeded 75%, 3-4-hop ones 50%);
- roots: the prompt's length in words, as above.

Prefixes answer calibrated as soon as the first update has fitted a calibration. Roots do only while it
helps: at each update each batch of the window is predicted by the calibration fitted on the others,
and the root head answers calibrated only if that held-out cross-entropy undercuts the raw logits'
by `calibration_margin`. On real trees the raw root head is badly over-confident and the
calibration wins from about the fourth update on; on the simulator the raw root head is already
calibrated (held out, calibrating it changed its cross-entropy by +0.6%), yet calibrating it anyway
cost TRACE 0.022 of effective ratio (10 seeds of `trace_rl.research.bench`), and the margin keeps it raw there.
`experiments/predictor_replay.py` measures all of this against a running-mean constant, the
per-prompt history and the previous predictor, on recorded runs and on the simulator.

All weights start at zero and the calibrations at the identity (and unused), so every prediction
is exactly 0.5 until the first update. A word hashes to CRC32(word) and an n-gram folds the next word in
(h·0x9E3779B1 + CRC32(word) mod 2³²); a feature's index is that hash XOR CRC32(namespace) mod
num_features. This is stable across runs and processes (unlike Python's salted `hash`), and
minibatch order comes from a seeded generator, so training is deterministic given the seed.
Features of each distinct prompt and turn are computed once, in bulk, and cached (a tree's
histories share their prefixes).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import numpy as np

from trace_rl.core.tree import History, Turn
from trace_rl.infra.config import check_range
from trace_rl.predictor.base import check_training_batch

_WORD = re.compile(r"[a-z0-9]+")
_MARKUP = re.compile(r"<[^>]*>")  # tags around a tool call (`<search> ... </search>`)
_MAX_DEPTH_FEATURE = 16
_CACHE_LIMIT = 200_000
_STATE_VERSION = 3
_HEADS = ("root", "prefix")
_PROMPT_LENGTHS = (9, 13, 17)
"""Prompt-length bins of the calibration's summary features: 9-12, 13-16 and 17 or more words (fewer
than 9 is the baseline)."""


def _salt(namespace: str) -> np.uint32:
    return np.uint32(zlib.crc32(namespace.encode()))


_TURN_SALTS = np.array([_salt("th:"), _salt("ta:"), _salt("to:")], dtype=np.uint32)  # every turn: thought, action, observation
_LAST_SALTS = np.array([_salt("lh:"), _salt("la:"), _salt("lo:")], dtype=np.uint32)  # the last turn


class _Logistic:
    """One logistic regression over hashed features: weights, bias and their AdaGrad state."""

    def __init__(self, size: int, initial_accumulator: float) -> None:
        self.weights = np.zeros(size, dtype=np.float64)
        self.bias = 0.0
        # AdaGrad's Σ g², started at `initial_accumulator` (see HashedNgramPredictor).
        self.accum = np.full(size, initial_accumulator, dtype=np.float64)
        self.accum_bias = float(initial_accumulator)

    def logits(self, rows: np.ndarray, indices: np.ndarray, count: int) -> np.ndarray:
        return self.bias + np.bincount(rows, weights=self.weights[indices], minlength=count)

    def fit(
        self, starts: np.ndarray, indices: np.ndarray, y: np.ndarray, w: np.ndarray, *, epochs: int, config: PredictorConfig, rng: np.random.Generator
    ) -> tuple[int, int]:
        """`epochs` AdaGrad passes of weighted cross-entropy over the CSR examples, minibatches in `rng`
        order, each step scaled down so that it moves no logit of its minibatch by more than
        `config.advanced.max_logit_step`. Returns (steps taken, steps the cap scaled down)."""
        lr, l2, size, cap = config.learning_rate, config.advanced.l2, config.advanced.batch_size, config.advanced.max_logit_step
        steps = capped = 0
        for _ in range(epochs):
            order = rng.permutation(y.size)
            for begin in range(0, y.size, size):
                batch = order[begin : begin + size]
                batch_w = w[batch]
                if batch_w.sum() <= 0.0:
                    continue
                batch_rows, batch_idx = _gather_rows(starts, indices, batch)
                z = self.logits(batch_rows, batch_idx, batch.size)
                residual = batch_w * (_sigmoid(z) - y[batch]) / batch_w.sum()  # dCE/dz, weighted mean
                touched, inverse = np.unique(batch_idx, return_inverse=True)
                grad = np.bincount(inverse, weights=residual[batch_rows], minlength=touched.size)
                grad += l2 * self.weights[touched]
                accum = self.accum[touched] + grad**2
                step = lr * grad / np.sqrt(accum)
                grad_bias = float(residual.sum())
                accum_bias = self.accum_bias + grad_bias**2
                step_bias = lr * grad_bias / np.sqrt(accum_bias)
                if cap > 0.0:  # how far the step moves each example's logit
                    moved = np.abs(step_bias + np.bincount(batch_rows, weights=step[inverse], minlength=batch.size)).max()
                    if moved > cap:
                        step, step_bias = step * (cap / moved), step_bias * (cap / moved)
                        capped += 1
                steps += 1
                self.accum[touched] = accum
                self.weights[touched] -= step
                self.accum_bias = accum_bias
                self.bias -= step_bias
        return steps, capped

    def state(self) -> dict:
        return {"weights": self.weights.copy(), "bias": self.bias, "accum": self.accum.copy(), "accum_bias": self.accum_bias}

    def load(self, state: dict, size: int) -> None:
        weights = np.asarray(state["weights"], dtype=np.float64)
        accum = np.asarray(state["accum"], dtype=np.float64)
        if weights.shape != (size,) or accum.shape != weights.shape:
            raise ValueError(f"weights and accum must have shape ({size},), got {weights.shape}, {accum.shape}")
        self.weights, self.accum = weights.copy(), accum.copy()
        self.bias, self.accum_bias = float(state["bias"]), float(state["accum_bias"])


MAX_FEATURES = 2**24
"""Largest `num_features`: four float64 arrays of this size take 512 MiB; a typo of 10**12 would
otherwise fail with a MemoryError only when the predictor is built, after the warm start."""


@dataclass
class PredictorAdvanced:
    """The hashed predictor's tuned internals (`predictor.advanced`): sizes, AdaGrad's schedule, replay
    and calibration. Their defaults were chosen on the simulator and on real trees (docs/results,
    `experiments/predictor_replay.py`); a run needs none of them set."""

    num_features: int = 2**18
    """Size of each hashed weight vector (collisions are rare well below it)."""
    l2: float = 1e-4
    """L2 penalty on the weights touched by a minibatch (the biases are not penalised)."""
    epochs: int = 2
    """Passes of the shared model over each update's examples (and the replayed roots)."""
    batch_size: int = 256
    """Minibatch size within an epoch."""
    initial_accumulator: float = 1e-3
    """AdaGrad's starting Σ g². A feature's step is lr·g/sqrt(this + Σ g²). At 0 the first touch of any
    feature moves it by a full lr, so n-grams seen once (most of them) memorise that example's target;
    a positive start lets a rare feature's small gradient move it little, while frequent features soon
    outgrow the start. Too large a start also slows informative words of middling frequency (a topic's
    words); 1e-3 gave the best held-out error on the simulator (`trace_rl.research.bench`)."""
    replay_batches: int = 64
    """Earlier updates whose root examples both models train on again (0: none). Bounds the buffer; in a
    stationary world more is better (on the simulator keeping 20 batches instead of all 40 raised the
    held-out root error by 12%), while a policy that keeps improving makes old roots stale."""
    root_epochs: int = 8
    """Passes of the root head over the (current and replayed) root examples per update; 4 fits less,
    16 no better than 8 on the simulator."""
    max_logit_step: float = 1.0
    """Most a minibatch step of AdaGrad may move the logit of any example in it (0: no cap); a larger
    step is scaled down as a whole. Replaying a 20-step demo run's TRACE trees, no cap diverges even
    with the calibration below (Brier after five warm-up steps 0.424, on continuations from prefixes
    0.624); caps of 0.3, 1 and 3 score 0.228, 0.228 and 0.229. On the simulator 0.5, 1 and 3 score
    alike too (replayed Brier 0.179-0.182, against 0.193 without a cap)."""
    calibration_batches: int = 10
    """Updates whose out-of-sample logits (and summary features) fit each head's calibration, and over
    which the root head's calibration must beat its raw logits to be used (0: no calibration). On the
    replayed demo runs (TRACE / GRPO trees, Brier after five warm-up steps) 5 gave 0.231 / 0.219, 10
    0.228 / 0.218, 20 0.227 / 0.218; without calibration 0.263 / 0.238, worse than the running-mean
    constant (0.240 / 0.235)."""
    calibration_prior: float = 0.01
    """Weight of the calibration's pull towards the identity (slope 1, other coefficients 0), as a share
    of its data's weight (> 0: it also keeps the fit well posed). On the replayed demo runs 0.1 gave
    0.242 / 0.222, 0.01 0.228 / 0.218, 0.003 0.226 / 0.219; the simulator does not tell them apart."""
    calibration_margin: float = 0.02
    """Share by which the root head's calibration, held out, must undercut the raw logits' cross-entropy
    before the root head uses it (see the module docstring). At 0 it opens on the simulator's small,
    noisy gains and TRACE's effective ratio fell by 0.022 ± 0.004 (10 seeds); at 0.02 it changed by
    +0.004 ± 0.005. On the replayed demo runs 0, 0.02 and 0.05 gave 0.226, 0.228 and 0.230 (TRACE)."""
    calibration_max_slope: float = 2.0
    """Largest slope a of a calibration (the smallest is 0: a calibration may ignore the raw logit, never
    reverse it). Without a bound the old Platt scaling reached slopes of 670-1190 on a demo run; 1 and
    2 score the same on the replayed runs."""

    def __post_init__(self) -> None:
        check_range(self, "num_features", ge=2, le=MAX_FEATURES, why="each is a float64 weight and accumulator in two models")
        for name in ("initial_accumulator", "calibration_prior"):
            check_range(self, name, gt=0)
        for name in ("epochs", "root_epochs", "batch_size"):
            check_range(self, name, ge=1)
        for name in ("replay_batches", "calibration_batches"):
            check_range(self, name, ge=0, why="0: none")
        check_range(self, "l2", ge=0)
        check_range(self, "max_logit_step", ge=0, why="0: no cap")
        check_range(self, "calibration_margin", ge=0, lt=1)
        check_range(self, "calibration_max_slope", ge=0)


@dataclass
class PredictorConfig:
    """Settings of the shared predictor Ṽψ (`HashedNgramPredictor`): the run config's `predictor` section.

    Their defaults live here and nowhere else.
    """

    max_ngram: int = 2
    """Longest word n-gram (1 = words only, 2 = words and word pairs)."""
    learning_rate: float = 0.3
    """AdaGrad step size."""
    turn_features: bool = False
    """Whether the shared model reads the n-grams of a prefix's turns (`t…:` / `l…:`); False: the
    prompt's n-grams and the depth only (the calibration's summary features still read the turns).
    On real multihop trees the turns' n-grams (long search results) made prefix estimates worse:
    replaying the three TRACE runs of docs/results/paper_main (`experiments/predictor_replay.py`),
    Brier 0.234 / 0.228 / 0.228 with them, 0.213 / 0.199 / 0.205 without (on prefixes 0.274 / 0.275 /
    0.265 → 0.232 / 0.216 / 0.219; per-prompt history 0.228 / 0.222 / 0.229), and
    `experiments/propositions.py` found the same held out. The simulator's turn texts are made to carry
    clues, and there they help (0.187 with, 0.212 without), so `trace_rl.research.bench` keeps them."""
    guard: bool = False
    """Scale the predictor's estimates about 0.5 by how much they helped on the batches it learnt from
    (`trace_rl.predictor.guard`): one that ranks no better than a coin answers 0.5 (TRACE then
    allocates as with no information), one that ranks upside down is turned over."""
    guard_window: int = 10
    """Batches the guard's shrinkage is fitted on."""
    advanced: PredictorAdvanced = field(default_factory=PredictorAdvanced)
    """Tuned internals (`PredictorAdvanced`), for studying the predictor."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {name: f"advanced.{name}" for name in (
        "num_features", "l2", "epochs", "batch_size", "initial_accumulator", "replay_batches", "root_epochs",
        "max_logit_step", "calibration_batches", "calibration_prior", "calibration_margin", "calibration_max_slope")}
    """Keys moved into `advanced` (old -> new): a config or run folder from before still loads (`config.from_dict`)."""

    def __post_init__(self) -> None:
        check_range(self, "max_ngram", ge=1)
        check_range(self, "learning_rate", gt=0)
        check_range(self, "guard_window", ge=1)


def _config_from_state(saved: dict) -> PredictorConfig:
    """The config a predictor state was saved with: nested, or flat as before `advanced` existed;
    fields removed since are left out, fields added since take their defaults."""
    main = {f.name for f in fields(PredictorConfig)} - {"advanced"}
    tuned = {f.name for f in fields(PredictorAdvanced)}
    advanced = {**{k: v for k, v in saved.items() if k in tuned}, **dict(saved.get("advanced") or {})}
    return PredictorConfig(**{k: v for k, v in saved.items() if k in main},
                           advanced=PredictorAdvanced(**{k: v for k, v in advanced.items() if k in tuned}))


class HashedNgramPredictor:
    """Ṽψ over hashed n-gram features of the prompt and turns; see the module docstring and
    `PredictorConfig` for the settings. `seed` seeds the minibatch order."""

    def __init__(self, config: PredictorConfig | None = None, *, seed: int = 0) -> None:
        self.config = PredictorConfig() if config is None else config
        self.seed = int(seed)
        size, start = self.config.advanced.num_features, self.config.advanced.initial_accumulator
        self._shared = _Logistic(size, start)  # every example; answers for prefixes
        self._root = _Logistic(size, start)  # root examples only; answers for roots
        self._replay: list[tuple[list[str], np.ndarray, np.ndarray]] = []  # per earlier update: root (prompts, targets, weights)
        self._calibration_data: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {head: [] for head in _HEADS}
        """Per head, per update: (design [raw logit, summary features, 1], targets, weights), oldest first."""
        self.calibration: dict[str, np.ndarray] = {head: _identity(head) for head in _HEADS}
        """Per head, the coefficients (a, β..., c) of p = σ(a z + β·s + c)."""
        self.calibrated: dict[str, bool] = {head: False for head in _HEADS}
        """Per head, whether it answers calibrated (prefixes: once fitted; roots: while it beats the raw logits)."""
        self._rng = np.random.default_rng(self.seed)
        self.num_updates = 0
        self._reset_caches()

    def _reset_caches(self) -> None:
        """Feature caches: derived from the config alone, so never part of the state."""
        self._word_cache: dict[str, int] = {}
        self._text_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._turn_cache: dict[Turn, tuple[np.ndarray, np.ndarray, int]] = {}
        self._words_cache: dict[str, frozenset[str]] = {}  # words of a prompt or an observation
        self._query_cache: dict[str, tuple[str, ...]] = {}  # words of an action, markup removed
        self._lengths: dict[str, int] = {}  # words in a prompt
        hashes, _ = self._gram_hashes([str(d) for d in range(_MAX_DEPTH_FEATURE + 1)])  # one word each
        self._depth_index = list(self._index(hashes, _salt("d:"))[:, None])

    # ------------------------------------------------------------ features

    def _gram_hashes(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Hashes of every word 1..max_ngram-gram of each text, grouped text by text, and the count per text.

        Words hash with CRC32; an n-gram's hash folds the next word's hash into the (n-1)-gram's, so
        all n-grams of all texts are hashed in a few numpy operations rather than one call each.
        """
        tokens = [_WORD.findall(text.lower()) for text in texts]
        words_per_text = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        known = self._word_cache
        if len(known) > _CACHE_LIMIT:
            known.clear()
        for word in {w for t in tokens for w in t}.difference(known):
            known[word] = zlib.crc32(word.encode())
        words = np.array([known[w] for t in tokens for w in t], dtype=np.uint64)
        owner = np.repeat(np.arange(len(texts)), words_per_text)
        hashes, owners, gram = [words], [owner], words
        for n in range(2, self.config.max_ngram + 1):
            gram = (gram[:-1] * np.uint64(0x9E3779B1) + words[n - 1 :]) & np.uint64(0xFFFFFFFF)  # starts at i
            within = owner[: gram.size] == owner[n - 1 :]  # all n words in one text
            hashes.append(gram[within])
            owners.append(owner[: gram.size][within])
        owner = np.concatenate(owners)
        order = np.argsort(owner, kind="stable")
        return np.concatenate(hashes)[order].astype(np.uint32), np.bincount(owner, minlength=len(texts))

    def _index(self, hashes: np.ndarray, salts: np.uint32 | np.ndarray) -> np.ndarray:
        # XOR with the namespace's own CRC keeps namespaces apart at the cost of one numpy op.
        return ((hashes ^ salts) % np.uint32(self.config.advanced.num_features)).astype(np.int64)

    def _cache_prompts(self, prompts: list[str]) -> None:
        """Features of new prompts: (for every history of the prompt, extra for its root only)."""
        hashes, counts = self._gram_hashes(prompts)
        shared, root_only = self._index(hashes, _salt("p:")), self._index(hashes, _salt("r:"))
        ends = np.cumsum(counts)
        for prompt, end, count in zip(prompts, ends.tolist(), counts.tolist()):
            self._text_cache[prompt] = (shared[end - count : end], root_only[end - count : end])

    def _cache_turns(self, turns: list[Turn]) -> None:
        """Features of new turns: (as one of all turns, as the last turn, and their sizes)."""
        texts = [text for turn in turns for text in (turn.thought, turn.action, turn.observation)]
        hashes, counts = self._gram_hashes(texts)
        every = self._index(hashes, np.repeat(np.tile(_TURN_SALTS, len(turns)), counts))
        last = self._index(hashes, np.repeat(np.tile(_LAST_SALTS, len(turns)), counts))
        per_turn = counts.reshape(-1, 3).sum(axis=1)
        for turn, end, count in zip(turns, np.cumsum(per_turn).tolist(), per_turn.tolist()):
            self._turn_cache[turn] = (every[end - count : end], last[end - count : end], count)

    def features(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """Sparse features of a batch as (rows, indices): entry k is feature indices[k] of history rows[k]."""
        wanted_prompts = dict.fromkeys(h.prompt for h in histories)
        wanted_turns = dict.fromkeys(t for h in histories for t in h.turns)
        if len(self._text_cache) + len(wanted_prompts) > _CACHE_LIMIT:  # bound memory: start afresh
            self._text_cache.clear()
        if len(self._turn_cache) + len(wanted_turns) > _CACHE_LIMIT:
            self._turn_cache.clear()
        new_prompts = [p for p in wanted_prompts if p not in self._text_cache]
        new_turns = [t for t in wanted_turns if t not in self._turn_cache]
        if new_prompts:
            self._cache_prompts(new_prompts)
        if new_turns:
            self._cache_turns(new_turns)
        prompts, turns_cache = self._text_cache, self._turn_cache
        parts: list[np.ndarray] = []
        lengths = np.zeros(len(histories), dtype=np.int64)
        for row, history in enumerate(histories):
            shared, root_only = prompts[history.prompt]
            depth = self._depth_index[min(len(history.turns), _MAX_DEPTH_FEATURE)]
            parts.append(shared)
            if history.turns and not self.config.turn_features:
                size = shared.size
            elif history.turns:
                turns = [turns_cache[turn] for turn in history.turns]
                parts.extend(t[0] for t in turns)
                parts.append(turns[-1][1])
                size = shared.size + sum(t[2] for t in turns) + turns[-1][2]
            else:
                parts.append(root_only)
                size = 2 * shared.size
            parts.append(depth)
            lengths[row] = size + depth.size
        indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        rows = np.repeat(np.arange(len(histories), dtype=np.int64), lengths)
        return rows, indices

    def _root_features(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The root head's sparse features (`r:` n-grams of each prompt) as (rows, indices)."""
        new = [p for p in dict.fromkeys(prompts) if p not in self._text_cache]
        if len(self._text_cache) + len(new) > _CACHE_LIMIT:
            self._text_cache.clear()
            new = list(dict.fromkeys(prompts))
        if new:
            self._cache_prompts(new)
        parts = [self._text_cache[p][1] for p in prompts]
        lengths = np.fromiter((part.size for part in parts), dtype=np.int64, count=len(parts))
        indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return np.repeat(np.arange(len(prompts), dtype=np.int64), lengths), indices

    def _words(self, text: str) -> frozenset[str]:
        words = self._words_cache.get(text)
        if words is None:
            if len(self._words_cache) > _CACHE_LIMIT:
                self._words_cache.clear()
            words = self._words_cache[text] = frozenset(_WORD.findall(text.lower()))
        return words

    def _summary(self, history: History) -> list[float]:
        """The calibration's summary features of a history (see the module docstring): for a root the
        prompt-length bins; for a prefix the novel words of its last action (exactly 1, 2 or more, no
        words at all), whether that action repeats an earlier one, then the prompt-length bins."""
        length = self._lengths.get(history.prompt)
        if length is None:
            if len(self._lengths) > _CACHE_LIMIT:
                self._lengths.clear()
            length = self._lengths[history.prompt] = len(_WORD.findall(history.prompt.lower()))
        bins = [float(low <= length < high) for low, high in zip(_PROMPT_LENGTHS, (*_PROMPT_LENGTHS[1:], np.inf))]
        if not history.turns:
            return bins
        last = history.turns[-1]
        query = self._query_cache.get(last.action)
        if query is None:
            if len(self._query_cache) > _CACHE_LIMIT:
                self._query_cache.clear()
            query = self._query_cache[last.action] = tuple(_WORD.findall(_MARKUP.sub(" ", last.action).lower()))
        seen = [self._words(history.prompt), *(self._words(turn.observation) for turn in history.turns[:-1])]
        novel = sum(1 for word in query if not any(word in words for words in seen))
        repeat = any(turn.action == last.action for turn in history.turns[:-1])
        return [float(novel == 1), float(novel >= 2), float(not query), float(repeat), *bins]

    def _design(self, histories: Sequence[History], z: np.ndarray) -> np.ndarray:
        """Calibration rows [raw logit, summary features, 1] of (non-empty) histories of one head."""
        summary = np.array([self._summary(h) for h in histories], dtype=np.float64)
        return np.column_stack([z, summary, np.ones(len(histories))])

    # ------------------------------------------------------------ model

    def _raw_logits(self, histories: Sequence[History]) -> tuple[np.ndarray, np.ndarray]:
        """Uncalibrated logits (root head for roots, shared model for prefixes) and the root mask."""
        is_root = np.fromiter((not h.turns for h in histories), dtype=bool, count=len(histories))
        z = np.empty(len(histories), dtype=np.float64)
        roots = [h.prompt for h, root in zip(histories, is_root) if root]
        prefixes = [h for h, root in zip(histories, is_root) if not root]
        if roots:
            z[is_root] = self._root.logits(*self._root_features(roots), len(roots))
        if prefixes:
            z[~is_root] = self._shared.logits(*self.features(prefixes), len(prefixes))
        return z, is_root

    def _heads(
        self, histories: Sequence[History], z: np.ndarray, is_root: np.ndarray, *, only_calibrated: bool = False
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per head with histories in the batch (and in use, if `only_calibrated`): (their positions, their design rows)."""
        out = {}
        for head, mask in (("root", is_root), ("prefix", ~is_root)):
            where = np.flatnonzero(mask)
            if where.size and (self.calibrated[head] or not only_calibrated):
                out[head] = (where, self._design([histories[i] for i in where], z[where]))
        return out

    def _calibrated_logits(self, z: np.ndarray, heads: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The logits the predictor answers with: each head's calibration where it is in use, else raw
        `z`. `heads` from `_heads` (its designs' first column is overwritten with `z`)."""
        out = z.copy()
        for head, (where, design) in heads.items():
            if self.calibrated[head]:
                design[:, 0] = z[where]
                out[where] = design @ self.calibration[head]
        return out

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Success probability from each history, float64 in [0, 1]; exactly 0.5 before any update."""
        z, is_root = self._raw_logits(histories)
        return _sigmoid(self._calibrated_logits(z, self._heads(histories, z, is_root, only_calibrated=True)))

    def update(
        self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        """One online step: refit each head's calibration and decide whether it is used, then train
        both models (see the module docstring).

        The shared model makes `epochs` passes over the batch plus the replayed root examples, the
        root head `root_epochs` passes over the batch's and the replayed root examples, in seeded
        order. Returns `predictor/loss` (weighted cross-entropy of the predictions made before the
        update: an out-of-sample figure), `predictor/loss_after`, `predictor/examples`,
        `predictor/replayed` (root examples trained on again), `predictor/step_capped` (share of
        minibatch steps `max_logit_step` scaled down), and per head (`root_`: the root head's; none:
        the prefixes') `predictor/calibration_slope`, `predictor/calibration_intercept` and
        `predictor/calibrated` (1 while the calibration is used). Raises ValueError for mismatched
        lengths, NaN or out-of-range targets.
        """
        y, w = check_training_batch(histories, targets, weights)
        count = len(histories)
        if count == 0 or w.sum() <= 0.0:
            return {"predictor/loss": 0.0, "predictor/loss_after": 0.0, "predictor/examples": 0.0}
        z, is_root = self._raw_logits(histories)
        heads = self._heads(histories, z, is_root, only_calibrated=not self.config.advanced.calibration_batches)
        loss_before = _cross_entropy(self._calibrated_logits(z, heads), y, w)
        if self.config.advanced.calibration_batches:
            for head, (where, design) in heads.items():
                window = [*self._calibration_data[head], (design.copy(), y[where], w[where])][-self.config.advanced.calibration_batches :]
                self._calibration_data[head] = window
                self.calibration[head] = _fit_calibration(*(np.concatenate(column) for column in zip(*window)), config=self.config)
                self.calibrated[head] = head == "prefix" or bool(_calibration_helps(window, self.config))

        # Shared model: this whole batch, then the replayed roots. Root head: this batch's roots, then the replayed ones.
        old_prompts = [p for prompts, _, _ in self._replay for p in prompts]
        old_y = np.concatenate([np.zeros(0), *(t for _, t, _ in self._replay)])
        old_w = np.concatenate([np.zeros(0), *(v for _, _, v in self._replay)])
        rows, indices = self.features([*histories, *(History(p) for p in old_prompts)])
        shared = (_row_starts(rows, count + len(old_prompts)), indices, np.concatenate([y, old_y]), np.concatenate([w, old_w]))
        steps, capped = self._shared.fit(*shared, epochs=self.config.advanced.epochs, config=self.config, rng=self._rng)
        roots = np.flatnonzero(is_root)
        new_prompts = [histories[i].prompt for i in roots]
        rows, indices = self._root_features(new_prompts + old_prompts)
        root_y, root_w = np.concatenate([y[roots], old_y]), np.concatenate([w[roots], old_w])
        root = (_row_starts(rows, roots.size + len(old_prompts)), indices, root_y, root_w)
        root_steps, root_capped = self._root.fit(*root, epochs=self.config.advanced.root_epochs, config=self.config, rng=self._rng)

        if self.config.advanced.replay_batches:
            self._replay = [*self._replay, (new_prompts, y[roots].copy(), w[roots].copy())][-self.config.advanced.replay_batches :]
        self.num_updates += 1
        z_after, _ = self._raw_logits(histories)
        metrics = {
            "predictor/loss": loss_before,
            "predictor/loss_after": _cross_entropy(self._calibrated_logits(z_after, heads), y, w),
            "predictor/examples": float(count),
            "predictor/replayed": float(len(old_prompts)),
            "predictor/step_capped": (capped + root_capped) / max(steps + root_steps, 1),
        }
        for head, prefix in (("prefix", ""), ("root", "root_")):
            metrics[f"predictor/{prefix}calibration_slope"] = float(self.calibration[head][0])
            metrics[f"predictor/{prefix}calibration_intercept"] = float(self.calibration[head][-1])
            metrics[f"predictor/{prefix}calibrated"] = float(self.calibrated[head])
        return metrics

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything `update` and `predict` depend on, copied: resuming reproduces both exactly."""
        return {
            "kind": "hashed_ngram",
            "version": _STATE_VERSION,
            "config": asdict(self.config),
            "seed": self.seed,
            "shared": self._shared.state(),
            "root": self._root.state(),
            "replay": [{"prompts": list(p), "targets": t.copy(), "weights": v.copy()} for p, t, v in self._replay],
            "calibration": {head: self.calibration[head].copy() for head in _HEADS},
            "calibrated": dict(self.calibrated),
            "calibration_data": {
                head: [{"design": x.copy(), "targets": t.copy(), "weights": v.copy()} for x, t, v in self._calibration_data[head]]
                for head in _HEADS
            },
            "rng": self._rng.bit_generator.state,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "hashed_ngram":
            raise ValueError(f"state kind must be 'hashed_ngram', got {state.get('kind')!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state version must be {_STATE_VERSION}, got {state.get('version')!r}: it was saved by an older "
                "HashedNgramPredictor (version 1: one model, no replay buffer; 2: an unbounded Platt scaling of "
                "prefixes, no step cap), which cannot be resumed exactly"
            )
        config = _config_from_state(state["config"])
        size = config.advanced.num_features
        shared, root = _Logistic(size, config.advanced.initial_accumulator), _Logistic(size, config.advanced.initial_accumulator)
        shared.load(state["shared"], size)
        root.load(state["root"], size)
        calibration = {head: np.asarray(state["calibration"][head], dtype=np.float64).copy() for head in _HEADS}
        for head in _HEADS:
            if calibration[head].shape != _identity(head).shape:
                raise ValueError(f"calibration of the {head} head must have shape {_identity(head).shape}, got {calibration[head].shape}")
        self.config = config
        self.seed = int(state.get("seed", state["config"].get("seed", 0)))
        self._reset_caches()  # cached indices may belong to another feature space
        self._shared, self._root = shared, root
        self._replay = [
            ([str(p) for p in b["prompts"]], np.asarray(b["targets"], dtype=np.float64).copy(), np.asarray(b["weights"], dtype=np.float64).copy())
            for b in state["replay"]
        ]
        self.calibration = calibration
        self.calibrated = {head: bool(state["calibrated"][head]) for head in _HEADS}
        self._calibration_data = {
            head: [tuple(np.asarray(b[k], dtype=np.float64).copy() for k in ("design", "targets", "weights")) for b in state["calibration_data"][head]]
            for head in _HEADS
        }
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self.num_updates = int(state["num_updates"])


def _identity(head: str) -> np.ndarray:
    """The calibration that changes nothing: slope 1 on the raw logit, 0 on the summary features and the
    intercept (a root has the prompt-length bins, a prefix four more features)."""
    theta = np.zeros(2 + len(_PROMPT_LENGTHS) + (4 if head == "prefix" else 0))
    theta[0] = 1.0
    return theta


def _fit_calibration(design: np.ndarray, y: np.ndarray, w: np.ndarray, *, config: PredictorConfig) -> np.ndarray:
    """Coefficients θ minimising the weighted cross-entropy of σ(design θ) against y plus
    `calibration_prior`·|θ − identity|²/2 per unit of weight, with the slope θ[0] kept in
    [0, `calibration_max_slope`]: Newton's method with a backtracking line search on a small, strongly
    convex problem (the prior keeps it well posed when the logits barely vary or a summary feature
    never fires). The line search matters: from the identity, with raw logits of tens (an over-confident
    model), a full Newton step overshoots and plain Newton wandered off (a real run's prefix
    calibration reached an intercept of -60 and answered with saturated estimates, loss 17-32, for
    seven steps). When the slope falls outside its bounds it is fixed at the nearer one and the rest
    refitted, which is exact for a convex objective with one bounded coordinate."""
    w = w / w.sum()
    prior, dims = config.advanced.calibration_prior, design.shape[1]
    start = np.zeros(dims)
    start[0] = 1.0

    def objective(theta: np.ndarray) -> float:
        z = design @ theta
        return float(np.sum(w * (np.logaddexp(0.0, z) - y * z)) + 0.5 * prior * np.sum((theta - start) ** 2))

    theta, free = start.copy(), np.ones(dims, dtype=bool)
    for _ in range(2):
        value = objective(theta)
        for _ in range(100):
            p = _sigmoid(design @ theta)
            grad = design.T @ (w * (p - y)) + prior * (theta - start)
            hess = (design * (w * p * (1.0 - p))[:, None]).T @ design + prior * np.eye(dims)
            step = np.zeros(dims)
            step[free] = np.linalg.solve(hess[np.ix_(free, free)], grad[free])
            decrease = float(grad @ step)  # > 0: the Newton direction descends (the Hessian is positive definite)
            size = 1.0
            while (trial := objective(theta - size * step)) > value - 1e-4 * size * decrease and size > 1e-10:
                size *= 0.5
            if trial > value:  # no descent left at this precision: converged
                break
            theta, value = theta - size * step, trial
            if np.abs(size * step).max() < 1e-9:
                break
        if 0.0 <= theta[0] <= config.advanced.calibration_max_slope:
            break
        theta[0] = float(np.clip(theta[0], 0.0, config.advanced.calibration_max_slope))
        free[0] = False
    return theta


def _calibration_helps(window: list[tuple[np.ndarray, np.ndarray, np.ndarray]], config: PredictorConfig) -> bool:
    """Whether, predicting each update of the window with the calibration fitted on the others, the
    calibrated logits have a lower weighted cross-entropy than the raw ones (False below two updates)."""
    if len(window) < 2:
        return False
    raw = calibrated = 0.0
    for held_out in range(len(window)):
        rest = [batch for index, batch in enumerate(window) if index != held_out]
        theta = _fit_calibration(*(np.concatenate(column) for column in zip(*rest)), config=config)
        design, y, w = window[held_out]
        raw += _cross_entropy(design[:, 0], y, w) * w.sum()
        calibrated += _cross_entropy(design @ theta, y, w) * w.sum()
    return calibrated < (1.0 - config.advanced.calibration_margin) * raw


def _fit_platt(z: np.ndarray, y: np.ndarray, w: np.ndarray, config: PredictorConfig | None = None) -> tuple[float, float]:
    """Platt scaling: slope a and intercept c of σ(a z + c), fitted like a calibration without summary
    features (`_fit_calibration`)."""
    theta = _fit_calibration(np.column_stack([z, np.ones_like(z)]), y, w, config=config or PredictorConfig())
    return float(theta[0]), float(theta[1])


def _cross_entropy(z: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    ce = np.logaddexp(0.0, z) - y * z  # cross-entropy of σ(z) with a fractional target, stable for any z
    return float(np.sum(w * ce) / np.sum(w))


def _row_starts(rows: np.ndarray, count: int) -> np.ndarray:
    """CSR row starts of sorted row ids: row r's entries are [starts[r], starts[r + 1])."""
    return np.searchsorted(rows, np.arange(count + 1))


def _gather_rows(starts: np.ndarray, indices: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The entries of `rows` from a CSR layout, renumbered 0..len(rows)-1: (local row ids, feature indices)."""
    spans = starts[rows + 1] - starts[rows]
    local = np.repeat(np.arange(rows.size), spans)
    first = np.cumsum(spans) - spans  # where each row begins in the output
    positions = np.arange(spans.sum()) - first[local] + starts[rows][local]
    return local, indices[positions]


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # tanh form: exact 0.5 at z = 0 and no overflow for large |z|.
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))
