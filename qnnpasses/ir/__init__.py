"""Layer 1, the IR: the model under rewrite and what is true of any graph.

``model`` (the IR with lazy weights, export with stubs, saving), ``load`` (untrusted
model files into the IR), ``checks`` (checker + strict shape inference), ``shapes``
(static/symbolic dimensions), ``canonical`` (the stable text form diffs are made on),
``index_map`` (which input element each output element of a data-movement chain reads),
``kv_roles`` (the roles of a KV-cache decoder export's inputs and outputs, found from its graph).
Nothing here knows about passes or backends.
"""
