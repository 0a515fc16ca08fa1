"""tools/llm_eval.py's fp16 ceiling: weights rounded to fp16 while computing in fp32, the off-HTP runs
measured as the pair is (own greedy generation, teacher-forced top-1), and the sentence the report
draws from them (figures from the results, none typed in)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import accuracy_metrics as am
import llm_eval as le


def test_round_weights_rounds_float_weights_keeps_scalars_and_fp32_compute():
    rng = np.random.default_rng(0)
    w, x = rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    ids = numpy_helper.from_array(np.arange(3, dtype=np.int64), "ids")
    fill = numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "fill")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(w, "w"), ids, fill])
    model = am.round_weights(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    stored = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    rounded = w.astype(np.float16).astype(np.float32)
    assert stored["w"].dtype == np.float32 and np.array_equal(stored["w"], rounded) and not np.array_equal(rounded, w)
    assert np.array_equal(stored["ids"], np.arange(3)) and stored["fill"] == np.finfo(np.float32).min  # a scalar
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ rounded, rtol=1e-6, atol=1e-6)


class _Model:
    """Generates the reference's tokens up to ``split``, then token 0; argmax = reference except at ``wrong``."""

    def __init__(self, ref: dict, split: int, wrong: int):
        self.ref, self.split, self.wrong = ref, split, wrong

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        return self.ref["tokens"][:self.split] + [0] * (max_new_tokens - self.split)

    def logits(self, ids: list[int]) -> np.ndarray:
        top = list(self.ref["greedy_top1"])
        top[self.wrong] = 0
        return np.eye(10)[top]  # top-1 leads every other token by exactly 1


def test_ceiling_run_counts_own_generation_and_teacher_forced_top1():
    items = [{"window": 3, "prompt": [1, 2, 3]}]
    refs = [{"tokens": [5, 6, 7, 8], "greedy_top1": [9, 9, 5, 6, 7, 8]}]
    ties = [{"margin": [1.0, 1.0, 1.0, 1.0, 0.05, 1.0], "runner_up": [1] * 6, "top1": [20.0] * 6,
             "fp16_spacing": [0.0156] * 6}]
    run = le.ceiling_run(_Model(refs[0], split=2, wrong=4), items, refs, ties)
    assert run["identical_leading"] == [2] and run["identical_leading_mean"] == 2.0
    assert run["top1"] == 5 / 6 and run["positions"] == 6 and run["top1_generated"] == 3 / 4
    assert run["prompts"][0]["pair_tokens"] == [5, 6, 0, 8] and "prefill_seconds_mean" not in run
    # fp32's margins (1 or 0.05 at position 4) against the model's (1, or 0 where its argmax is elsewhere)
    assert run["margin_shift_max"] == pytest.approx(0.05) and run["margin_shift_std"] == pytest.approx(np.std([0.0] * 5 + [-0.05]))
    le.divergences(run, items, refs, ties)
    assert [(d["token"], d["fp32_margin"]) for d in run["prompts"][0]["differs_at"]] == [(2, 0.05)]


def _greedy(leading: list[int], **more) -> dict:
    return {"identical_leading": leading, "identical_leading_mean": float(np.mean(leading)), "top1": 0.99,
            "positions": 47 * len(leading), "top1_generated": 0.98,
            "prompts": [{"differs_at": []} for _ in leading], **more}


def _doc(torch_fp16: list[int]) -> dict:
    shift = {"margin_shift_std": 0.0134, "margin_shift_max": 0.108}
    ceilings = {"fp16-weights": _greedy([32, 32], **shift), "torch-fp16": _greedy(torch_fp16, **shift),
                "torch-bf16": _greedy([7, 14], **shift)}
    htp = _greedy([9, 27], max_fp32_margin_where_differing=0.073)
    return {"settings": {"new_tokens": 32}, "exports": {"kv_ts": {"runs": {"fp16:greedy": htp}, "ceilings": ceilings}}}


