"""ResNets (the FusionLLM paper's vision models), in plain PyTorch.

torchvision's wheels for this torch do not load here (their compiled operators are built
for another torch), so the two residual block kinds are written out: ``resnet`` with
``depth`` 18 or 34 (basic blocks) or 50, 101, 152 (bottlenecks), the torchvision layout
and parameter names, for images of any size of at least 32 pixels.
"""

from __future__ import annotations

import torch
from torch import nn

from fusionp2p.opdag.schema import ModelFamily, int_field

__all__ = ["RESNET_FAMILY", "ResNet"]

_LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3))}
_LAYOUTS |= {101: ("bottleneck", (3, 4, 23, 3)), 152: ("bottleneck", (3, 8, 36, 3))}


def _conv(cin: int, cout: int, k: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False)


class _Block(nn.Module):
    def __init__(self, kind: str, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.expansion = 1 if kind == "basic" else 4
        cout = width * self.expansion
        if kind == "basic":
            self.conv1, self.bn1 = _conv(cin, width, 3, stride), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = _conv(width, width, 3), nn.BatchNorm2d(width)
            self.conv3: nn.Module | None = None
        else:
            self.conv1, self.bn1 = _conv(cin, width, 1), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = _conv(width, width, 3, stride), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = _conv(width, cout, 1), nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.conv3 is not None:
            out = self.bn3(self.conv3(torch.relu(out)))
        shortcut = x if self.downsample is None else self.downsample(x)
        return torch.relu(out + shortcut)


class ResNet(nn.Module):
    """A ResNet of ``depth`` 18/34/50/101/152 for ``num_classes`` classes; ``width`` scales
    every layer's channels (64 is torchvision's)."""

    def __init__(self, depth: int = 18, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        if depth not in _LAYOUTS:
            raise ValueError(f"depth must be one of {sorted(_LAYOUTS)}, got {depth}")
        kind, counts = _LAYOUTS[depth]
        self.conv1, self.bn1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin = width
        for i, count in enumerate(counts):
            blocks = []
            for j in range(count):
                block = _Block(kind, cin, width * 2**i, 2 if (j == 0 and i > 0) else 1)
                cin = width * 2**i * block.expansion
                blocks.append(block)
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(images))))
        for name in ("layer1", "layer2", "layer3", "layer4"):
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _check_depth(config: dict[str, object]) -> str | None:
    depth = config.get("depth", 18)
    return None if depth in _LAYOUTS else f"depth must be one of {sorted(_LAYOUTS)}, got {depth}"


RESNET_FAMILY = ModelFamily(
    "resnet",
    ResNet,
    {"depth": int_field(18, 152), "num_classes": int_field(1, 1 << 20), "width": int_field(1, 1024)},
    rules=(_check_depth,),
    doc="a ResNet (18/34/50/101/152) for 3-channel images, torchvision's layout",
)
