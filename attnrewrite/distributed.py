"""Running under torchrun (``torchrun --nproc-per-node 2 -m attnrewrite ... --finetune N``): one
process group for the run, gloo on CPU and nccl where torch sees a GPU. Every process runs the
same rewrite and calibration (seeded: the same values); fine-tuning shares each batch among them
(passes/finetune.py); only the first process proves, prints and writes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from attnrewrite.errors import AttnRewriteError


@contextlib.contextmanager
def process_group() -> Iterator[int]:
    """This process's rank (0 outside torchrun) for the block, its group set up and torn down."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield 0
        return
    from attnrewrite.passes.optional_torch import torch

    if torch is None:
        raise AttnRewriteError(
            "torchrun shares fine-tuning among processes in PyTorch: pip install 'attnrewrite[torch]'"
        )
    if torch.cuda.is_available():  # one GPU per process: "cuda" is then this process's own
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield torch.distributed.get_rank()
    finally:
        torch.distributed.destroy_process_group()
