"""Every figure in the README comes from a tool: fill (or check) the README's generated blocks.

A generated block in README.md is

    <!-- generated: SOURCE KEY -->
    ...text rendered from SOURCE by the renderer KEY...
    <!-- end -->

where SOURCE is what a benchmark or sweep tool wrote (``docs/bench_htp.json`` from
``tools/bench_htp.py``, ``docs/trained_*.json`` from ``tools/trained_table.py``,
``docs/sweeps`` from ``qnnpasses sweep``, ``docs/bench_memory.md`` from
``tools/bench_memory.py``, ``docs/bench_speed.md`` from ``tools/bench.py``).  Run after a
benchmark to update the README; ``--check`` (what ``tests/test_readme_figures.py`` runs)
exits 1 naming every block whose text differs from what its source says.

    python tools/readme_figures.py            # rewrite the generated blocks
    python tools/readme_figures.py --check    # README and docs agree?
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"(<!-- generated: (\S+) (\S+) -->\n)(.*?)(<!-- end -->)", re.DOTALL)

Renderer = Callable[[Path], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(key: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        RENDERERS[key] = fn
        return fn
    return register


class SourceError(Exception):
    """A source lacks what its renderer needs (missing file, changed format)."""


def _read(path: Path) -> str:
    if not path.exists():
        raise SourceError(f"{path.relative_to(ROOT)} does not exist")
    return path.read_text()


def _find(pattern: str, text: str, where: Path, flags: int = 0) -> re.Match:
    match = re.search(pattern, text, flags)
    if match is None:
        raise SourceError(f"{where.relative_to(ROOT)}: no match for /{pattern}/ (did the tool's format change?)")
    return match


def _cos(value: float) -> str:
    """A cosine with as many decimals as it has leading nines, plus two (3 to 6)."""
    nines = len(re.match(r"0\.(9*)", f"{value:.9f}").group(1)) if value < 1 else 6
    decimals = min(6, max(3, nines + 2))
    return f"{math.floor(value * 10 ** decimals) / 10 ** decimals:.{decimals}f}"


# --------------------------------------------------------------------------- bench_htp.json

VARIANTS = [("raw", "raw export"), ("onnxsim", "onnxsim"), ("onnxslim", "onnxslim"),
            ("ort-qnn-preprocess", "onnxruntime `qnn_preprocess_model`"), ("htp-llm", "**qnnpasses `htp-llm`**")]
FAMILIES = [("LLaMA-family", ("llama", "qwen2", "mistral", "phi3")), ("GPT-2", ("gpt2",)), ("BERT", ("bert",))]


def _bench_htp(path: Path) -> dict[str, dict[str, dict]]:
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for row in json.loads(_read(path)):
        by[row["fixture"]][row["variant"]] = row
    return by


def _entirely(row: dict) -> bool:
    return bool(row["ok"]) and row["partitions"] == 1 and row["cpu_nodes"] == 0


@renderer("placement_table")
def placement_table(path: Path) -> str:
    by = _bench_htp(path)
    n = len(by)
    lines = ["| variant | runs on the HTP | entirely on the HTP (1 partition, 0 CPU nodes) |", "|---|---|---|"]
    for key, label in VARIANTS:
        rows = [v[key] for v in by.values() if key in v]
        runs, whole = sum(bool(r["ok"]) for r in rows), sum(_entirely(r) for r in rows)
        bold = (lambda s: f"**{s}**") if key == "htp-llm" else (lambda s: s)
        lines.append(f"| {label} | {bold(f'{runs} / {n}')} | {bold(f'{whole} / {n}')} |")
    return "\n".join(lines)


def _ratio_ranges(by: dict[str, dict[str, dict]], peer: str) -> list[str]:
    parts = []
    for family, prefixes in FAMILIES:
        ratios = [v["htp-llm"]["qnn_ops"] / v[peer]["qnn_ops"] for f, v in sorted(by.items())
                  if f.split("_")[0] in prefixes and v.get(peer, {}).get("ok") and v[peer]["qnn_ops"]]
        if ratios:
            low, high = min(ratios), max(ratios)
            span = f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"
            parts.append(f"{span} on {family}")
    return parts


@renderer("op_ratios")
def op_ratios(path: Path) -> str:
    by = _bench_htp(path)
    example = by.get("llama_gqa_ts")
    lines = []
    for peer in ("onnxslim", "onnxsim"):
        failed = sorted(f for f, v in by.items() if peer in v and not v[peer]["ok"])
        note = f" (where its output runs; not {', '.join(failed)})" if failed else ""
        lines.append(f"against {peer}{note}: " + ", ".join(_ratio_ranges(by, peer)))
    text = "Ops in the composed QNN graph, `htp-llm` " + "; ".join(lines) + "."
    if example:
        ours, slim = example["htp-llm"], example["onnxslim"]
        text += (f" E.g. llama_gqa_ts: {ours['qnn_ops']} vs {slim['qnn_ops']} ops (onnxslim), of which data "
                 f"movement {ours['data_movement']} vs {slim['data_movement']}.")
    cosines = [v["htp-llm"]["cosine"] for v in by.values() if v.get("htp-llm", {}).get("cosine") is not None]
    test = ROOT / "tests" / "test_htp_llm_pipeline.py"
    source = _read(test)
    enforced_cos = _find(r"cosine_similarity\([^)]*\)\s*>=\s*([0-9.e-]+)", source, test).group(1)
    enforced_abs = _find(r"\[\"max_abs\"\]\s*<=\s*([0-9.e-]+)", source, test).group(1)
    text += (f" Every `htp-llm` output matched the fp32 CPU original with cosine ≥ {_cos(min(cosines))} on the HTP in"
             f" this run; `tests/test_htp_llm_pipeline.py` enforces cosine ≥ {enforced_cos} on the HTP (CPU fallback"
             f" disabled) and max abs error ≤ {enforced_abs} on the CPU.")
    return _wrap(text)


# --------------------------------------------------------------------------- trained_smollm2.json


@renderer("trained_table")
def trained_table(path: Path) -> str:
    """The table ``tools/trained_table.py`` writes beside its JSON, rendered by that tool itself."""
    sys.path.insert(0, str(ROOT / "tools"))
    from trained_table import render

    return render(json.loads(_read(path)))


# --------------------------------------------------------------------------- docs/sweeps/*.md

SWEEP_ROWS = [("llama_mha", "llama_mha_ts"), ("llama_gqa", "llama_gqa_ts"), ("llama_gqa_kv (KV cache)", "llama_gqa_kv_ts"),
              ("gpt2", "gpt2_ts"), ("bert", "bert_ts"), ("SmolLM2-135M (trained)", "smollm2_135m"),
              ("MiniLM-L6 (trained, mean-pooled embedding)", "minilm_l6")]
UNIFORM, DEFAULT = "wuint8-pt a8 s8", "wint8-pc a16 s16"


def _sweep(path: Path) -> dict:
    text = _read(path)
    samples = _find(r"Calibration samples: (\d+); evaluation samples: (\d+)", text, path)
    header = _find(r"^\| cell \|.*$", text, path, re.MULTILINE).group(0)
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = {}
    for line in text.splitlines():
        if line.startswith("| w"):
            values = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
            cells[values["cell"].replace("**best**", "").strip()] = values
    return {"calib": int(samples.group(1)), "eval": int(samples.group(2)), "cells": cells}


def _cell(sweep: dict, name: str, where: Path) -> str:
    if name not in sweep["cells"]:
        raise SourceError(f"{where.relative_to(ROOT)}: no cell '{name}'")
    cell = sweep["cells"][name]
    text = _cos(float(cell["cosine"]))
    if cell.get("top-1", "-") != "-":
        text += f" / {cell['top-1']}"
    return text


@renderer("sweep_table")
def sweep_table(folder: Path) -> str:
    sweeps = {p.stem: _sweep(p) for p in sorted(folder.glob("*.md"))}
    cells = [c for s in sweeps.values() for c in s["cells"].values()]
    whole = sum(c.get("QNN partitions") == "1" and c.get("CPU nodes") == "0" and c.get("status") == "ok" for c in cells)
    lead = "Every cell of every grid" if whole == len(cells) else f"{whole} of {len(cells)} cells"
    intro = _wrap(f"{lead} ran on the HTP as 1 partition with 0 CPU nodes (cosine / top-1 against fp32 on CPU; "
                  "the full grids are in `docs/sweeps/`, made by `qnnpasses sweep tests/fixtures/F.onnx --calib "
                  "F.calib.npz --eval F.eval.npz` with data from `python -m qnnpasses.quant.data`; the windows each "
                  "grid used are in the last column):")
    lines = [intro, "", ("| model | uniform uint8 per-tensor | default: int8 per-channel weights, 16-bit activations "
                         "| calibration / held-out windows |"), "|---|---|---|---|"]
    for label, stem in SWEEP_ROWS:
        path = folder / f"{stem}.md"
        sweep = _sweep(path)
        default = _cell(sweep, DEFAULT, path)
        ppl = sweep["cells"][DEFAULT].get("ppl (fp32)", "-")
        if ppl != "-" and label.startswith("SmolLM2"):
            ours, ref = _find(r"([0-9.]+) \(([0-9.]+)\)", ppl, path).groups()
            default += f", perplexity {ours} vs {ref}"
        kv8 = folder / f"{stem}_kv8.md"
        if kv8.exists():
            default += f" (`--kv-bits 8`: {_cell(_sweep(kv8), DEFAULT + ' kv8', kv8)})"
        lines.append(f"| {label} | {_cell(sweep, UNIFORM, path)} | {default} | {sweep['calib']} / {sweep['eval']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- bench_memory.md / bench_speed.md


def _table_row(text: str, label: str, where: Path) -> list[str]:
    line = _find(rf"^\| {re.escape(label)} \|.*$", text, where, re.MULTILINE).group(0)
    return [c.strip() for c in line.strip("|").split("|")]


@renderer("memory_bullet")
def memory_bullet(path: Path) -> str:
    text = _read(path)
    weights = _find(r"model weights: ([0-9.]+ GiB) apparent", text, path).group(1)
    ours = _table_row(text, "qnnpasses run --pipeline htp-llm", path)
    load_save = _table_row(text, "onnx.load + onnx.save", path)
    peers = []
    for label in ("onnxsim", "onnxslim"):
        row = _table_row(text, label, path)
        status = row[1] if row[1] == "ok" else row[1].split(":")[0]
        peers.append(f"{label} {'peaks at ' + row[3] if row[1] == 'ok' else status + ' after ' + row[3]}")
    return _wrap(
        f"- A LLaMA-7B-shaped graph (32 layers, hidden 4096, vocab 32000, {weights} of fp16 weights in a sparse "
        f"external file, `python tools/make_big_llm.py --out DIR/model.onnx`): `qnnpasses run --pipeline htp-llm` "
        f"completes with **{ours[3]} peak RSS** in {float(ours[2]):.0f} s and writes the output with external data. "
        f"Plain `onnx.load` + `onnx.save` peaks at {load_save[3]}, {', '.join(peers)} "
        f"(`python tools/bench_memory.py`).", indent="  ")


@renderer("speed_bullet")
def speed_bullet(path: Path) -> str:
    text = _read(path)
    head = _find(r"(\d+)-layer LLaMA \((\d+) nodes\), median of (\d+)", text, path)
    try:
        ours = float(_table_row(text, "qnnpasses run --pipeline htp-llm", path)[1])
    except ValueError:
        raise SourceError(f"{path.relative_to(ROOT)}: the htp-llm run has no wall time (did it fail?)") from None
    ratios = {label: _table_row(text, f"{label} (alone)", path)[3] for label in ("onnxsim", "onnxslim")}
    depth = re.findall(r"^\| (\d+) \| (\d+) \| ([0-9.]+) \|", text, re.MULTILINE)
    if not depth:
        raise SourceError(f"{path.relative_to(ROOT)}: no layers table")
    layers = " / ".join(d[0] for d in depth)
    seconds = " / ".join(f"{float(d[2]):.1f}" for d in depth)
    out = (f"- On a {head.group(1)}-layer LLaMA ({head.group(2)} nodes; median of {head.group(3)} fresh runs) the whole "
           f"`htp-llm` pipeline (`qnnpasses run`, no report) took {ours:.1f} s: {ratios['onnxsim'].replace('x', '×')} "
           f"the time of onnxsim alone and {ratios['onnxslim'].replace('x', '×')} that of onnxslim alone. At {layers} "
           f"layers it took {seconds} s (`python tools/bench.py`)")
    growth = re.search(r"^(\d+)/(\d+) layers: ([0-9.]+)x", text, re.MULTILINE)
    if growth:
        out += f"; {growth.group(1)}/{growth.group(2)} layers = {growth.group(3)}× (linear: 4.0×)"
    rest = re.search(r"passes other than simplify: ([0-9.]+) s -> ([0-9.]+) s \(([0-9.]+)x\)", text)
    if rest:
        out += f", the passes other than simplify {rest.group(1)} → {rest.group(2)} s ({rest.group(3)}×)"
    skipped = re.search(r"simplify's onnxsim:.*?(\d+) layers skipped", text)
    if skipped:
        out += (f"; simplify's onnxsim call was skipped at {skipped.group(1)} layers (above its weight-size limit), "
                f"so the totals across depths do not do the same work")
    targets = re.findall(r"^- (.+?) <= ([0-9.]+): wall ([0-9.]+x|-) (met|NOT met|not measured)", text, re.MULTILINE)
    if targets:
        out += ". The project's speed targets, wall time: " + ", ".join(
            f"{name} {value.replace('x', '×')} (≤ {bound}: {verdict})" for name, bound, value, verdict in targets)
    above = re.search(r"^Above the floor .*?; ([0-9.]+) s CPU\), qnnpasses spends ([0-9.]+) s CPU and onnxslim "
                      r"([0-9.]+) s: wall [0-9.]+x, CPU ([0-9.]+)x", text, re.MULTILINE)
    if above:
        out += (f". Of onnxslim's CPU time, {above.group(1)} s is the floor every tool pays (interpreter start, "
                f"`import onnx`, parsing and writing the file, as plain `onnx.load` + `onnx.save`); above it "
                f"qnnpasses spends {above.group(2)} s and onnxslim {above.group(3)} s "
                f"({above.group(4)}×)")
    linear = re.search(r"^Every pass linear \(growth <= ([0-9.]+) for the graph's ([0-9.]+)x\): work (met|NOT met)[^,]*, "
                       r"at most ([0-9.]+)x \(([\w-]+)\)(?:; time at most ([0-9.]+)x \(([\w-]+)\))?", text, re.MULTILINE)
    if linear:
        out += (f". Per pass, from {linear.group(2)}× the nodes: its work (Python function calls) grows at most "
                f"{linear.group(4)}× ({linear.group(5)}; ≤ {linear.group(1)}: {linear.group(3)})")
        if linear.group(6):
            out += f", its wall time at most {linear.group(6)}× ({linear.group(7)})"
    return _wrap(out + ".", indent="  ")


# --------------------------------------------------------------------------- the README


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


@renderer("section")
def section(path: Path, anchor: str) -> str:
    """``section:SLUG``: the body of the section of a generated markdown document whose
    heading's slug is SLUG (up to the next heading), copied as the tool wrote it."""
    lines = _read(path).splitlines()
    for index, line in enumerate(lines):
        heading = re.match(r"(#+)\s+(.*)", line)
        if heading and _slug(heading.group(2)) == anchor:
            body = []
            for rest in lines[index + 1:]:
                if re.match(r"#+\s", rest):
                    break
                body.append(rest)
            return "\n".join(body).strip()
    raise SourceError(f"{path.relative_to(ROOT)}: no section whose heading reads '{anchor}'")


