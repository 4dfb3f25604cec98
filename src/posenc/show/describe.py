"""``posenc list`` and ``posenc buckets``: the methods and the T5 bucket table, as text.

Every user mistake is a :class:`~posenc.errors.UsageError` naming the parameter and its range.
"""

from __future__ import annotations

import argparse

import torch

from ..encodings import REGISTRY, build, relative_position_bucket
from ..errors import check_int

# `list` builds every encoding on the meta device (shapes only, no memory) to count parameters;
# RoPE still builds its cos/sin table for real, 2048 x head_dim/2 in float64 (32 MiB at the bound).
MAX_LIST_HEADS = 4096
MAX_LIST_HEAD_DIM = 4096
MAX_BUCKETS = 4096  # one printed row per bucket
MAX_DISTANCE = 2**20  # the table buckets every distance up to 2 * max_distance + 2 on both sides


def add_list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-heads", type=int, default=8, help="heads, for counting parameters (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dim, for counting parameters (default 64)")


def learnable_parameters(name: str, num_heads: int, head_dim: int) -> str:
    """The parameter count and shapes of ``name`` at these sizes, or why it cannot be built at them."""
    check_int("num_heads", num_heads, 1, MAX_LIST_HEADS)
    check_int("head_dim", head_dim, 1, MAX_LIST_HEAD_DIM)
    try:
        with torch.device("meta"):
            enc = build(name, num_heads=num_heads, head_dim=head_dim)
    except ValueError as err:  # e.g. rope with an odd head_dim: the other methods still list
        return f"n/a at num_heads={num_heads}, head_dim={head_dim} ({err})"
    params = [(n, tuple(p.shape)) for n, p in enc.named_parameters()]
    if not params:
        return "none"
    total = sum(p.numel() for p in enc.parameters())
    shapes = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in params)
    scope = "shared by all layers" if enc.shares_across_layers else "per layer"
    return f"{total:,} ({shapes}; {scope})"


def run_list(args: argparse.Namespace) -> int:
    check_int("num_heads", args.num_heads, 1, MAX_LIST_HEADS)
    check_int("head_dim", args.head_dim, 1, MAX_LIST_HEAD_DIM)
    rows = []
    for name, cls in REGISTRY.items():
        limit = "yes" if cls.extrapolates else "no (bounded by its table)"
        rows.append((name, cls.description, learnable_parameters(name, args.num_heads, args.head_dim), limit))
    print(f"learnable parameters for num_heads={args.num_heads}, head_dim={args.head_dim} (model dim {args.num_heads * args.head_dim})\n")
    for name, desc, params, limit in rows:
        print(f"{name}\n    {desc}\n    learnable parameters: {params}\n    runs past its training length: {limit}")
    return 0


def add_buckets_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-buckets", type=int, default=32, help="total buckets (default 32)")
    parser.add_argument("--max-distance", type=int, default=128, help="distance where the last bucket starts (default 128)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="bidirectional", action="store_false", help="one-sided (decoder) buckets (default)")
    mode.add_argument("--bidirectional", dest="bidirectional", action="store_true", help="two-sided (encoder) buckets")
    parser.set_defaults(bidirectional=False)


def check_buckets(num_buckets: object, max_distance: object, bidirectional: bool) -> tuple[int, int]:
    """T5's bucket sizes: each side needs one exact and one log bucket, and max_distance must lie
    beyond the exact distances (per side n buckets, the first n // 2 distances exact)."""
    low, why = (4, " (bidirectional: an exact and a log bucket on each side)") if bidirectional else (2, " (causal: an exact and a log bucket)")
    num_buckets = check_int("num_buckets", num_buckets, low, MAX_BUCKETS, why)
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    why = f" (beyond the {exact} exact distances of num_buckets={num_buckets})"
    return num_buckets, check_int("max_distance", max_distance, exact + 1, MAX_DISTANCE, why)


def bucket_ranges(num_buckets: int, max_distance: int, bidirectional: bool) -> list[tuple[int, int | None, int | None, str]]:
    """Rows (bucket, lowest r or None, highest r or None, kind) covering r = j - i; None = unbounded.

    Each bucket covers one interval of r (T5's buckets are monotone in the distance on each side).
    """
    num_buckets, max_distance = check_buckets(num_buckets, max_distance, bidirectional)
    span = 2 * max_distance + 2  # past every bucket edge: the ends of r stand for -inf / +inf
    r = torch.arange(-span, span + 1)
    b = relative_position_bucket(r, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    lows = torch.full((num_buckets,), span + 1).scatter_reduce(0, b, r, "amin")  # (num_buckets,)
    highs = torch.full((num_buckets,), -span - 1).scatter_reduce(0, b, r, "amax")
    per_side = num_buckets // 2 if bidirectional else num_buckets
    exact = per_side // 2
    rows: list[tuple[int, int | None, int | None, str]] = []
    for bucket, (lo, hi) in enumerate(zip(lows.tolist(), highs.tolist())):
        if lo > hi:
            rows.append((bucket, 0, 0, "unused"))
            continue
        side_index = bucket % per_side if bidirectional else bucket
        kind = "exact" if side_index < exact else ("last" if side_index == per_side - 1 else "log")
        # The last bucket of a side is unbounded; the causal bucket 0 also holds all of r > 0.
        rows.append((bucket, None if lo == -span else lo, None if hi == span else hi, kind))
    return rows


def _fmt(v: int | None, neg: bool) -> str:
    return ("-inf" if neg else "+inf") if v is None else str(v)


def run_buckets(args: argparse.Namespace) -> int:
    rows = bucket_ranges(args.num_buckets, args.max_distance, args.bidirectional)
    mode = "bidirectional (encoder)" if args.bidirectional else "causal (decoder)"
    print(f"T5 relative-position buckets: {mode}, num_buckets={args.num_buckets}, max_distance={args.max_distance}")
    print("relative position r = j - i (key minus query); r < 0: the key is in the past")
    if args.bidirectional:
        print(f"buckets 0..{args.num_buckets // 2 - 1}: keys at or before the query (r <= 0); "
              f"buckets {args.num_buckets // 2}..{args.num_buckets // 2 * 2 - 1}: keys after it (r > 0)"
              + ("; with an odd num_buckets the last bucket is never used" if args.num_buckets % 2 else ""))
    else:
        print("bucket 0 also holds every key after the query (r > 0), which a causal mask hides anyway")
    print(f"\n{'bucket':>6}  {'r from':>7}  {'r to':>7}  {'|r| from':>8}  {'|r| to':>7}  {'count':>6}  kind")
    for bucket, lo, hi, kind in rows:
        if kind == "unused":
            print(f"{bucket:>6}  {'-':>7}  {'-':>7}  {'-':>8}  {'-':>7}  {0:>6}  unused")
            continue
        lo_s, hi_s = _fmt(lo, True), _fmt(hi, False)
        if lo is not None and hi is not None:
            a, c = sorted((abs(lo), abs(hi)))
            if lo <= 0 <= hi:
                a = 0
            count = str(hi - lo + 1)
            mag = (str(a), str(c))
        else:
            finite = lo if lo is not None else (hi if hi is not None else 0)  # one side is bounded
            mag = (str(abs(finite)), "inf")
            count = "inf"
        print(f"{bucket:>6}  {lo_s:>7}  {hi_s:>7}  {mag[0]:>8}  {mag[1]:>7}  {count:>6}  {kind}")
    return 0
