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

Two logistic regressions p = σ(b + Σ w_j) read these features, each trained with AdaGrad on
cross-entropy against fractional targets (tree backup values), with L2 on the weights a minibatch
touches:

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
root error of the three (all figures on the simulator, `trace_rl.bench`). The shared model still
learns from roots: that is how its prompt weights, which prefixes use, learn what a prompt is worth
(without them its held-out prefix error rises by a third).

Why replay: each update sees one batch, roots of a batch are few, and Stage 1 stops sampling the
prompts it believes hopeless, so a predictor that forgets old batches also forgets why it believed
that (recent data over-represents the prompts it kept) and drifts back. Both models therefore train
on the root examples of the last `replay_batches` updates as well (kept as prompt text, target and
weight: small, and in the state), and the root head makes `root_epochs` passes over them. On the
simulator this lowers the held-out root error by 16-19%.

Why calibration: out of sample the shared model is over-confident on prefixes (a fitted slope of
about 0.8 in log-odds on the simulator). Before each update, its logits for the new batch's prefix
examples are out-of-sample predictions; a Platt scaling p = σ(a z + c), fitted on those of the last
`calibration_batches` updates (a weak prior pulls it towards a = 1, c = 0), corrects it: the squared
error against the truth on the nodes the allocator asks about falls by 4-5%. Roots are left raw: on
the root head it brought no consistent held-out gain and made Stage 1 sample more prompts.

All weights start at zero and the calibration at the identity, so every prediction is exactly 0.5
until the first update. A word hashes to CRC32(word) and an n-gram folds the next word in
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
from dataclasses import asdict, dataclass, fields

import numpy as np

from trace_rl.predictor.base import check_training_batch
from trace_rl.tree import History, Turn

_WORD = re.compile(r"[a-z0-9]+")
_MAX_DEPTH_FEATURE = 16
_CACHE_LIMIT = 200_000
_STATE_VERSION = 2
_CALIBRATION_PRIOR = 0.01
"""Strength of the pull of the Platt scaling towards the identity, as a share of its data's weight."""


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
    ) -> None:
        """`epochs` AdaGrad passes of weighted cross-entropy over the CSR examples, minibatches in `rng` order."""
        lr, l2, size = config.learning_rate, config.l2, config.batch_size
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
                self.accum[touched] += grad**2
                self.weights[touched] -= lr * grad / np.sqrt(self.accum[touched])
                grad_bias = float(residual.sum())
                self.accum_bias += grad_bias**2
                self.bias -= lr * grad_bias / np.sqrt(self.accum_bias)

    def state(self) -> dict:
        return {"weights": self.weights.copy(), "bias": self.bias, "accum": self.accum.copy(), "accum_bias": self.accum_bias}

    def load(self, state: dict, size: int) -> None:
        weights = np.asarray(state["weights"], dtype=np.float64)
        accum = np.asarray(state["accum"], dtype=np.float64)
        if weights.shape != (size,) or accum.shape != weights.shape:
            raise ValueError(f"weights and accum must have shape ({size},), got {weights.shape}, {accum.shape}")
        self.weights, self.accum = weights.copy(), accum.copy()
        self.bias, self.accum_bias = float(state["bias"]), float(state["accum_bias"])


