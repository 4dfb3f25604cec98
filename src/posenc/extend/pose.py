"""PoSE's position ids: a short training window whose positions cover a longer target length.

Zhu et al., ICLR 2024, "PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise
Training" (arXiv 2309.10400), §3.2. The model is fine-tuned on windows of ``window`` tokens (the
paper's original context window ``L_c``) while their position ids range over the ``target`` length
(``L_t``), so that it sees every relative distance up to ``target - 1`` at the cost of training at
``window``. The definition, in the paper's notation:

- the window is cut into ``N`` chunks ``c_0 .. c_{N-1}`` (here ``chunks``, the paper's default 2) of
  lengths ``l_0 .. l_{N-1}``, ``sum l_i = L_c``, every one non-empty; the cut points are drawn
  uniformly (the ``N - 1`` cuts a uniformly drawn subset of ``{1, .., L_c - 1}``: for 2 chunks, the
  split point uniform over ``{1, .., L_c - 1}``);
- chunk ``c_i`` starts at ``st_i = sum_{j<i} l_j`` in the window, and its position ids are its
  offsets plus a skipping bias ``u_i``: ``Pos(c_i) = {u_i + st_i, .., u_i + st_i + l_i - 1}``;
- the biases are drawn per example: ``u_0 = 0``, ``u_i ~ U({u_{i-1}, .., L_t - L_c})`` (uniform over
  the integers, so they never decrease and the last id is at most ``L_t - 1``).

Within a chunk the ids step by 1; across chunks they skip by ``u_i - u_{i-1} >= 0``; the first id is
0. The text of the chunks: the paper takes chunk ``c_i``'s tokens from ``v_i + st_i`` on, with
``v_i`` drawn too; here the content is always the window's consecutive tokens (``v_i = 0`` for
every chunk: the simplest form of the definition; the window's text is unchanged and only its
position ids skip). The paper's sampled ``v_i`` is not implemented.

With ``chunks == 1`` or ``target == window`` the ids are ``0 .. window - 1``. The draws come from
the generator given, so a batch of step ``s`` is a pure function of the generator's seed
(:func:`step_positions` seeds it from the data seed and the step, as the study's batches are).
"""

from __future__ import annotations

import torch

from ..errors import UsageError

POSE_STREAM = 7_000_003  # PoSE's draws of step s: a generator seeded apart from the windows' (data.train_batch)


def _check(window: int, target: int, chunks: int, batch: int = 1) -> None:
    for name, value in (("window", window), ("target", target), ("chunks", chunks), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{name} must be an integer, got {value!r}")
    if window < 1:
        raise UsageError(f"window must be an integer >= 1, got {window}")
    if target < window:
        raise UsageError(f"target must be >= window ({window}), got {target}")
    if not 1 <= chunks <= window:
        raise UsageError(f"chunks must be in [1, window={window}] (every chunk holds at least one token), got {chunks}")
    if batch < 1:
        raise UsageError(f"batch must be an integer >= 1, got {batch}")


def pose_layout(batch: int, window: int, target: int, chunks: int, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks of ``batch`` examples: (lengths, biases), each (batch, chunks) int64.

    ``lengths[b, i]`` is ``l_i`` (>= 1, summing to ``window``), ``biases[b, i]`` is ``u_i``
    (``u_0 = 0``, non-decreasing, ``u_{N-1} <= target - window``); see the module docstring.

    Raises:
        UsageError: ``window < 1``, ``target < window``, ``chunks`` outside ``[1, window]``, ``batch < 1``.
    """
    _check(window, target, chunks, batch)
    if chunks == 1:
        cuts = torch.zeros(batch, 0, dtype=torch.long)
    else:  # chunks - 1 distinct cut points, a uniform subset of {1, .., window - 1}
        order = torch.rand(batch, window - 1, generator=generator, dtype=torch.float64).argsort(dim=1)
        cuts = (order[:, : chunks - 1] + 1).sort(dim=1).values  # (B, N-1)
    edges = torch.cat([torch.zeros(batch, 1, dtype=torch.long), cuts, torch.full((batch, 1), window)], dim=1)
    lengths = edges.diff(dim=1)  # (B, N)
    room = target - window  # the largest bias
    biases = torch.zeros(batch, chunks, dtype=torch.long)
    for i in range(1, chunks):  # u_i ~ U({u_{i-1}, .., room})
        previous = biases[:, i - 1]
        span = (room - previous + 1).double()  # how many values
        draw = (torch.rand(batch, generator=generator, dtype=torch.float64) * span).floor().long()
        biases[:, i] = previous + torch.minimum(draw, (span - 1).long())
    return lengths, biases


def positions_of(lengths: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """The position ids (B, window) of chunks (lengths, biases), (B, N) each: token ``t`` of the
    window, in chunk ``i``, gets ``t + u_i`` (``= u_i + st_i + its offset in the chunk``)."""
    window = int(lengths[0].sum())
    chunk = torch.repeat_interleave(torch.arange(lengths.shape[1]).expand_as(lengths).reshape(-1), lengths.reshape(-1))
    chunk = chunk.view(lengths.shape[0], window)  # (B, T): each token's chunk
    return torch.arange(window) + biases.gather(1, chunk)


def pose_position_ids_batch(batch: int, window: int, target: int, chunks: int, generator: torch.Generator) -> torch.Tensor:
    """PoSE position ids of ``batch`` examples, (batch, window) int64, each drawn independently
    (:func:`pose_layout`, then :func:`positions_of`).

    Raises:
        UsageError: as :func:`pose_layout`.
    """
    return positions_of(*pose_layout(batch, window, target, chunks, generator))


def pose_position_ids(window: int, target: int, chunks: int, generator: torch.Generator) -> torch.Tensor:
    """PoSE position ids of one example (Zhu et al. 2024, §3.2; see the module docstring): (window,) int64.

    ``window`` tokens cut into ``chunks`` non-empty chunks at uniformly drawn points; chunk ``i``'s
    ids are its in-window offsets plus ``u_i``, ``u_0 = 0``, ``u_i ~ U({u_{i-1}, .., target - window})``.
    ``chunks == 1`` or ``target == window``: ``0 .. window - 1``.

    Raises:
        UsageError: ``window < 1``, ``target < window``, or ``chunks`` outside ``[1, window]``.
    """
    return pose_position_ids_batch(1, window, target, chunks, generator)[0]


def step_positions(seed: int, step: int, batch: int, window: int, target: int, chunks: int) -> torch.Tensor:
    """The PoSE position ids (batch, window) of training step ``step``: a pure function of
    (seed, step), from a generator seeded apart from the step's windows (``POSE_STREAM``), so a run
    resumed at step s draws what an unbroken one would."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 2 + POSE_STREAM)
    return pose_position_ids_batch(batch, window, target, chunks, g)


__all__ = ["POSE_STREAM", "pose_layout", "pose_position_ids", "pose_position_ids_batch", "positions_of", "step_positions"]
