"""Model builders: ResNet-18 with a CIFAR stem, the seed's Keras-style MNIST convnet, or any timm model."""

import pickle
import re
from pathlib import Path

import torch
from torch import nn

from .errors import UserError


def build_model(name, *, num_classes, in_chans=3, channels_last=False, image_size=None):
    """`resnet18_cifar`, `mnist_convnet`, or any timm model name (e.g. `resnet50`).

    `channels_last` stores the weights as NHWC; the convolutions then run (and return) NHWC whatever the
    input's layout, which is what the tensor cores want under bf16/fp16. `image_size` (a training run's): a
    timm model is checked to take images of that size (`check_image_size`).
    """
    if name == "resnet18_cifar":
        model = build_resnet18_cifar(num_classes=num_classes, in_chans=in_chans)
    elif name == "mnist_convnet":
        model = build_mnist_convnet(num_classes=num_classes, in_chans=in_chans)
    else:
        import timm  # imported here: the two models above do not need it

        if not timm.is_model(name.split(".")[0]):  # "resnet50" or a tagged "resnet50.a1_in1k"
            raise UserError(f"unknown model {name!r}: use resnet18_cifar, mnist_convnet or a timm name such as resnet50")
        model = timm.create_model(name, num_classes=num_classes, in_chans=in_chans)
        if image_size:
            check_image_size(model, name, in_chans=in_chans, image_size=image_size)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def check_image_size(model, name, *, in_chans, image_size):
    """One forward of a blank image of `image_size` (evaluation mode, no gradients: nothing changes), so that a model
    made for another size (a ViT or a Swin for 224 x 224) or too small an image stops here in one line, not in
    the first training step with timm's assertion."""
    training, size = model.training, tuple(model.pretrained_cfg.get("input_size", (in_chans, 224, 224))[1:])
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, in_chans, image_size, image_size))
    except (AssertionError, RuntimeError, ValueError) as error:
        if model.pretrained_cfg.get("fixed_input_size"):
            raise UserError(f"--model {name} takes only {size[0]}x{size[1]} images and this run gives it {image_size}x"
                            f"{image_size}: choose a model that takes any size (a CNN such as resnet50), or train at "
                            f"{size[0]} (train_seedlings.py: --image_size {size[0]})") from None
        raise UserError(f"--model {name} cannot take {image_size}x{image_size} images ({str(error).splitlines()[0]}): "
                        f"choose another model, or train on larger images (it was made for {size[0]}; "
                        "train_seedlings.py: --image_size)") from None
    finally:
        model.train(training)


def build_ema(model, accelerator, *, decay):
    """timm's exponential moving average of `model`'s weights (ModelEmaV3, with its warmup), prepared in
    evaluation mode so that `save_state` keeps it (model_1.safetensors) and `evaluate` can score it. timm is
    imported here: the CIFAR and MNIST runs need it only for this, and it takes a second to import."""
    from timm.utils import ModelEmaV3

    ema = ModelEmaV3(accelerator.unwrap_model(model, keep_torch_compile=False), decay=decay, use_warmup=True)
    return accelerator.prepare_model(ema, evaluation_mode=True)


def describe_model(architecture, *, class_names, image_size, mean, std, resize_size=None, dataset=None):
    """What every checkpoint and best/meta.json says of a model: how to build it (`build_model` arguments),
    its classes, and its evaluation preprocessing, so that predict.py and evaluation redo it exactly.

    `eval_transform` is {"resize": [H, W]} (resize to the model's image size: the in-memory datasets, decoded
    at that size) or, with `resize_size`, {"resize": S, "center_crop": [H, W]} (shorter side to S, then the
    center: the folder datasets); common.folders.build_eval_transform builds it. One channel per mean value.
    `dataset` (cifar10, mnist, fashion_mnist, digits or folder) is the layout scripts/evaluate.py reads by default.
    """
    image_size = list(image_size)
    return {"architecture": architecture, "model_kwargs": {"num_classes": len(class_names), "in_chans": len(mean)},
            "class_names": list(class_names), "image_size": image_size,
            "eval_transform": {"resize": resize_size, "center_crop": image_size} if resize_size else {"resize": image_size},
            "mean": list(mean), "std": list(std), "dataset": dataset}


def load_pretrained(model, name, source):
    """Load ImageNet weights into a freshly built timm `model`; returns a line saying what was loaded.

    `source` is a weights file (safetensors, or a PyTorch state dict read with weights_only=True) or
    `hub` (timm's own download: needs the network). Tensors whose shape differs, the classifier of
    another class count, are left out and named.
    """
    if source == "hub":
        import timm

        try:
            state_dict = timm.create_model(name, pretrained=True).state_dict()
        except Exception as error:  # offline, no such weights, hub errors: all mean "use a file"
            raise UserError(f"--pretrained hub: could not fetch ImageNet weights for {name} ({type(error).__name__}: "
                            f"{error}). Offline, download them elsewhere and pass --pretrained FILE.") from None
    else:
        path = Path(source)
        if not path.is_file():
            raise UserError(f"--pretrained {source}: no such file. Pass a weights file (.safetensors or a PyTorch "
                            "state dict), `hub` to download when online, or leave --pretrained out")
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                state_dict = load_file(path)
            else:
                state_dict = torch.load(path, map_location="cpu", weights_only=True)
                state_dict = state_dict.get("state_dict", state_dict.get("model", state_dict))
        except pickle.UnpicklingError as error:  # weights_only refused a class: a whole pickled model, say
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
            raise UserError(f"--pretrained {source} holds pickled Python objects"
                            + (f" ({found.group(1)})" if found else "") + ", not only tensors: it is not loaded, since "
                            "unpickling can run any code. Save the weights alone, e.g. torch.save(model.state_dict(), "
                            "'weights.pth'), and pass that file") from None
        except Exception as error:  # any unreadable file: one message, not a traceback
            raise UserError(f"--pretrained {source}: not a readable weights file ({error})") from None
    own = model.state_dict()
    fitting = {k: v for k, v in state_dict.items() if k in own and v.shape == own[k].shape}
    if not fitting:
        raise UserError(f"--pretrained {source}: none of its tensors fit {name}; are they weights for another model?")
    model.load_state_dict(fitting, strict=False)
    left_out = sorted(own.keys() - fitting.keys())
    return (f"pretrained weights from {source}: {len(fitting)} of {len(own)} tensors loaded"
            + (f"; left out (new for this task): {', '.join(left_out)}" if left_out else ""))


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
