"""qnnpasses: ONNX graph-rewriting passes that put exported transformers on Qualcomm's QNN HTP."""

__version__ = "0.1.0"
