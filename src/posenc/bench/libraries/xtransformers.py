"""x-transformers as a compared library: posenc's methods mapped to its options, and its model.

The counterpart of ``posenc.LM`` is ``TransformerWrapper`` + ``Decoder`` with the same dim, depth,
heads and head dim = dim / heads (``attn_dim_head``; its default of 64 would make the attention
twice as wide as posenc's at dim 256), tied embeddings. Each method runs with its default attention
(:data:`XT`) and with ``attn_flash=True`` (:data:`XT_FLASH`, PyTorch's SDPA). A configuration the
library rejects while building (flash with the T5 bias) is "refused"; a method it lacks is "n/a".
"""

from __future__ import annotations

from torch import nn

from ..job import Job

NAME = "x-transformers"
PACKAGE = "x_transformers"  # import name, checked before any job runs
XT, XT_FLASH = "x-transformers", "x-transformers flash"
IMPLS = (XT, XT_FLASH)

# posenc method -> (TransformerWrapper options, Decoder options); None: no counterpart. Read from
# x-transformers 2.31's source: ALiBi does not switch the absolute embedding off by itself, and its
# rotary embedding rotates half the head dim unless told otherwise (posenc rotates all of it).
METHODS: dict[str, tuple[dict, dict] | None] = {
    "nope": ({"use_abs_pos_emb": False}, {}),
    "sinusoidal": ({"use_abs_pos_emb": True, "scaled_sinu_pos_emb": True}, {}),  # with a learned scale
    "learned": ({"use_abs_pos_emb": True}, {}),
    "rope": ({"use_abs_pos_emb": False}, {"rotary_pos_emb": True, "rotary_emb_dim": None}),  # None: head dim
    "alibi": ({"use_abs_pos_emb": False}, {"alibi_pos_bias": True}),
    "t5": ({"use_abs_pos_emb": False}, {"rel_pos_bias": True, "rel_pos_num_buckets": 32, "rel_pos_max_distance": 128}),
    "shaw": None,
    "transformer_xl": None,
    "xpos": ({"use_abs_pos_emb": False}, {"rotary_xpos": True, "rotary_emb_dim": None}),
    # CoPE: x-transformers' own (attn_use_cope); posenc's cope default max_pos is 16 as well.
    "cope": ({"use_abs_pos_emb": False}, {"attn_use_cope": True, "attn_cope_max_pos": 16}),
    # PoPE: PolarEmbedding (one phase bias for all layers there, one per layer in posenc).
    "pope": ({"use_abs_pos_emb": False}, {"polar_pos_emb": True}),
    # The dynamic position bias: width dim // 4 and depth 2 in both, distances not log-spaced.
    "dpb": ({"use_abs_pos_emb": False}, {"dynamic_pos_bias": True, "dynamic_pos_bias_mlp_depth": 2}),
    # The Inkling bias: RelativeProjPositionalBias (16 curves over 1,024 distances, as posenc's
    # default; x-transformers' has no L2 clip and a biased projection, posenc's default clips at 8).
    "inkling": ({"use_abs_pos_emb": False}, {"attn_use_rel_proj_pos_bias": True, "attn_rel_proj_num_distance_basis": 16,
                                             "attn_rel_proj_max_dist": 1024}),
    # Selective attention (its Attend's selective flag: head 0 selects; it keeps no KV cache).
    "selective": ({"use_abs_pos_emb": False}, {"attn_selective": True}),
}


def has_counterpart(method: str) -> bool:
    return METHODS.get(method) is not None


def build_model(job: Job) -> nn.Module:
    """The x-transformers decoder LM matching posenc's LM config for ``job``.

    Raises ValueError for a method without a counterpart; the library's own exception (an
    AssertionError for flash with the T5 bias) when it refuses the configuration.
    """
    from x_transformers import Decoder, TransformerWrapper

    counterpart = METHODS.get(job.method)
    if counterpart is None:
        raise ValueError(f"x-transformers has no counterpart of {job.method!r}")
    wrapper_options, decoder_options = (dict(d) for d in counterpart)
    head_dim = job.dim // job.heads
    if "rotary_emb_dim" in decoder_options:
        decoder_options["rotary_emb_dim"] = head_dim
    if job.impl == XT_FLASH:
        decoder_options["attn_flash"] = True
    decoder = Decoder(
        dim=job.dim, depth=job.depth, heads=job.heads, attn_dim_head=head_dim, verbose=False, **decoder_options
    )
    return TransformerWrapper(
        num_tokens=job.vocab, max_seq_len=job.length, attn_layers=decoder, tie_embedding=True, **wrapper_options
    )
