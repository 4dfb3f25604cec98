"""The geometry and merges the blocked and terms backends share (backends/parts/regions.py)."""

from __future__ import annotations

import pytest
import torch

from posenc.backends.parts import denormals, regions
from posenc.backends.parts.regions import Merge, Region, lower, upper


def coverage(regions_: list[Region], tq: int, tk: int) -> torch.Tensor:
    """How often each (query, key) pair is covered, checking each call on the way."""
    count = torch.zeros(tq, tk, dtype=torch.long)
    for r in regions_:
        (q0, q1), (k0, k1) = r.rows, r.keys
        assert q0 < q1 and k0 < k1  # no empty call
        a = torch.arange(q1 - q0)[:, None]
        b = torch.arange(k1 - k0)[None, :]
        seen = (b <= a) if r.causal else torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)  # in call order
        assert seen.any(dim=1).all()  # every query of a call sees a key: finite log-sum-exp
        if r.flip:
            seen = seen.flip(0).flip(1)
        count[q0:q1, k0:k1] += seen.long()
    return count


@pytest.mark.parametrize("tq, tk", [(1, 1), (1, 7), (5, 5), (5, 9), (8, 3), (9, 17)])
@pytest.mark.parametrize("block", [None, 1, 2, 4])
def test_lower_regions_cover_exactly(tq, tk, block):
    """The kernel calls cover {(a, b): b <= a + offset} once each, for every offset and block."""
    for offset in range(-tq - 2, tk + 3):
        want = (torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset).long()
        assert torch.equal(coverage(lower(tq, tk, offset, block), tq, tk), want), offset


@pytest.mark.parametrize("tq, tk", [(1, 1), (5, 5), (5, 9), (8, 3), (9, 17)])
@pytest.mark.parametrize("block", [None, 2, 3])
def test_upper_regions_cover_exactly(tq, tk, block):
    for offset in range(-tq - 2, tk + 3):
        want = (torch.arange(tk)[None, :] >= torch.arange(tq)[:, None] + offset).long()
        assert torch.equal(coverage(upper(tq, tk, offset, block), tq, tk), want), offset


@pytest.mark.parametrize("block, window", [(None, 3), (2, 0), (4, 5), (3, 1)])
def test_windowed_regions_keep_every_near_key_once(block, window):
    """With a window, each pair is covered at most once, and every key at most ``window`` before
    the query's boundary (b >= a + offset - window) is covered."""
    tq, tk = 12, 12
    for offset in range(-3, 4):
        got = coverage(lower(tq, tk, offset, block, window), tq, tk)
        allowed = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset
        near = allowed & (torch.arange(tk)[None, :] >= torch.arange(tq)[:, None] + offset - window)
        assert got.max() <= 1 and torch.equal(got.bool() & ~allowed, torch.zeros_like(allowed))
        assert torch.equal(got.bool() | ~near, torch.ones_like(near)), offset
        if block is not None and block + window < tq - 1 and offset >= 0:
            assert got.sum() < allowed.sum()  # and some far key is left out


def test_merge_equals_one_softmax():
    """Parts of a softmax row merged through their log-sum-exps equal the whole, in any order,
    on some heads at a time."""
    torch.manual_seed(0)
    s = torch.randn(2, 4, 6, 10, dtype=torch.float64)  # (B, H, Tq, Tk) scores
    v = torch.randn(2, 4, 10, 3, dtype=torch.float64)
    want = torch.softmax(s, -1) @ v
    merged = Merge(2, 4, 6, 3, torch.float64, s.device)
    for (r0, r1), (k0, k1), heads in [((0, 6), (0, 4), slice(0, 2)), ((0, 6), (0, 4), slice(2, 4)),
                                      ((2, 6), (4, 10), slice(None)), ((0, 2), (4, 10), slice(None))]:
        part = s[:, heads, r0:r1, k0:k1]
        merged.add((r0, r1), torch.softmax(part, -1) @ v[:, heads, k0:k1], torch.logsumexp(part, -1), heads)
    torch.testing.assert_close(merged.out, want)
    torch.testing.assert_close(merged.lse, torch.logsumexp(s, -1))


