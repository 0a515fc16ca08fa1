"""Real English prose found on this machine, for evaluating and calibrating trained models.

No data set can be downloaded here, so the text comes from what every machine has:

* ``pydoc`` (default): CPython's own reference documentation, shipped with the interpreter
  as ``pydoc_data.topics`` (about 80 documents, 0.5 MB of technical English);
* ``licenses``: Debian's ``/usr/share/common-licenses`` (GPL, Apache, ...: legal English).

Only prose paragraphs are kept (no indented code, grammar rules or heading underlines) and
hard-wrapped lines are joined, so a tokenizer sees ordinary running text.  Documents are
split into an evaluation and a calibration part by a stable hash of their name, so the two
sets never share a document, whatever the Python version.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

LICENSES_DIR = Path("/usr/share/common-licenses")
SOURCES = ("pydoc", "licenses")
#: One document in this many goes to the evaluation split (the rest is for calibration).
EVAL_EVERY = 4
MIN_WORDS = 12
MIN_LETTER_FRACTION = 0.8


def documents(source: str = "pydoc") -> dict[str, str]:
    """``{document name: raw text}`` of one text source, sorted by name."""
    if source == "pydoc":
        from pydoc_data.topics import topics

        return dict(sorted(topics.items()))
    if source == "licenses":
        files = sorted(p for p in LICENSES_DIR.glob("*") if p.is_file())
        return {p.name: p.read_text(errors="replace") for p in files}
    raise ValueError(f"unknown text source {source!r} (expected one of {SOURCES})")


def is_prose(paragraph: str) -> bool:
    """True for a paragraph of running text: unindented, long enough, mostly letters."""
    lines = paragraph.splitlines()
    if any(line[:1].isspace() for line in lines):  # code, grammar, indented notes
        return False
    if any(set(line.strip()) <= set("*=-~^#_") for line in lines):  # heading underlines
        return False
    words = paragraph.split()
    if len(words) < MIN_WORDS:
        return False
    letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return letters / len(paragraph) >= MIN_LETTER_FRACTION


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of ``text``, each unwrapped onto one line."""
    paragraphs = re.split(r"\n\s*\n", text)
    return [" ".join(p.split()) for p in paragraphs if is_prose(p)]


def in_eval_split(name: str) -> bool:
    """Stable document-level split (crc32, not Python's salted ``hash``)."""
    return zlib.crc32(name.encode()) % EVAL_EVERY == 0


def split_paragraphs(source: str = "pydoc") -> dict[str, list[str]]:
    """``{"eval": [...], "calib": [...]}``: the prose paragraphs of each split's documents."""
    parts: dict[str, list[str]] = {"eval": [], "calib": []}
    for name, text in documents(source).items():
        parts["eval" if in_eval_split(name) else "calib"].extend(prose_paragraphs(text))
    return parts


def split_text(source: str = "pydoc") -> dict[str, str]:
    """Like :func:`split_paragraphs`, each split as one text (paragraphs separated by blank lines)."""
    return {split: "\n\n".join(paras) for split, paras in split_paragraphs(source).items()}
