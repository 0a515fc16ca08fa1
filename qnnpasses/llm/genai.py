"""``qnnpasses llm --bundle genai``: the pair as an onnxruntime-genai ``decoder-pipeline`` model.

onnxruntime-genai drives a prompt graph of W new tokens and a one-token graph with its windowed
KV cache (``sliding_window`` with ``slide_key_value_cache``), which is the layout of our pair:

* the graphs keep only the cache outside (``past``: N - W slots for the prompt graph, N - 1 for
  the token graph) and output the new tokens' K/V only; the runtime appends them at the right end
  of its cache and drops as many slots from the left;
* ``attention_mask`` ``[1, N]`` marks the valid past slots (right-aligned) and the new tokens
  (the prompt is padded on the left to a multiple of W with ``pad_token_id``, masked 0, position
  0); ``position_ids`` ``[1, W]`` holds the absolute positions;
* the cache is uint8 with the key transposed (:mod:`qnnpasses.llm.kv_layout`), every empty slot
  holding ``pad_value``, which is therefore the encodings' zero point.

Our graphs compute any placement of the valid slots the mask describes (the mask, not the slot
index, decides what a query sees, and the rotary reads ``position_ids``), with one exception:
a sliding-window layer's mask made by ``window-positions`` assumes slot i holds position i, so
such models are refused here.

The graph inputs and outputs take the names Qualcomm's own bundles use (``input_ids``,
``attention_mask``, ``position_ids``, ``past_key_{i}_in`` / ``past_value_{i}_in``, ``logits``,
``past_key_{i}_out`` / ``past_value_{i}_out``, :mod:`qnnpasses.llm.io_names`).
``genai_config.json`` runs the graphs on the QNN HTP (the compiled EPContext models when there
are any); :func:`generate` runs the ``.onnx`` graphs with onnxruntime-genai on the CPU instead,
a check on the build machine (onnxruntime-genai's PyPI wheels have no QNN provider).  The CPU
path for this cache is that of onnxruntime-genai 0.15.2 and 0.16.0 (:data:`HOST_VERSIONS`).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from qnnpasses.errors import BadInputError

CONFIG_NAME = "genai_config.json"
#: the zero point of the uint8 cache: onnxruntime-genai fills empty slots with it (AI Hub's choice)
PAD_VALUE = 128
KV_LAYOUT = {"key": "HBDS", "value": "HBSD"}


def check_request(context: int, prefill: int, precision: str) -> None:
    """Refuse what onnxruntime-genai's windowed cache cannot run (one line each, before any work)."""
    if precision != "fp16":
        raise BadInputError(f"--bundle genai takes --precision fp16 for now (got {precision})")
    if prefill < 2:
        raise BadInputError("--bundle genai needs --prefill of at least 2 (onnxruntime-genai's window)")
    if context < 2 * prefill:
        raise BadInputError(f"--bundle genai needs --context of at least twice --prefill ({2 * prefill}), "
                            f"got {context}")


def check_model(local_layers: dict[str, int]) -> None:
    """Refuse a model whose graphs would compute wrong with onnxruntime-genai's cache placement."""
    if local_layers:
        raise BadInputError(f"--bundle genai cannot hold sliding-window layers yet ({len(local_layers)} local "
                            "layers): their masks assume the cache is left-aligned; use the default bundle")


def _graph_entries(name: str, graph: dict[str, Any], compiled: bool, prompt: bool) -> list[dict[str, Any]]:
    """The pipeline models of one graph, a part each in run order (tensors pass between them by
    name); they inherit the decoder's session options."""
    entries = []
    for number, part in enumerate(graph["parts"]):
        key = name if len(graph["parts"]) == 1 else f"{name}_{number + 1}_of_{len(graph['parts'])}"
        entries.append({key: {"filename": part["compiled"] if compiled else part["onnx"],
                              "inputs": part["inputs"], "outputs": part["outputs"],
                              "run_on_prompt": prompt, "run_on_token_gen": not prompt}})
    return entries


def qnn_session_options(target: dict[str, Any]) -> dict[str, Any]:
    """The QNN execution provider on the device's HTP, for the SoC the graphs were compiled for."""
    qnn = {"backend_path": "libQnnHtp.so", "htp_performance_mode": "burst",
           "soc_model": str(target["soc_model"]), "htp_arch": str(target["htp_arch"]).lstrip("v"),
           "enable_htp_fp16_precision": "1"}
    return {"log_id": "onnxruntime-genai", "graph_optimization_level": "ORT_DISABLE_ALL",
            "provider_options": [{"qnn": qnn}]}