def test_kernel_and_formula_paths_agree(monkeypatch):
    """The formula path (other devices, or a torch without the CPU flash ops) gives the kernel's
    outputs, log-sum-exps and gradients."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8) for n in (5, 9, 9))
    mask = torch.randn(1, 2, 1, 9)
    want = regions.kernel_forward(q, k, v, True, 0.3, mask)
    do = torch.randn_like(want[0])
    want_grads = regions.kernel_backward(do, q, k, v, *want, True, 0.3, mask)
    monkeypatch.setattr(regions, "FLASH_OPS", False)
    assert not regions.use_kernel(q, v)
    got = regions.kernel_forward(q, k, v, True, 0.3, mask)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(regions.kernel_backward(do, q, k, v, *want, True, 0.3, mask), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _flushes() -> bool:
    """Whether this thread flushes denormals (a denormal times one reads as zero)."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


def test_flushed_runs_in_a_thread_that_flushes_and_leaves_the_caller_alone(monkeypatch):
    monkeypatch.setattr(denormals.FLUSHED, "needed", True)  # as on a CPU that pays for denormals
    before = _flushes()
    inside = denormals.flushed(_flushes)
    assert _flushes() == before  # the caller's mode is untouched
    assert inside == denormals.FLUSHED.available
    assert denormals.flushed(lambda: torch.is_grad_enabled()) is False  # no graph inside the loops
    with torch.inference_mode():
        assert denormals.flushed(torch.is_inference_mode_enabled)
    # Nested use runs inline (no deadlock on the one worker).
    assert denormals.flushed(lambda: denormals.flushed(lambda: 7)) == 7


def test_watched_work_stays_in_the_callers_thread(monkeypatch):
    """Profilers and dispatch modes are thread-local: under one, the loops run where they see them."""
    import threading

    monkeypatch.setattr(denormals.FLUSHED, "needed", True)

    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    here = threading.current_thread()
    with Seen():
        assert denormals.flushed(threading.current_thread) is here
    assert denormals.flushed(threading.current_thread) is not here or not denormals.FLUSHED.available


def test_a_thread_without_the_penalty_keeps_the_loops(monkeypatch):
    """Where the caller's thread multiplies denormals at full speed the worker buys nothing: the
    loops run in the caller's thread, without grad, in its denormal mode."""
    import threading

    monkeypatch.setattr(denormals.FLUSHED, "needed", False)
    here = threading.current_thread()
    assert denormals.flushed(threading.current_thread) is here
    assert denormals.flushed(lambda: torch.is_grad_enabled()) is False
    assert denormals.flushed(_flushes) == _flushes()


def test_denormal_penalty_is_gone_where_the_thread_flushes():
    """The probe times denormal products against normal ones: with denormals flushed (and read as
    zero) in the probing thread there is nothing to pay, whatever the CPU."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert _flushes()
        assert denormals.denormal_penalty() < denormals.PENALTY
    finally:
        torch.set_flush_denormal(False)
    assert denormals.denormal_penalty(n=1024, repeats=2) > 0


def test_flushed_when_false_runs_here_without_grad():
    """when=False (a loop with no term that falls with distance): the caller's thread, no graph,
    and the caller's denormal mode."""
    import threading

    here = threading.current_thread()
    assert denormals.flushed(threading.current_thread, when=False) is here
    assert denormals.flushed(lambda: torch.is_grad_enabled(), when=False) is False
    assert denormals.flushed(_flushes, when=False) == _flushes()


@pytest.mark.parametrize("method, window, flush", [("rope", 16, False), ("nope", 16, False), ("alibi", 16, True),
                                                   ("t5", None, False), ("alibi", None, True), ("deberta", None, False)])
def test_kernel_loops_flush_only_where_a_term_falls_with_distance(method, window, flush, monkeypatch):
    """The backends ask for the flushing worker for ALiBi (its loops and its windows) and run the
    loops of a window without a bias, T5's constant tail and DeBERTa in the caller's thread."""
    import posenc

    asked = []
    real = denormals.flushed

    def spy(fn, *args, when=True):
        asked.append(when)
        return real(fn, *args, when=when)

    for module in ("posenc.backends.blocked", "posenc.backends.parts.sliding", "posenc.backends.parts.disentangled",
                   "posenc.backends.parts.disentangled_band"):
        monkeypatch.setattr(f"{module}.flushed", spy)
    options = {"position_buckets": 8, "max_relative_positions": 16} if method == "deberta" else {}  # a short band
    enc = posenc.build(method, num_heads=2, head_dim=8, **options)
    n = 400 if method == "deberta" else 96  # DeBERTa's cost model sends shorter calls to eager
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    posenc.attend(q, k, v, enc, window=window).sum().backward()
    assert asked and set(asked) == {flush}, asked
