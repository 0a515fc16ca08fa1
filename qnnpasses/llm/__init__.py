"""Deployable LLMs: a HF-style KV-cache export turned into a static prefill + decode pair.

``qnnpasses.llm.build(model, out_dir, context=N, prefill=M, ...)`` is ``qnnpasses llm``
(:func:`qnnpasses.llm.convert.build`); :mod:`.manifest` is the ``llm.json`` a runner follows,
:mod:`.runner` the generation loop, :mod:`.tokenizer` the text side of a bundle (tokenizer files,
chat template, special ids), :mod:`.sampling` the choice of each token.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # lazy: the runner imports .manifest without the pass machinery
    if name == "build":
        from qnnpasses.llm.convert import build

        return build
    raise AttributeError(f"module 'qnnpasses.llm' has no attribute {name!r}")
