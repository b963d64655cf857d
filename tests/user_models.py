"""Models a user writes in a script: importable on every peer as ``user_models:SkipNet``
(a factory; its schema comes from its signature) or ``user_models:TINY_MLP`` (a family)."""

import torch

from fusionp2p.opdag.families import ConfigField, ModelFamily


class SkipNet(torch.nn.Module):
    """Two residual MLP blocks on flat features, and a long skip from the input to the head."""

    def __init__(self, features: int = 12, hidden: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(features, hidden)
        self.block1 = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.block2 = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x)
        h1 = h0 + self.block1(h0)
        h2 = h1 + self.block2(h1)
        return self.head(h2 + h0)


def _tiny_mlp(width: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))


# An operator who wants bounds of their own exports a ModelFamily instead of a bare factory.
TINY_MLP = ModelFamily("tiny-mlp", _tiny_mlp, {"width": ConfigField(int, 1, 64)})