def test_ceiling_table_sets_the_htp_pair_next_to_fp16_off_the_htp_and_says_what_it_shows():
    rows = le._ceiling_rows(_doc([32, 31]))
    text = "\n".join(rows)
    assert "| TorchScript | fp16 pair on the HTP (this project) | 18.00 (9, 27) |" in text
    assert "| TorchScript | Hugging Face model in torch float16 (CPU) | 31.50 (32, 31) |" in text
    assert text.count("| 0.013 (0.108) |") == 3 and "| - (argmax only) |" in text
    assert ("moves by σ ≤ 0.013 (at most 0.108) in torch fp16; the HTP pair lost the original's choice where it led "
            "by up to 0.073.") in text
    assert "in torch fp16 31.50 (TorchScript)" in text and "the HTP result has headroom" in text
    doc = _doc([20, 31])
    doc["exports"]["kv_ts"]["runs"]["fp16:greedy"].update(margin_shift_std=0.05, margin_shift_max=0.2)
    below = "\n".join(le._ceiling_rows(doc))
    assert "| TorchScript | fp16 pair on the HTP (this project) | 18.00 (9, 27) | 99.0% of 94 (2 prompts) (98.0% of the generated) | none | 0.050 (0.200) |" in below
    assert "σ ≤ 0.013 (at most 0.108) in torch fp16, by σ ≤ 0.050 (at most 0.200) on the HTP;" in below
    assert "headroom" not in below and "stays below 30 of 32 too" in below
    assert le._ceiling_rows({"settings": {"new_tokens": 32}, "exports": {"kv_ts": {"runs": {}}}}) == []
    # the HTP pair at the target: no shortfall to explain
    doc = _doc([32, 32])
    doc["exports"]["kv_ts"]["runs"]["fp16:greedy"] = _greedy([32, 32], margin_shift_std=0.0101, margin_shift_max=0.04)
    reached = "\n".join(le._ceiling_rows(doc))
    assert ("the HTP pair reaches ≥ 30 of 32 on these prompts too, moving fp32's top-2 margin less than torch fp16 "
            "does (σ 0.010 against 0.013).") in reached
    assert "headroom" not in reached and "shortfall" not in reached


def test_ceiling_verdict_calls_flips_near_ties_when_the_htp_moves_margins_as_little_as_torch_fp16():
    doc = _doc([32, 32])
    doc["exports"]["kv_ts"]["runs"]["fp16:greedy"].update(margin_shift_std=0.0150, margin_shift_max=0.09,
                                                          max_fp32_margin_where_differing=0.029)
    text = "\n".join(le._ceiling_rows(doc))
    assert ("the HTP pair moves fp32's top-2 margin about as much as torch fp16 does (σ 0.015 against 0.013): every "
            "token it generates differently led in fp32 by at most 0.029, 2.2σ of torch fp16's own error") in text
    assert "headroom" not in text
    # a lead of over 3σ lost: not a near-tie
    doc["exports"]["kv_ts"]["runs"]["fp16:greedy"].update(max_fp32_margin_where_differing=0.073)
    assert "the HTP result has headroom" in "\n".join(le._ceiling_rows(doc))
    # twice torch's spread: the pair computes less precisely, so the shortfall has headroom
    doc["exports"]["kv_ts"]["runs"]["fp16:greedy"].update(margin_shift_std=0.0268, max_fp32_margin_where_differing=0.029)
    assert "the HTP result has headroom" in "\n".join(le._ceiling_rows(doc))


