"""Layer 2, the backends a graph runs on: onnxruntime CPU (``cpu``: verification inputs,
runs and output comparison) and Qualcomm's HTP through onnxruntime-qnn (``htp``).
"""
