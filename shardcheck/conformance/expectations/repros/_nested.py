"""What the nested-checkpointing reproductions share (F46 on FSDP1, F52 on FSDP2): a transformer-shaped
layer whose `mix` and `mlp` become units of their own inside the layer's unit, checkpointed or not."""

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix, self.mlp = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.mix(self.norm(x))
        return h + self.mlp(h)


class Net(nn.Module):
    def __init__(self, checkpointed):
        super().__init__()
        self.embed, self.layer, self.head, self.checkpointed = nn.Linear(8, 8), Layer(), nn.Linear(8, 1), checkpointed

    def forward(self, x):
        h = self.embed(x)  # the layer's input carries a gradient, as in any model past its first layer
        return self.head(checkpoint(self.layer, h, use_reentrant=False) if self.checkpointed else self.layer(h))
