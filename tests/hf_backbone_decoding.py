"""Cached greedy decoding of a bare M-RoPE text backbone, shared by tests/hf/test_mrope_backbones.py and
tests/hf/test_mrope_rows.py (a helper module, not a test file)."""

from __future__ import annotations

import inspect

import torch


def cache_name(model: torch.nn.Module) -> str:
    """transformers' cache keyword (``cache`` since 5.24; ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
           steps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached greedy decoding of a bare backbone (next token: the last hidden state against the
    input embeddings), each row going on at its own max(id) + 1 on every axis, as transformers'
    rope_deltas do (HunYuan-VL's: its slot).

    Args:
        ids: (B, T) token ids.
        pos: (A, B, T) position ids, one row per axis (A = 3 for M-RoPE, 4 for XD-RoPE).
        mask: (B, T) padding mask, or None.

    Returns:
        (tokens (B, steps), the last hidden states (B, steps, C)).
    """
    table = model.get_input_embeddings().weight
    name = cache_name(model)
    nxt = pos.amax(dim=(0, 2))  # (B,)
    found, states = [], []
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
        for _ in range(steps):
            last = out.last_hidden_state[:, -1]  # (B, C)
            states.append(last)
            token = (last @ table.T).argmax(-1, keepdim=True)  # (B, 1)
            found.append(token)
            nxt = nxt + 1
            if mask is not None:
                mask = torch.cat((mask, torch.ones_like(token)), dim=1)
            step = nxt.view(1, -1, 1).expand(pos.shape[0], -1, 1)  # (A, B, 1)
            held = out.cache if name == "cache" else out.past_key_values
            out = model(token, attention_mask=mask, position_ids=step, use_cache=True, **{name: held})
    return torch.cat(found, dim=1), torch.stack(states, dim=1)


def hidden(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """The backbone's last hidden states (B, T, C), without grad."""
    with torch.no_grad():
        return model(ids, **kwargs).last_hidden_state


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def assert_exact(model: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, forms: list[dict],
                 padded: tuple[torch.Tensor, torch.Tensor], tolerance: float) -> None:
    """``model`` (under posenc) against the untouched ``ref``: each of ``forms`` (the forward's keyword
    arguments), the image ids ``pos`` (A, B, T) mattering at all, a left-padded batch ``padded`` =
    (its ids (A, B, T), its mask (B, T)) at its real tokens, and cached greedy decoding after the
    image, unpadded and left-padded."""
    for kwargs in forms:
        assert gap(hidden(model, ids, **kwargs), hidden(ref, ids, **kwargs)) < tolerance, list(kwargs)
    # the image ids matter: the same model without them differs (the check above could fail)
    assert gap(hidden(model, ids, position_ids=pos), hidden(model, ids)) > 1e-3
    ppos, mask = padded
    real = mask.bool()
    assert gap(hidden(model, ids, position_ids=ppos, attention_mask=mask)[real],
               hidden(ref, ids, position_ids=ppos, attention_mask=mask)[real]) < tolerance
    for p, m in ((pos, None), (ppos, mask)):
        ours, theirs = greedy(model, ids, p, m), greedy(ref, ids, p, m)
        assert torch.equal(ours[0], theirs[0])
        assert gap(ours[1], theirs[1]) < tolerance
