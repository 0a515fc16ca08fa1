"""The built-in rewrite passes, one package per family.

=============  ====================================================================
``shapes``     static shapes (fix-shapes)
``fold``       constant folding and clean-up (simplify, cleanup)
``lowering``   what the HTP lacks, in terms it runs (lower-int64)
``attention``  masks, grouped K/V, heads, rotary (attention-cleanup, gqa-broadcast,
               mha-to-gqa, quant-mask, rotary)
``norm``       RMSNorm/LayerNorm/GeLU fusion and decomposition, fp16 safety
``layout``     data movement (layout, gathernd)
=============  ====================================================================

A family's private helpers are its ``_*.py`` modules; no family imports another's.
Helpers more than one family needs live in ``qnnpasses.passmanager.rewrite`` (graph
surgery) and ``qnnpasses.ir`` (analyses of a graph).
"""
