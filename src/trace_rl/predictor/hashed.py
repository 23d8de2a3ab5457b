"""A fast text-feature success predictor: hashed word n-grams and online logistic regression.

Features of a history (each an index into a hashed weight vector, value 1 per occurrence, so a
repeated n-gram counts twice):

- `p:` word 1..max_ngram-grams of the prompt, for every history (what the task is about: carries
  difficulty across prompts);
- `r:` the same n-grams again, for the root only. Without them one weight per prompt word serves
  both the root, where the prompt is all there is, and deep prefixes, where the turns' evidence
  matters more; the compromise squeezes root estimates towards the middle, which is exactly where
  Stage 1 must tell a 0.5% prompt from a 5% one;
- `t<field>:` n-grams of every turn so far, per field (thought / action / observation);
- `l<field>:` n-grams of the last turn only (the most recent evidence weighs on its own);
- `d:` the depth (number of turns), capped at 16.

The model is logistic regression p = σ(b + Σ w_j) trained with AdaGrad on cross-entropy against
fractional targets (tree backup values), with L2 on the weights a minibatch touches. All weights
start at zero, so every prediction is exactly 0.5 until the first update. A word hashes to
CRC32(word) and an n-gram folds the next word in (h·0x9E3779B1 + CRC32(word) mod 2³²); a feature's
index is that hash XOR CRC32(namespace) mod num_features. This is stable across runs and processes
(unlike Python's salted `hash`), and minibatch order comes from a seeded generator, so training is
deterministic given the seed. Features of each distinct prompt and turn are computed once, in bulk,
and cached (a tree's histories share their prefixes).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import numpy as np

from trace_rl.predictor.base import check_training_batch
from trace_rl.tree import History, Turn

_WORD = re.compile(r"[a-z0-9]+")
_MAX_DEPTH_FEATURE = 16
_CACHE_LIMIT = 200_000


def _salt(namespace: str) -> np.uint32:
    return np.uint32(zlib.crc32(namespace.encode()))


_TURN_SALTS = np.array([_salt("th:"), _salt("ta:"), _salt("to:")], dtype=np.uint32)  # every turn: thought, action, observation
_LAST_SALTS = np.array([_salt("lh:"), _salt("la:"), _salt("lo:")], dtype=np.uint32)  # the last turn


class HashedNgramPredictor:
    """Ṽψ over hashed n-gram features of the prompt and turns; see the module docstring.

    Args:
        num_features: size of the hashed weight vector (collisions are rare well below it).
        max_ngram: longest word n-gram (1 = words only, 2 = words and word pairs).
        learning_rate: AdaGrad step size.
        l2: L2 penalty on the weights touched by a minibatch (the bias is not penalised).
        epochs: passes over the examples per `update` call.
        batch_size: minibatch size within an epoch.
        initial_accumulator: AdaGrad's starting Σ g². A feature's step is lr·g/sqrt(this + Σ g²).
            At 0 the first touch of any feature moves it by a full lr, so n-grams seen once (most of
            them) memorise that example's target; a positive start lets a rare feature's small
            gradient move it little, while frequent features soon outgrow the start. Too large a
            start also slows informative words of middling frequency (a topic's words); 1e-3 gave
            the best held-out error on the simulator (`trace_rl.bench`).
        seed: seeds the minibatch order.
    """

    def __init__(
        self,
        *,
        num_features: int = 2**18,
        max_ngram: int = 2,
        learning_rate: float = 0.3,
        l2: float = 1e-4,
        epochs: int = 2,
        batch_size: int = 256,
        initial_accumulator: float = 1e-3,
        seed: int = 0,
    ) -> None:
        self.config = {
            "num_features": int(num_features),
            "max_ngram": int(max_ngram),
            "learning_rate": float(learning_rate),
            "l2": float(l2),
            "epochs": int(epochs),
            "batch_size": int(batch_size),
            "initial_accumulator": float(initial_accumulator),
            "seed": int(seed),
        }
        self._check_config(self.config)
        self.weights = np.zeros(self.config["num_features"], dtype=np.float64)
        self.bias = 0.0
        # AdaGrad's Σ g², started at `initial_accumulator` (see the class docstring).
        self._accum = np.full(self.config["num_features"], self.config["initial_accumulator"], dtype=np.float64)
        self._accum_bias = self.config["initial_accumulator"]
        self._rng = np.random.default_rng(self.config["seed"])
        self.num_updates = 0
        self._reset_caches()

    def _reset_caches(self) -> None:
        """Feature caches: derived from the config alone, so never part of the state."""
        self._word_cache: dict[str, int] = {}
        self._text_cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._turn_cache: dict[Turn, tuple[np.ndarray, np.ndarray, int]] = {}
        hashes, _ = self._gram_hashes([str(d) for d in range(_MAX_DEPTH_FEATURE + 1)])  # one word each
        self._depth_index = list(self._index(hashes, _salt("d:"))[:, None])

    @staticmethod
    def _check_config(config: dict) -> None:
        if config["num_features"] < 2:
            raise ValueError(f"num_features must be >= 2, got {config['num_features']}")
        if config["max_ngram"] < 1:
            raise ValueError(f"max_ngram must be >= 1, got {config['max_ngram']}")
        if not config["learning_rate"] > 0.0:
            raise ValueError(f"learning_rate must be > 0, got {config['learning_rate']}")
        if config["l2"] < 0.0:
            raise ValueError(f"l2 must be >= 0, got {config['l2']}")
        if not config["initial_accumulator"] > 0.0:
            raise ValueError(f"initial_accumulator must be > 0, got {config['initial_accumulator']}")
        if config["epochs"] < 1 or config["batch_size"] < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {config['epochs']} and {config['batch_size']}")

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
        for n in range(2, self.config["max_ngram"] + 1):
            gram = (gram[:-1] * np.uint64(0x9E3779B1) + words[n - 1 :]) & np.uint64(0xFFFFFFFF)  # starts at i
            within = owner[: gram.size] == owner[n - 1 :]  # all n words in one text
            hashes.append(gram[within])
            owners.append(owner[: gram.size][within])
        owner = np.concatenate(owners)
        order = np.argsort(owner, kind="stable")
        return np.concatenate(hashes)[order].astype(np.uint32), np.bincount(owner, minlength=len(texts))

    def _index(self, hashes: np.ndarray, salts: np.uint32 | np.ndarray) -> np.ndarray:
        # XOR with the namespace's own CRC keeps namespaces apart at the cost of one numpy op.
        return ((hashes ^ salts) % np.uint32(self.config["num_features"])).astype(np.int64)

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

    # ------------------------------------------------------------ model

    def _logits(self, rows: np.ndarray, indices: np.ndarray, count: int) -> np.ndarray:
        return self.bias + np.bincount(rows, weights=self.weights[indices], minlength=count)

    def predict(self, histories: Sequence[History]) -> np.ndarray:
        """Success probability from each history, float64 in [0, 1]; exactly 0.5 before any update."""
        rows, indices = self.features(histories)
        return _sigmoid(self._logits(rows, indices, len(histories)))

    def update(
        self, histories: Sequence[History], targets: np.ndarray, weights: np.ndarray | None = None
    ) -> dict[str, float]:
        """`epochs` AdaGrad passes of weighted cross-entropy over the examples, in seeded order.

        Returns `predictor/loss` (weighted cross-entropy before the update), `predictor/loss_after`
        and `predictor/examples`. Raises ValueError for mismatched lengths, NaN or out-of-range targets.
        """
        y, w = check_training_batch(histories, targets, weights)
        count = len(histories)
        if count == 0 or w.sum() <= 0.0:
            return {"predictor/loss": 0.0, "predictor/loss_after": 0.0, "predictor/examples": 0.0}
        rows, indices = self.features(histories)
        starts = np.searchsorted(rows, np.arange(count + 1))  # CSR row starts: rows is sorted
        loss_before = self._loss(rows, indices, y, w)
        lr, l2, size = self.config["learning_rate"], self.config["l2"], self.config["batch_size"]
        for _ in range(self.config["epochs"]):
            order = self._rng.permutation(count)
            for begin in range(0, count, size):
                batch = order[begin : begin + size]
                batch_w = w[batch]
                if batch_w.sum() <= 0.0:
                    continue
                batch_rows, batch_idx = _gather_rows(starts, indices, batch)
                z = self._logits(batch_rows, batch_idx, batch.size)
                residual = batch_w * (_sigmoid(z) - y[batch]) / batch_w.sum()  # dCE/dz, weighted mean
                touched, inverse = np.unique(batch_idx, return_inverse=True)
                grad = np.bincount(inverse, weights=residual[batch_rows], minlength=touched.size)
                grad += l2 * self.weights[touched]
                self._accum[touched] += grad**2
                self.weights[touched] -= lr * grad / np.sqrt(self._accum[touched])
                grad_bias = float(residual.sum())
                self._accum_bias += grad_bias**2
                self.bias -= lr * grad_bias / np.sqrt(self._accum_bias)
        self.num_updates += 1
        return {
            "predictor/loss": loss_before,
            "predictor/loss_after": self._loss(rows, indices, y, w),
            "predictor/examples": float(count),
        }

    def _loss(self, rows: np.ndarray, indices: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
        z = self._logits(rows, indices, y.size)
        ce = np.logaddexp(0.0, z) - y * z  # cross-entropy with a fractional target, stable for any z
        return float(np.sum(w * ce) / np.sum(w))

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {
            "kind": "hashed_ngram",
            "config": dict(self.config),
            "weights": self.weights.copy(),
            "bias": self.bias,
            "accum": self._accum.copy(),
            "accum_bias": self._accum_bias,
            "rng": self._rng.bit_generator.state,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "hashed_ngram":
            raise ValueError(f"state kind must be 'hashed_ngram', got {state.get('kind')!r}")
        config = dict(state["config"])
        self._check_config(config)
        weights = np.asarray(state["weights"], dtype=np.float64)
        accum = np.asarray(state["accum"], dtype=np.float64)
        if weights.shape != (config["num_features"],) or accum.shape != weights.shape:
            raise ValueError(f"weights and accum must have shape ({config['num_features']},), got {weights.shape}, {accum.shape}")
        self.config = config
        self._reset_caches()  # cached indices may belong to another feature space
        self.weights = weights.copy()
        self.bias = float(state["bias"])
        self._accum = accum.copy()
        self._accum_bias = float(state["accum_bias"])
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self.num_updates = int(state["num_updates"])


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