@dataclass
class PredictorConfig:
    """Settings of the shared predictor Ṽψ (`HashedNgramPredictor`): the run config's `predictor` section.

    Their defaults live here and nowhere else.
    """

    num_features: int = 2**18
    """Size of each hashed weight vector (collisions are rare well below it)."""
    max_ngram: int = 2
    """Longest word n-gram (1 = words only, 2 = words and word pairs)."""
    learning_rate: float = 0.3
    """AdaGrad step size."""
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
    words); 1e-3 gave the best held-out error on the simulator (`trace_rl.bench`)."""
    replay_batches: int = 64
    """Earlier updates whose root examples both models train on again (0: none). Bounds the buffer; in a
    stationary world more is better (on the simulator keeping 20 batches instead of all 40 raised the
    held-out root error by 12%), while a policy that keeps improving makes old roots stale."""
    root_epochs: int = 8
    """Passes of the root head over the (current and replayed) root examples per update; 4 fits less,
    16 no better than 8 on the simulator."""
    calibration_batches: int = 10
    """Updates whose out-of-sample prefix logits fit the Platt scaling of prefix predictions (0: none)."""

    def __post_init__(self) -> None:
        if self.num_features < 2:
            raise ValueError(f"num_features must be >= 2, got {self.num_features}")
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {self.max_ngram}")
        if not self.learning_rate > 0.0 or not np.isfinite(self.learning_rate):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if not self.l2 >= 0.0 or not np.isfinite(self.l2):
            raise ValueError(f"l2 must be a finite number >= 0, got {self.l2}")
        if not self.initial_accumulator > 0.0 or not np.isfinite(self.initial_accumulator):
            raise ValueError(f"initial_accumulator must be a finite number > 0, got {self.initial_accumulator}")
        if self.epochs < 1 or self.batch_size < 1 or self.root_epochs < 1:
            raise ValueError(
                f"epochs, root_epochs and batch_size must be >= 1, got {self.epochs}, {self.root_epochs} and {self.batch_size}"
            )
        if self.replay_batches < 0 or self.calibration_batches < 0:
            raise ValueError(
                f"replay_batches and calibration_batches must be >= 0, got {self.replay_batches} and {self.calibration_batches}"
            )


class HashedNgramPredictor:
    """Ṽψ over hashed n-gram features of the prompt and turns; see the module docstring and
    `PredictorConfig` for the settings. `seed` seeds the minibatch order."""

    def __init__(self, config: PredictorConfig | None = None, *, seed: int = 0) -> None:
        self.config = PredictorConfig() if config is None else config
        self.seed = int(seed)
        size, start = self.config.num_features, self.config.initial_accumulator
        self._shared = _Logistic(size, start)  # every example; answers for prefixes
        self._root = _Logistic(size, start)  # root examples only; answers for roots
        self._replay: list[tuple[list[str], np.ndarray, np.ndarray]] = []  # per earlier update: root (prompts, targets, weights)
        self._calibration_data: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per update: prefix (logits, targets, weights)
        self.calibration = (1.0, 0.0)  # Platt slope a and intercept c of prefix predictions: σ(a z + c)
        self._rng = np.random.default_rng(self.seed)
        self.num_updates = 0
        self._reset_caches()

    def _reset_caches(self) -> None:
        """Feature caches: derived from the config alone, so never part of the state."""
        self._word_cache: dict[str, int] = {}
        self._text_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._turn_cache: dict[Turn, tuple[np.ndarray, np.ndarray, int]] = {}
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
        return ((hashes ^ salts) % np.uint32(self.config.num_features)).astype(np.int64)

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
            if history.turns:
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

    def _calibrate(self, z: np.ndarray, is_root: np.ndarray) -> np.ndarray:
        slope, intercept = self.calibration
        return np.where(is_root, z, slope * z + intercept)

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Success probability from each history, float64 in [0, 1]; exactly 0.5 before any update."""
        z, is_root = self._raw_logits(histories)
        return _sigmoid(self._calibrate(z, is_root))

    def update(
        self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        """One online step: refit the prefix calibration, then train both models (see the module docstring).

        The shared model makes `epochs` passes over the batch plus the replayed root examples, the
        root head `root_epochs` passes over the batch's and the replayed root examples, in seeded
        order. Returns `predictor/loss` (weighted cross-entropy of the predictions made before the
        update: an out-of-sample figure), `predictor/loss_after`, `predictor/examples`,
        `predictor/replayed` (root examples trained on again) and the calibration's
        `predictor/calibration_slope` and `predictor/calibration_intercept`. Raises ValueError for
        mismatched lengths, NaN or out-of-range targets.
        """
        y, w = check_training_batch(histories, targets, weights)
        count = len(histories)
        if count == 0 or w.sum() <= 0.0:
            return {"predictor/loss": 0.0, "predictor/loss_after": 0.0, "predictor/examples": 0.0}
        z, is_root = self._raw_logits(histories)
        loss_before = _cross_entropy(self._calibrate(z, is_root), y, w)
        if self.config.calibration_batches and self.num_updates and (~is_root).any():  # untrained logits say nothing
            prefix = ~is_root
            self._calibration_data = [*self._calibration_data, (z[prefix], y[prefix], w[prefix])][-self.config.calibration_batches :]
            self.calibration = _fit_platt(*(np.concatenate(column) for column in zip(*self._calibration_data)))

        # Shared model: this whole batch, then the replayed roots. Root head: this batch's roots, then the replayed ones.
        old_prompts = [p for prompts, _, _ in self._replay for p in prompts]
        old_y = np.concatenate([np.zeros(0), *(t for _, t, _ in self._replay)])
        old_w = np.concatenate([np.zeros(0), *(v for _, _, v in self._replay)])
        rows, indices = self.features([*histories, *(History(p) for p in old_prompts)])
        shared = (_row_starts(rows, count + len(old_prompts)), indices, np.concatenate([y, old_y]), np.concatenate([w, old_w]))
        self._shared.fit(*shared, epochs=self.config.epochs, config=self.config, rng=self._rng)
        roots = np.flatnonzero(is_root)
        new_prompts = [histories[i].prompt for i in roots]
        rows, indices = self._root_features(new_prompts + old_prompts)
        root_y, root_w = np.concatenate([y[roots], old_y]), np.concatenate([w[roots], old_w])
        root = (_row_starts(rows, roots.size + len(old_prompts)), indices, root_y, root_w)
        self._root.fit(*root, epochs=self.config.root_epochs, config=self.config, rng=self._rng)

        if self.config.replay_batches:
            self._replay = [*self._replay, (new_prompts, y[roots].copy(), w[roots].copy())][-self.config.replay_batches :]
        self.num_updates += 1
        z_after, _ = self._raw_logits(histories)
        return {
            "predictor/loss": loss_before,
            "predictor/loss_after": _cross_entropy(self._calibrate(z_after, is_root), y, w),
            "predictor/examples": float(count),
            "predictor/replayed": float(len(old_prompts)),
            "predictor/calibration_slope": self.calibration[0],
            "predictor/calibration_intercept": self.calibration[1],
        }

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
            "calibration": list(self.calibration),
            "calibration_data": [
                {"logits": z.copy(), "targets": t.copy(), "weights": v.copy()} for z, t, v in self._calibration_data
            ],
            "rng": self._rng.bit_generator.state,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "hashed_ngram":
            raise ValueError(f"state kind must be 'hashed_ngram', got {state.get('kind')!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state version must be {_STATE_VERSION}, got {state.get('version')!r}: it was saved by an older "
                "HashedNgramPredictor (one model, no replay buffer), which cannot be resumed exactly"
            )
        known = {f.name for f in fields(PredictorConfig)}
        config = PredictorConfig(**{k: v for k, v in state["config"].items() if k in known})
        size = config.num_features
        shared, root = _Logistic(size, config.initial_accumulator), _Logistic(size, config.initial_accumulator)
        shared.load(state["shared"], size)
        root.load(state["root"], size)
        self.config = config
        self.seed = int(state.get("seed", state["config"].get("seed", 0)))
        self._reset_caches()  # cached indices may belong to another feature space
        self._shared, self._root = shared, root
        self._replay = [
            ([str(p) for p in b["prompts"]], np.asarray(b["targets"], dtype=np.float64).copy(), np.asarray(b["weights"], dtype=np.float64).copy())
            for b in state["replay"]
        ]
        self._calibration_data = [
            tuple(np.asarray(b[k], dtype=np.float64).copy() for k in ("logits", "targets", "weights")) for b in state["calibration_data"]
        ]
        self.calibration = (float(state["calibration"][0]), float(state["calibration"][1]))
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self.num_updates = int(state["num_updates"])


def _fit_platt(z: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Slope a and intercept c minimising the weighted cross-entropy of σ(a z + c) against y, plus
    `_CALIBRATION_PRIOR`·((a − 1)² + c²)/2 per unit of weight: Newton's method (a convex problem of
    two unknowns, the prior keeps it well posed when the logits barely vary)."""
    w = w / w.sum()
    a, c = 1.0, 0.0
    for _ in range(50):
        p = _sigmoid(a * z + c)
        r, s = w * (p - y), w * p * (1.0 - p)
        grad = np.array([np.dot(r, z) + _CALIBRATION_PRIOR * (a - 1.0), r.sum() + _CALIBRATION_PRIOR * c])
        hess = np.array([[np.dot(s, z * z), np.dot(s, z)], [np.dot(s, z), s.sum()]]) + _CALIBRATION_PRIOR * np.eye(2)
        step = np.linalg.solve(hess, grad)
        a, c = a - float(step[0]), c - float(step[1])
        if np.abs(step).max() < 1e-9:
            break
    return a, c


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
