"""What one attention call is, before a backend runs it: where its queries and keys stand and what
the scores hold.

    geometry.py  Geometry (positions, documents, padding, causality of one call), planned into
                 backend calls
    spec.py      ScoreSpec (what a backend is handed: the encoding, the positions and the score
                 terms), made by a Geometry
    inputs.py    q, k, v, gates and curves checked against the encoding before a call runs
    axes.py      multi-axis positions (M-RoPE, 2-D RoPE): shapes checked and named
    memo.py      ForwardMemo (what one model forward computes once for all its layers) and
                 Workspace (what a KV cache keeps between decode steps)
"""
