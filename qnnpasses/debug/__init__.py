"""Finding what went wrong: output comparison with layer bisection (``compare``) and
bisection of graphs the HTP refuses to finalize (``diagnose``).
"""
