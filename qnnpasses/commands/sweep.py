"""``qnnpasses sweep``: the precision grid, each cell quantized, run on the real HTP and scored.

See :mod:`qnnpasses.quant.sweep`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qnnpasses.commands.common import add_deprecated, add_shape_arg, shaped_path
from qnnpasses.errors import BadInputError

SUMMARY = "quantize every cell of the precision grid, run each on the HTP and score it (markdown, JSON, PNG)"


def register(subparsers) -> None:
    parser = subparsers.add_parser("sweep", help=SUMMARY, description=SUMMARY)
    parser.add_argument("model", help="float ONNX model")
    parser.add_argument("--calib", required=True, metavar="DATA", help="calibration data (see qnnpasses quantize)")
    parser.add_argument("--eval", required=True, metavar="DATA", dest="eval_data",
                        help="evaluation data, disjoint from --calib")
    parser.add_argument("--out-dir", default="sweep", metavar="DIR", help="folder for sweep.md/.json/.png (default ./sweep)")
    add_deprecated(parser, "-o", "out_dir", "--out-dir VALUE")
    add_deprecated(parser, "--output", "out_dir", "--out-dir VALUE")
    parser.add_argument("--weights", choices=("int8", "uint8"), default="int8", help="weight type of every cell")
    parser.add_argument("--int4", action="store_true", help="also the w4a16 cells (int4 per-channel weights, MSE scales)")
    parser.add_argument("--outliers", default="none", metavar="LIST",
                        help="outlier-rewrite axis, comma-separated: none, rotate (fold-norm-weights,rotate-residual); "
                             "e.g. none,rotate repeats every cell with and without (default none)")
    parser.add_argument("--weight-rounding", default="nearest", metavar="LIST",
                        help="weight-rounding axis, comma-separated: nearest, gptq, gptq-act (see qnnpasses "
                             "quantize); e.g. nearest,gptq repeats every per-channel cell with GPTQ (default nearest)")
    parser.add_argument("--kv-bits", type=int, choices=(8, 16), default=None, help="KV cache width in every cell")
    parser.add_argument("--eval-samples", type=int, default=None, metavar="N", help="evaluate at most this many samples per cell")
    parser.add_argument("--pipeline", default="htp-llm", metavar="NAME|SPEC", help="pipeline run first (default htp-llm)")
    add_shape_arg(parser)
    parser.add_argument("--keep-models", action="store_true", help="keep each cell's QDQ model in DIR/cells")
    parser.set_defaults(func=main)


def main(args) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from qnnpasses.quant.sweep import grid, markdown, run_sweep

    if args.eval_samples is not None and args.eval_samples < 1:
        raise BadInputError("--eval-samples must be at least 1")
    console = Console(file=sys.stderr)
    from qnnpasses.commands.quantize import outlier_spec
    from qnnpasses.passmanager.spec import split_items

    policies = grid(args.weights, args.kv_bits, int4=args.int4,
                    outliers=tuple(outlier_spec(o) for o in split_items(args.outliers)),
                    rounding=tuple(r.strip() for r in args.weight_rounding.split(",") if r.strip()))
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("preparing", total=len(policies))

        def progress(label: str, done: int, total: int) -> None:
            bar.update(task, description=f"cell {label}" if label != "done" else "done", completed=done, total=total)

        with shaped_path(args) as model:
            result = run_sweep(model, args.calib, args.eval_data, args.out_dir,
                               policies=policies, eval_limit=args.eval_samples,
                               keep_models=args.keep_models, progress=progress, pipeline=args.pipeline)
    print(markdown(result))
    out = Path(args.out_dir)
    written = ", ".join(str(out / f) for f in ("sweep.md", "sweep.json", "sweep.png") if (out / f).exists())
    print(f"wrote {written}")
    if not (out / "sweep.png").exists():
        sys.stderr.write("qnnpasses: warning: sweep.png not drawn: matplotlib is not installed "
                         "(pip install 'qnnpasses[plot]' or pip install matplotlib)\n")
    return 0
