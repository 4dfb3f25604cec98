"""DistributedDataParallel plumbing for ``torchrun --nproc_per_node=N -m posenc study``.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; without them everything here is a no-op for one
process. gloo on CPU, nccl on CUDA. Workers end with barrier, destroy_process_group, flush and
``os._exit``: without that sequence a gloo worker can abort at interpreter exit
("terminate called ..." from a background thread torn down too late).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Context:
    """Where this process sits: rank among world processes, and the device it computes on."""

    device: torch.device
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def launched() -> bool:
    """True inside a torchrun worker of a group of more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(device: str) -> Context:
    """Join the process group when launched by torchrun; otherwise a one-process context."""
    if not launched():
        return Context(torch.device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device(device)
        dist.init_process_group("gloo")
    return Context(dev, rank, world, local_rank)


def all_sum(ctx: Context, values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all processes (in place; identity for one process)."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def flags(ctx: Context, *values: bool) -> list[bool]:
    """Logical OR of each flag over all processes."""
    t = torch.tensor([float(v) for v in values], device=ctx.device)
    return [bool(x > 0) for x in all_sum(ctx, t).tolist()]


def peer_failed(err: BaseException) -> bool:
    """Whether ``err`` is this process noticing that another one of the group is gone (a collective
    that lost its peer), rather than a failure of its own."""
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
    )


def record_failure(ctx: Context, message: str, root: bool) -> None:
    """Give torchrun one sentence for this worker's failure (instead of "To enable traceback see ...").

    torchrun reads the file named by TORCHELASTIC_ERROR_FILE and names the failure with the
    earliest timestamp (whole seconds) as the root cause. A process stopping because a peer failed
    (``root=False``) dates its note one second later, so the process that failed first is named.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not ctx.distributed:
        return
    try:
        with open(path, "w") as f:
            stamp = str(int(time.time()) + (0 if root else 1))
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": stamp}}}, f)
    except OSError:
        pass  # the message was printed anyway


def finish(ctx: Context, code: int) -> int:
    """End a torchrun worker cleanly (never returns there); returns ``code`` for one process."""
    if not ctx.distributed:
        return code
    try:
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