def test_fp16_ties_sentence_counts_margins_below_fp16_resolution():
    def differs(margin: float) -> dict:
        return {"fp32_top1": 14.8, "fp16_spacing": 0.0078125, "fp32_margin": margin}

    greedy = {"prompts": [{"positions": 47, "agree": 46, "differs_at": [differs(0.0014)]},
                          {"positions": 47, "agree": 46, "differs_at": [differs(0.03)]}]}
    quantized = {"prompts": [{"positions": 47, "agree": 40, "differs_at": [differs(0.8)]}]}
    doc = {"exports": {"kv_ts": {"runs": {"fp16:greedy": greedy, "w8a16:greedy": quantized}}}}
    text = le._fp16_ties(doc)
    # the quantized run's margins are not fp16 near-ties: only the fp16 pair's count
    assert "every such margin is within 3.8 of those spacings, and 1 of 2 below half of one" in text
    assert "The largest of these margins is 0.030" in text
    assert le._fp16_ties({"exports": {"kv_ts": {"runs": {"w8a16:greedy": quantized}}}}) == ""
    # a pair with logits-offset resolves the margin near 0: the activations' error is what flips it
    greedy["margin_shift_std"] = 0.007
    doc["exports"]["kv_ts"]["builds"] = {"fp16": {"logits_offset": True}}
    text = le._fp16_ties(doc)
    assert "below half of one" not in text
    assert ("resolves the runner-up of such a margin to 2e-05 or finer: what flips it is the fp16 error the "
            "activations accumulate before the lm_head, which moves fp32's top-2 margin by σ 0.007: the "
            "largest margin lost is 4.3σ") in text


def test_offset_note_sets_what_each_form_of_the_logits_buys_against_its_bytes():
    """The sentence on the logits' forms: each pair's greedy figures and its footprint, labelled by
    what its build did (plain, the offset over the first tokens, over every token), from the results
    (none typed in); nothing with fewer than two forms measured."""
    def run(leading: float, top1: float, sigma: float) -> dict:
        return {"identical_leading_mean": leading, "top1": top1, "margin_shift_std": sigma}

    def build(total: int, read: int, ceiling: float, **offset) -> dict:
        return {**offset, "device": {"device_bytes": total, "decode_step_read_bytes": read,
                                     "decode_tokens_per_second_ceiling": ceiling, "target": "8elite"}}

    mib = 2 ** 20
    doc = {"exports": {"kv_ts": {
        "runs": {"fp16-offset:greedy": run(32.0, 1.0, 0.010), "fp16:greedy": run(32.0, 1.0, 0.011),
                 "fp16-plain:greedy": run(24.0, 0.995, 0.012)},
        "builds": {"fp16-offset": build(736 * mib, 330 * mib, 352.5, logits_offset=True, offset_candidates=0),
                   "fp16": build(632 * mib, 280 * mib, 410.0, logits_offset=True, offset_candidates=4096),
                   "fp16-plain": build(627 * mib, 275 * mib, 413.7, logits_offset=False)}}}}
    text = le._offset_note(doc)
    assert ("TorchScript: fp16, plain logits: 24.00 identical leading tokens, top-1 99.5% (fp32's top-2 margin "
            "moved by σ 0.012), 627 MiB on the device, 275 MiB read per decode step (a memory-bandwidth ceiling "
            "of 413.7 tokens/s on the Snapdragon 8 Elite); fp16, logits-offset (first 4,096 tokens): 32.00 "
            "identical leading tokens, top-1 100.0% (fp32's top-2 margin moved by σ 0.011), 632 MiB on the "
            "device, 280 MiB read per decode step (a memory-bandwidth ceiling of 410.0 tokens/s on the "
            "Snapdragon 8 Elite); fp16, logits-offset (every token): 32.00") in text
    # an earlier fp16 pair with the offset recorded no candidates: it took every token
    assert le._label(doc["exports"]["kv_ts"], "fp16-offset") == "fp16, logits-offset (every token)"
    del doc["exports"]["kv_ts"]["builds"]["fp16-offset"]["offset_candidates"]
    assert le._label(doc["exports"]["kv_ts"], "fp16-offset") == "fp16, logits-offset (every token)"
    for name in ("fp16-offset", "fp16"):
        del doc["exports"]["kv_ts"]["runs"][f"{name}:greedy"]
    assert le._offset_note(doc) == ""
