"""Model builders: ResNet-18 with a CIFAR stem, the seed's Keras-style MNIST convnet, or any timm model."""

from torch import nn


def build_model(name, *, num_classes, in_chans=3, pretrained=False):
    """`resnet18_cifar`, `mnist_convnet`, or any timm model name (e.g. `resnet50`)."""
    if name == "resnet18_cifar":
        return build_resnet18_cifar(num_classes=num_classes, in_chans=in_chans)
    if name == "mnist_convnet":
        return build_mnist_convnet(num_classes=num_classes, in_chans=in_chans)
    import timm  # imported here: the two models above do not need it

    return timm.create_model(name, num_classes=num_classes, in_chans=in_chans, pretrained=pretrained)


def build_resnet18_cifar(*, num_classes=10, in_chans=3):
    """torchvision's ResNet-18 with the usual CIFAR stem: 3x3 conv, stride 1, no max-pool (32x32 stays 32x32)."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_chans, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_mnist_convnet(*, num_classes=10, in_chans=1):
    """The Keras convnet of the seed post, layer for layer.

    Its `Rescaling(1/255)` is `common.data.preprocess` with mean 0 and std 1. Keras "same" padding for
    the last conv (6x6, stride 2) is 2 on each side for the even sizes it sees (12x12 from 28x28
    MNIST, 2x2 from 8x8 digits).
    """
    return nn.Sequential(
        nn.Conv2d(in_chans, 12, kernel_size=3, padding="same", bias=False),
        nn.BatchNorm2d(12),
        nn.ReLU(),
        nn.Conv2d(12, 24, kernel_size=6, stride=2, bias=False),
        nn.BatchNorm2d(24),
        nn.ReLU(),
        nn.Conv2d(24, 32, kernel_size=6, stride=2, padding=2),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 256),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(256, num_classes),
    )
