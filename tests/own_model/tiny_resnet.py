"""A torchvision-style ResNet-18 with tiny channel counts, written out (torchvision is not installed):
a 7x7 strided stem with BatchNorm and max pooling, four layers of two BasicBlocks each (3x3 convs
with BatchNorm, a strided first block with a 1x1 conv + BatchNorm downsample path), adaptive
average pooling and a linear head, trained on synthetic images."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import Workload

CHANNELS, SIZE, CLASSES = 3, 32, 10


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class TinyResNet18(nn.Module):
    def __init__(self, widths=(4, 8, 8, 16), classes=CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        layers, inplanes = [], widths[0]
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(inplanes, planes, stride), BasicBlock(planes, planes)))
            inplanes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def make_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(batch_size, CHANNELS, SIZE, SIZE, generator=g)
    return (x,), torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, target):
    return F.cross_entropy(output, target)


def build():
    torch.manual_seed(0)
    return Workload(model=TinyResNet18(), example_args=make_batch(0, 2)[0], loss_fn=loss, make_batch=make_batch,
                    name="tiny-resnet18")
