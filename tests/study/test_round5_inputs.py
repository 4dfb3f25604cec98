"""Bad inputs of the study and extend command lines that raised raw exceptions (issue 48, items 14
and 20): each is now one UsageError naming the option."""

from __future__ import annotations

import pytest
import torch

from posenc.errors import UsageError
from posenc.study.extend_cli import check_run_options
from posenc.study.plan import parse_shard


@pytest.mark.parametrize("text", ["²/3", "1/³", "１/2", "/2", "1/", "0/2", "3/2", "a/b"])
def test_a_shard_that_is_not_two_ascii_integers_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="shard"):
        parse_shard(text)
    assert parse_shard("2/3") == (2, 3)


@pytest.mark.parametrize("device, threads, word", [("banana", None, "device"), ("cpu", 0, "threads"), ("cpu", -2, "threads")])
def test_extend_refuses_a_bad_device_or_thread_count(device: str, threads: int | None, word: str) -> None:
    with pytest.raises(UsageError, match=word):
        check_run_options(device, threads)
    check_run_options("cpu", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA accepts cuda")
def test_extend_refuses_cuda_without_a_gpu() -> None:
    with pytest.raises(UsageError, match="cuda"):
        check_run_options("cuda", None)


def test_extend_refuses_a_schedule_checkpoint_naming_its_schedule() -> None:
    """Not a message about encoding_options, which the user never gave (issue 48, item 17)."""
    import posenc
    from posenc.study import extend as ex

    lm = posenc.LM(posenc.LMConfig(schedule="2x[rope window=8] 2x[rope]", dim=16, depth=4, num_heads=2))
    with pytest.raises(UsageError, match="schedule") as caught:
        ex.scaled(lm, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16})
    assert "encoding_options" not in str(caught.value)
