"""KV-cache rewrites: turn a dynamic-cache decoder export into a static-cache graph.

``expose-positions`` makes rotary positions a graph input, ``window-positions`` makes a
sliding-window mask follow those positions instead of the cache slots, ``kv-new-outputs`` makes the
graph output only the new K/V instead of the concatenated cache, ``kv-split-concat``
removes the Concat of the cache by distributing it over what consumes it.
"""
