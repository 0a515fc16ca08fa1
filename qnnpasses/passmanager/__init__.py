"""Layer 3, the pass machinery: the pass API and registry (``api``), the graph-surgery
helpers every pass shares (``rewrite``), textual pipelines (``spec``) and the named ones
(``named``), the manager that runs, checks, verifies and rolls back (``manager``), its
instruments and the run report.
"""
