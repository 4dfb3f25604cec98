"""The tests' one small LM: :func:`tiny_lm` (imported by the test modules, not collected itself).

Every test that needs a posenc LM builds it here, so the rule that makes positions matter in a
test (which parameters are redrawn, and how large) is written once.
"""

from __future__ import annotations

import torch

import posenc


def tiny_lm(method: str = "alibi", *, vocab_size: int = 64, dim: int = 32, depth: int = 2, num_heads: int = 4,
         positions_std: float | None = 0.3, weights_std: float | None = None, seed: int | None = None,
         **config) -> posenc.LM:
    """A small LM in eval mode: (vocab 64, dim 32, depth 2, 4 heads) unless given.

    Args:
        method: the encoding (``LMConfig.encoding``).
        positions_std: every parameter of an encoding module (a position table, slopes, gates) is
            redrawn from N(0, positions_std^2), larger than its init, so that a wrong position shows
            far above rounding; None keeps the init.
        weights_std: every weight matrix (2-D parameter) is redrawn from N(0, weights_std^2), so
            that one token's influence on another is far above rounding noise (and argmax ties are
            out of the question); None keeps the init.
        seed: ``torch.manual_seed(seed)`` before building; None uses the current generator (the
            tests' autouse fixture seeds it with 0).
        config: other :class:`posenc.LMConfig` fields (``causal``, ``attention_backend``,
            ``max_positions``, ``encoding_options``, ``random_positions``, ...).
    """
    if seed is not None:
        torch.manual_seed(seed)
    model = posenc.LM(posenc.LMConfig(encoding=method, vocab_size=vocab_size, dim=dim, depth=depth,
                                      num_heads=num_heads, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if positions_std is not None and any(part.startswith("encoding") for part in name.split(".")):
                p.normal_(std=positions_std)
            elif weights_std is not None and p.dim() == 2:
                p.normal_(std=weights_std)
    return model.eval()


def saved_learned_lm(folder, max_positions: int):
    """A byte-level one-layer LM with a learned table of ``max_positions``, saved as a study saves its
    rows (``folder/checkpoints/learned.safetensors`` and its json); returns the weights' path."""
    from posenc.model.checkpoint import save_checkpoint

    torch.manual_seed(5)
    model = posenc.LM(posenc.LMConfig(encoding="learned", vocab_size=256, dim=32, depth=1, num_heads=2, max_positions=max_positions))
    path = folder / "checkpoints" / "learned.safetensors"
    path.parent.mkdir()
    save_checkpoint(model, path)
    return path


def tiny_rope_checkpoint(root) -> tuple:
    """A tiny RoPE LM saved as ``root/rope.safetensors`` and a small corpus ``root/corpus.txt`` beside
    it (posenc extend's tests): (checkpoint path, corpus path)."""
    from posenc import save_checkpoint

    text = root / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(1500)))
    torch.manual_seed(0)
    save_checkpoint(posenc.LM(posenc.LMConfig(encoding="rope", dim=16, depth=1, num_heads=2)), root / "rope.safetensors")
    return root / "rope.safetensors", text
