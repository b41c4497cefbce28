"""DDP communication hooks that run on gloo as well as nccl.

No ``from __future__ import annotations`` here on purpose: ``DistributedDataParallel.register_comm_hook`` compares
the hook's annotations with the real ``dist.GradBucket`` / ``Future[Tensor]`` objects and rejects strings.
"""

import torch
import torch.distributed as dist


def bf16_allreduce_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket in bfloat16 and write the mean back in the bucket's dtype.

    Same maths as torch's ``default_hooks.bf16_compress_hook``, which DDP refuses on gloo by the hook's *name*
    although gloo reduces bfloat16 fine; hence a different name.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
