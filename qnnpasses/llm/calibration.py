"""Encodings of an 8-bit KV cache: one scale per layer and kind, from the original export's cache.

The scales come from the largest magnitude each layer's keys and values reach when the original
export (onnxruntime CPU, float32) reads calibration tokens: ``--calib`` token sequences when the
user gives them, else :data:`TEXT` through the bundle's tokenizer (natural text: keys and values
of trained models on random token ids are not those of real prompts), else seeded random ids.
The zero point is fixed (onnxruntime-genai fills empty slots with it), so the encoding is
symmetric around it: ``scale = HEADROOM * max|x| / 127`` (values beyond saturate; a
:data:`HEADROOM` above 1 leaves room for prompts that reach further than the calibration did).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

#: fraction of the uint8 half-range the calibrated maximum may use (the rest is headroom)
HEADROOM = 1.0
#: calibration sequences are cut to this many tokens (and to the context)
MAX_TOKENS = 512

#: Calibration prose, written for this project: plain English of several registers, numbers,
#: code and a dialogue, so that the cache sees what prompts put in it.
TEXT = """\
The harbour town woke slowly that morning. Fishing boats came back one after another, their \
decks shining with the night's catch, while the bakery on the corner pushed open its shutters \
and the smell of fresh bread drifted down to the quay. Nobody was in a hurry; the tide would \
turn at eleven, and until then there was coffee, gossip and the weather to discuss.

In 1869 the canal opened and shortened the voyage from Europe to India by roughly 7,000 \
kilometres. Trade through the region grew from 486 ships in the first year to more than \
20,000 a century later, and the price of many goods fell by a third.

To compute the mean of a list in Python, add the values and divide by their count:

    def mean(values):
        if not values:
            raise ValueError("mean of an empty list")
        return sum(values) / len(values)

User: Can you explain why the sky is blue?
Assistant: Sunlight contains every colour. Air molecules scatter short wavelengths much more \
than long ones, so blue light is scattered across the whole sky and reaches your eyes from \
every direction, while the sun itself looks slightly yellow.

Question: What is 12 times 15? Answer: 180. Question: Which planet is closest to the sun? \
Answer: Mercury. The capital of France is Paris, and the longest river in Africa is the Nile.
"""


def calibration_sequences(vocab: int, context: int, calib: str | Path | None, input_ids: str,
                          tokenizer_dir: Path | None) -> tuple[list[list[int]], str]:
    """Token sequences to calibrate on, and where they came from: ``--calib``, else :data:`TEXT`
    through the tokenizer, else seeded random ids.  Random ids are not added to text: on a trained
    model they widen the key range, which costs more resolution than the saturation they avoid
    (docs/llm_bundles.md)."""
    limit = min(MAX_TOKENS, context)
    if calib is not None:
        from qnnpasses.llm.quantize import load_token_sequences

        rows = load_token_sequences(calib, input_ids)
        return [[int(t) for t in row[:limit]] for row in rows[:8]], "calib"
    sequences: list[list[int]] = []
    if tokenizer_dir is not None:
        from qnnpasses.llm.tokenizer import TextTokenizer

        ids = [t for t in TextTokenizer(tokenizer_dir).encode(TEXT) if 0 <= t < vocab]
        for start in range(0, max(1, len(ids) - limit // 2), limit):  # the whole text, in context-sized pieces
            if len(ids[start:start + limit]) >= 8:
                sequences.append(ids[start:start + limit])
        if sequences:
            return sequences, "text"
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, vocab, limit)]], "random"


def cache_scales(reference: Any, sequences: list[list[int]], past_key: list[str], past_value: list[str],
                 headroom: float = HEADROOM) -> dict[str, Any]:
    """Per kind, the scale of every layer (``key_scales``, ``value_scales``) and the calibrated
    maxima, from ``reference`` (:class:`qnnpasses.llm.reference.ReferenceModel`)."""
    ranges = reference.cache_ranges(sequences)
    result: dict[str, Any] = {}
    for kind, names in (("key", past_key), ("value", past_value)):
        peaks = [ranges[n] for n in names]
        result[f"{kind}_max"] = [round(p, 6) for p in peaks]
        result[f"{kind}_scales"] = [float(np.float32(max(p, 1e-6) * headroom / 127.0)) for p in peaks]
    return result
