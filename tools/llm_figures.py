#!/usr/bin/env python
"""Figures of ``qnnpasses llm`` for docs/llm_graphs.md and docs/llm_graphs.json.

For each export it builds the static prefill + decode pair (context and prefill below),
then reads the build's own report: placement and composed QNN op counts from the real HTP
backend, KV-cache bytes against 2·L·kv_heads·head_dim·N·bytes and ``qnnpasses analyze``'s
figure, the CPU check against the original export, and the weight-sharing probe outcome.

    python tools/llm_figures.py                  # the random-weight fixtures, model-builder ones too (fast)
    python tools/llm_figures.py --trained        # + SmolLM2-135M KV exports (tools/trained_fixtures.py),
                                                 #   and the TorchScript one split with --parts 3

``tools/llm_eval.py`` writes docs/llm.md (accuracy and speed of the trained pair on the HTP).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
# (label, path, context, prefill, parts): the dynamo fixture fixes the new-token count at 1
RANDOM = [("llama_gqa_kv_dyn_ts (random)", FIXTURES / "llama_gqa_kv_dyn_ts.onnx", 256, 16, None),
          ("llama_gqa_kv_dyn_dynamo (random)", FIXTURES / "llama_gqa_kv_dyn_dynamo.onnx", 256, 1, None),
          # onnxruntime-genai model-builder exports (GroupQueryAttention; tools/genai_models.py)
          ("genai builder llama_fp32 (random)", FIXTURES / "genai" / "llama_fp32" / "model.onnx", 64, 8, None),
          ("genai builder qwen2_fp32 (random)", FIXTURES / "genai" / "qwen2_fp32" / "model.onnx", 64, 8, None)]


def trained_exports(context: int, prefill: int) -> list[tuple[str, Path, int, int, int | None]]:
    sys.path.insert(0, str(ROOT / "tools"))
    import trained_fixtures

    folder = trained_fixtures.DEFAULT_CACHE
    found = [(f"SmolLM2-135M {exporter}", folder / f"smollm2_135m_{exporter}.onnx", context, prefill, None)
             for exporter in ("kv_ts", "kv_dynamo")]
    found.append(("SmolLM2-135M kv_ts, --parts 3", folder / "smollm2_135m_kv_ts.onnx", context, prefill, 3))
    missing = [str(p) for _, p, _, _, _ in found if not p.is_file()]
    if missing:
        raise SystemExit(f"missing {missing}: python tools/trained_fixtures.py build --exporters kv_ts,kv_dynamo")
    return found


def measure(label: str, model: Path, context: int, prefill: int, parts: int | None, work: Path) -> dict:
    from qnnpasses.llm.convert import build

    out = work / f"{model.stem}_{parts or 1}"
    manifest = build(model, out, context=context, prefill=prefill, parts=parts)
    report = json.loads((out / "report.json").read_text())
    compiled = report.get("compile") or {}
    return {"export": label, "source": model.name, "context": context, "prefill": prefill, "parts": parts or 1,
            "part_weight_bytes": {g: [p.get("weight_bytes") for p in manifest["graphs"][g]["parts"]] for g in manifest["graphs"]},
            "layers": manifest["layers"], "kv_heads": manifest["kv_heads"], "head_dim": manifest["head_dim"],
            "weight_sharing": manifest["weight_sharing"], "shared_probe": compiled.get("shared_probe"),
            "htp": report["htp"], "verification": report["verification"], "seconds": report["seconds"]}


def main(argv: list[str] | None = None) -> int:
    from qnnpasses.llm.report import graphs_section

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trained", action="store_true", help="also the SmolLM2-135M KV-cache exports")
    parser.add_argument("--context", type=int, default=256, help="context of the trained exports")
    parser.add_argument("--prefill", type=int, default=16, help="prefill size of the trained exports")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    exports = RANDOM + (trained_exports(args.context, args.prefill) if args.trained else [])
    with tempfile.TemporaryDirectory(prefix="llm_figures_") as tmp:
        rows = [measure(*export, Path(tmp)) for export in exports]
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "llm_graphs.json").write_text(json.dumps({"graphs": rows}, indent=2, default=str) + "\n")
    md = args.docs / "llm_graphs.md"
    md.write_text(graphs_section(rows))
    print(f"wrote {md} and {args.docs / 'llm_graphs.json'} ({len(rows)} exports)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
