"""Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k, top-p.

The order is the one transformers' ``generate()`` applies its warpers in: temperature first, then
top-k (keep the k highest logits), then top-p (keep the smallest set of the highest-probability
tokens whose probabilities sum to at least p; the most likely token always stays), then one draw
from the renormalised distribution.  Draws come from numpy's PCG64 generator seeded with
``seed``: the same seed, prompt and bundle give the same tokens.  Logits are taken in float64,
so an fp16 graph's logits and their float32 sum with ``logits_offset`` sample alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class SamplingError(ValueError):
    """A sampling setting outside its range; one line for the user."""


@dataclass(frozen=True)
class SamplingOptions:
    """``temperature`` 0 is greedy (the default); ``top_k`` 0 and ``top_p`` 1 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"--top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict[str, object]:
        if self.greedy:
            return {"mode": "greedy"}
        return {"mode": "sample", "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}


class Sampler:
    """``sampler(logits_row) -> token id``, with its own seeded generator."""

    def __init__(self, options: SamplingOptions | None = None):
        self.options = options or SamplingOptions()
        self.rng = np.random.default_rng(self.options.seed)

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a draw is made from (zeros outside the kept tokens)."""
        o = self.options
        scores = np.asarray(logits, dtype=np.float64).reshape(-1) / o.temperature
        keep = np.isfinite(scores)
        if o.top_k and o.top_k < scores.size:
            kth = np.partition(scores, -o.top_k)[-o.top_k]
            keep &= scores >= kth
        scores = np.where(keep, scores, -np.inf)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if o.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # the smallest prefix reaching top_p: a token stays while the mass before it is < top_p
            drop = order[(cumulative - probs[order]) >= o.top_p]
            probs[drop] = 0
            probs /= probs.sum()
        return probs

    def __call__(self, logits: np.ndarray) -> int:
        if self.options.greedy:
            return int(np.argmax(logits))
        probs = self.probabilities(logits)
        return int(self.rng.choice(probs.size, p=probs))
