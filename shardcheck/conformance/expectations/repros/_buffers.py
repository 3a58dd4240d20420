"""What the buffer reproductions share (F48): how far apart the ranks' evaluations of one input are."""

import torch
import torch.distributed as dist


def evaluation_spread(model) -> float:
    """The largest difference between any rank's and rank 0's eval-mode output for an input of ones
    (zero when every rank holds the same buffers). Collective."""
    model.eval()
    with torch.no_grad():  # DDP broadcasts rank 0's buffers before this forward
        out = model(torch.ones(2, 4))
    outs = [torch.zeros_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, out)
    return max((o - outs[0]).abs().max().item() for o in outs)
