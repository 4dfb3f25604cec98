"""``posenc show``: pictures of what an encoding does, drawn before anything is trained.

    scores.py   the command, and the score map: what an encoding adds to the attention scores, per head
    inputs.py   every input checked (with its bound) before anything is computed; the one PNG writer
    scaling.py  ``posenc show rope --scaling``: the wavelength of every rotated pair, original vs scaled
    grid.py     a 2-D rotation's score pattern over a patch grid, seen from one patch
    layers.py   ``posenc show --schedule``: which keys each layer of a layer schedule sees
"""