def _wrap(text: str, width: int = 100, indent: str = "") -> str:
    """Fill to ``width`` columns; never inside `inline code`."""
    glued = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    words, lines, line = [w.replace("\0", " ") for w in glued.split(" ")], [], ""
    for word in words:
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = indent + word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "\n".join(lines)


def render_blocks(readme: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """(README with every generated block re-rendered, problems); a problem names the block."""
    problems: list[str] = []

    def fill(match: re.Match) -> str:
        source, key = match.group(2), match.group(3)
        name, _, argument = key.partition(":")
        if name not in RENDERERS:
            problems.append(f"block '{source} {key}': unknown renderer (known: {', '.join(sorted(RENDERERS))})")
            return match.group(0)
        try:
            body = RENDERERS[name](root / source, argument) if argument else RENDERERS[name](root / source)
        except SourceError as exc:
            problems.append(f"block '{source} {key}': {exc}")
            return match.group(0)
        return f"{match.group(1)}{body}\n{match.group(5)}"

    return BLOCK.sub(fill, readme), problems


def check(readme_path: Path = README, root: Path = ROOT) -> list[str]:
    """Every way README and docs disagree, as readable lines (empty: they agree)."""
    readme = readme_path.read_text()
    rendered, problems = render_blocks(readme, root)
    if not BLOCK.search(readme):
        problems.append("README has no generated blocks")
    if rendered != readme:
        diff = difflib.unified_diff(readme.splitlines(), rendered.splitlines(), "README.md", "from docs", lineterm="", n=0)
        problems.append("README.md differs from what the docs say (run python tools/readme_figures.py):\n"
                        + "\n".join(diff))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when README and docs disagree")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.readme)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    readme = args.readme.read_text()
    rendered, problems = render_blocks(readme)
    for problem in problems:  # the blocks whose source is fine are filled all the same
        print(problem, file=sys.stderr)
    if rendered != readme:
        args.readme.write_text(rendered)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
