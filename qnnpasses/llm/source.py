"""Where a user's export is: an ``.onnx`` file, or the Hugging Face / Optimum folder that holds it.

``optimum-cli export onnx`` and ``save_pretrained``-style folders keep the graph (``model.onnx``,
older Optimum versions ``decoder_model_merged.onnx``) beside ``config.json`` and the tokenizer
files; ``qnnpasses llm`` and ``generate --compare`` take either the file or the folder.
"""

from __future__ import annotations

from pathlib import Path

from qnnpasses.errors import BadInputError

#: File names a folder's decoder graph goes by, in the order they are tried.
FOLDER_MODELS = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")


def model_file(path: str | Path) -> Path:
    """``path`` itself when it is a file; in a folder, the decoder graph (one-line BadInputError
    when the folder has none or several candidates)."""
    path = Path(path)
    if not path.is_dir():
        if not path.is_file():
            raise BadInputError(f"model not found: {path}")
        return path
    for name in FOLDER_MODELS:
        if (path / name).is_file():
            return path / name
    graphs = sorted(p.name for p in path.glob("*.onnx"))
    if len(graphs) == 1:
        return path / graphs[0]
    if not graphs:
        raise BadInputError(f"{path}: the folder holds no .onnx model")
    raise BadInputError(f"{path}: the folder holds several models ({', '.join(graphs)}); name the one to use")