def genai_config(manifest: dict[str, Any], host: bool = False) -> dict[str, Any]:
    """``genai_config.json`` for the bundle described by ``manifest`` (renamed graphs, uint8 cache).

    ``host``: the same model on onnxruntime-genai's CPU provider, with the ``.onnx`` graphs (a
    check on the build machine, :func:`host_folder`)."""
    text = manifest["tokenizer"]
    graphs = manifest["graphs"]
    compiled = not host and all(p.get("compiled") for g in graphs.values() for p in g["parts"])
    eos = list(text["eos_token_ids"])
    pad = text["pad_token_id"] if text.get("pad_token_id") is not None else eos[0]
    session = ({"log_id": "onnxruntime-genai", "graph_optimization_level": "ORT_DISABLE_ALL", "provider_options": []}
               if host else qnn_session_options(manifest["target"]))
    decoder = {
        "session_options": session,
        "head_size": manifest["head_dim"], "num_hidden_layers": manifest["layers"],
        "num_key_value_heads": manifest["kv_heads"],
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                   "past_key_names": "past_key_%d_in", "past_value_names": "past_value_%d_in"},
        "outputs": {"logits": "logits", "present_key_names": "past_key_%d_out",
                    "present_value_names": "past_value_%d_out"},
        "sliding_window": {"window_size": manifest["prefill"], "pad_value": PAD_VALUE, "alignment": "right",
                           "slide_key_value_cache": True, "slide_inputs": True},
        "pipeline": [*_graph_entries("prompt", graphs["prefill"], compiled, True),
                     *_graph_entries("token", graphs["decode"], compiled, False)],
    }
    model = {"type": "decoder-pipeline", "context_length": manifest["context"], "vocab_size": manifest["vocab"],
             "bos_token_id": text.get("bos_token_id") if text.get("bos_token_id") is not None else pad,
             "eos_token_id": eos if len(eos) > 1 else eos[0], "pad_token_id": pad, "decoder": decoder}
    search = {"max_length": manifest["context"], "do_sample": False, "num_beams": 1, "num_return_sequences": 1,
              "past_present_share_buffer": False, "temperature": 1.0, "top_k": 1, "top_p": 1.0}
    return {"model": model, "search": search}


def write_config(folder: Path, manifest: dict[str, Any]) -> Path:
    path = folder / CONFIG_NAME
    path.write_text(json.dumps(genai_config(manifest), indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- running it


#: onnxruntime-genai releases whose CPU provider runs the windowed cache (later ones allocate a
#: shared past/present buffer on the CPU and reject graphs that output the new tokens only)
HOST_VERSIONS = ("0.15.2", "0.16.0")


class GenaiError(ValueError):
    """The bundle or the installed onnxruntime-genai cannot run; one line for the user."""


@contextlib.contextmanager
def host_folder(bundle: Path, manifest: dict[str, Any]) -> Iterator[Path]:
    """A temporary folder that onnxruntime-genai loads as the bundle on its CPU provider: links
    to the bundle's files and the host configuration (its loader refuses ``..`` in file names,
    so the configuration cannot live in a subfolder)."""
    with tempfile.TemporaryDirectory(prefix="qnnpasses-genai-") as tmp:
        root = Path(tmp)
        for path in bundle.iterdir():
            if path.is_file() and path.name != CONFIG_NAME:
                (root / path.name).symlink_to(path.resolve())
        (root / CONFIG_NAME).write_text(json.dumps(genai_config(manifest, host=True), indent=2))
        yield root


def _genai_module() -> Any:
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise GenaiError("onnxruntime-genai is not installed (pip install onnxruntime-genai==0.16.0)") from None
    if og.__version__ not in HOST_VERSIONS:
        raise GenaiError(f"onnxruntime-genai {og.__version__} does not run a windowed KV cache on the CPU; "
                         f"{' and '.join(HOST_VERSIONS)} do (pip install onnxruntime-genai==0.16.0)")
    return og


def generate(bundle: str | Path, manifest: dict[str, Any], prompt_ids: list[int], max_new_tokens: int, *,
             stop_ids: Iterable[int] = (), sampling: Any = None,
             on_token: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Generate with onnxruntime-genai itself on its CPU provider: ``prompt_ids`` in, tokens out
    (greedy, or ``sampling``'s temperature / top-k / top-p / seed as onnxruntime-genai samples)."""
    bundle = Path(bundle)
    if not (bundle / CONFIG_NAME).is_file():
        raise GenaiError(f"{bundle}: no {CONFIG_NAME} (build it with 'qnnpasses llm ... --bundle genai')")
    og = _genai_module()
    window, context = int(manifest["prefill"]), int(manifest["context"])
    padded = -(-len(prompt_ids) // window) * window  # the runtime pads the prompt to whole windows
    budget = min(max_new_tokens, context - padded)
    stop = {int(t) for t in stop_ids}
    tokens: list[int] = []
    with host_folder(bundle, manifest) as folder:
        start = time.perf_counter()
        model = og.Model(str(folder))
        loaded = time.perf_counter()
        if budget <= 0:
            return {"tokens": [], "load_seconds": loaded - start, "seconds": 0.0, "runtime": f"onnxruntime-genai {og.__version__}"}
        params = og.GeneratorParams(model)
        options: dict[str, Any] = {"max_length": padded + budget, "do_sample": False}
        if sampling is not None and not sampling.greedy:
            options.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                           top_p=sampling.top_p)
            if sampling.seed is not None:
                options["random_seed"] = int(sampling.seed)
        params.set_search_options(**options)
        generator = og.Generator(model, params)
        generator.append_tokens([int(t) for t in prompt_ids])
        while not generator.is_done() and len(tokens) < budget:
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            if on_token is not None:
                on_token(tokens[-1])
            if tokens[-1] in stop:
                break
        done = time.perf_counter()
    return {"tokens": tokens, "load_seconds": loaded - start, "seconds": done - loaded,
            "runtime": f"onnxruntime-genai {og.__version__}"}
