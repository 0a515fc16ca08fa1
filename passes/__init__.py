"""The built-in rewrite passes, one package per family.

=============  ====================================================================
``shapes``     static shapes (fix-shapes)
``fold``       constant folding and clean-up (simplify, cleanup, tied-embedding)
``lowering``   what the HTP lacks, in terms it runs (lower-int64)
``attention``  masks, grouped K/V, heads, rotary (attention-cleanup, gqa-broadcast,
               mha-to-gqa, quant-mask, rotary)
``norm``       RMSNorm/LayerNorm/GeLU fusion and decomposition, fp16 safety and the
               fp16-precise forms of SiLU and Softmax (silu-tanh, softmax-exp)
``layout``     data movement (layout, gathernd)
``kvcache``    a dynamic-cache decoder's I/O made static (expose-positions,
               window-positions, kv-new-outputs, kv-split-concat)
``logits``     the logits' resolution in fp16 (logits-offset)
``outliers``   activation outliers moved out of quantization's way (rotate-residual,
               smooth-mlp, fold-norm-weights)
=============  ====================================================================

A family's private helpers are its ``_*.py`` modules; no family imports another's.
Helpers more than one family needs live in ``qnnpasses.passmanager.rewrite`` (graph
surgery) and ``qnnpasses.ir`` (analyses of a graph).
"""
