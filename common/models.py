"""Model builders (ResNet-18 with a CIFAR stem, the seed's Keras-style MNIST convnet, or any timm model), and what a
trained model is: its description (best/meta.json), best/ written and read back."""

import json
import math
import pickle
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .distributed import STARTED, prepare_to_evaluate
from .errors import UserError
from .outputs import find_damage, latest_checkpoint, sha256, write_atomically
from .reporting import write_predictions


def build_model(name, *, num_classes, in_chans=3, channels_last=False, image_size=None, identity_start=True):
    """`resnet18_cifar`, `mnist_convnet`, or any timm model name (e.g. `resnet50`). `channels_last`: NHWC weights,
    so the convolutions run NHWC, as the tensor cores want under bf16/fp16. `image_size`: see `check_image_size`.
    `identity_start=False`: a residual network's blocks start with their last BatchNorm at 1, not 0 (the weights'
    start only: nothing of it is needed to load them)."""
    STARTED.update(data=time.time())  # a training script builds its model once its data is ready (common.run)
    if name == "resnet18_cifar":
        model = build_resnet18_cifar(num_classes=num_classes, in_chans=in_chans, identity_start=identity_start)
    elif name == "mnist_convnet":
        if not identity_start:
            raise UserError(f"--no-identity_start: --model {name} has no residual blocks to start as the identity: "
                            "drop the flag")
        model = build_mnist_convnet(num_classes=num_classes, in_chans=in_chans)
    else:
        import timm  # imported here: the two models above do not need it

        check_model_name(name)
        start = {} if identity_start else {"zero_init_last": False}  # timm's ResNets start as the identity too
        try:
            model = timm.create_model(name, num_classes=num_classes, in_chans=in_chans, **start)
        except TypeError:
            if identity_start:
                raise
            raise UserError(f"--no-identity_start: --model {name} has no residual blocks to start as the identity "
                            "(timm's zero_init_last): drop the flag") from None
        if image_size:
            check_image_size(model, name, in_chans=in_chans, image_size=image_size)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def check_batch_norm(model, model_info, *, batch_size):
    """A batch of one image (`batch_size`: what a BatchNorm layer normalizes over in training) trains a BatchNorm
    layer that sees 1x1 maps (or flat features) on one value per channel, which PyTorch refuses at the first step
    with a traceback: found before, with one forward of the `build_model` model that `model_info` describes."""
    if batch_size != 1:
        return
    name, in_chans, size = model_info["architecture"], model_info["model_kwargs"]["in_chans"], model_info["image_size"]
    seen, training = [], model.training
    hooks = [module.register_forward_pre_hook(lambda module, inputs: seen.append((module, inputs[0].shape[2:])))
             for module in model.modules() if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, in_chans, *size))
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    single = [(module, shape) for module, shape in seen if shape.numel() == 1]
    if single:
        module, shape = single[0]
        where = "x".join(map(str, shape)) + " maps" if len(shape) else "flat features"
        layer = f"{type(module).__name__}({module.num_features})"
        raise UserError(f"--batch_size 1: the model ({name}) has a BatchNorm layer, {layer}, that sees {where} at "
                        f"{size[0]}x{size[1]} images, so a batch of one image gives it one value per channel, which it "
                        "cannot normalize in training: use --batch_size 2 or more")


def check_model_name(name, *, image_size=None):
    """A --model that `build_model` does not know, or (`image_size`) a timm model made for one input size only that
    is given another, is refused: called before any image is read, so that the mistake does not wait for the image
    check and the decode of a whole dataset (`check_image_size` tries the model itself, once it is built)."""
    if name in ("resnet18_cifar", "mnist_convnet"):
        return
    import timm
    from timm.models import get_pretrained_cfg

    if not timm.is_model(name.split(".")[0]):  # "resnet50" or a tagged "resnet50.a1_in1k"
        raise UserError(f"unknown model {name!r}: use resnet18_cifar, mnist_convnet or a timm name such as resnet50")
    config = get_pretrained_cfg(name, allow_unregistered=True)
    if image_size and config and config.fixed_input_size and tuple(config.input_size[1:]) != (image_size,) * 2:
        raise UserError(_fixed_size(name, config.input_size[1:], image_size))


def _fixed_size(name, size, image_size):
    return (f"--model {name} takes only {size[0]}x{size[1]} images and this run gives it {image_size}x{image_size}: "
            f"choose a model that takes any size (a CNN such as resnet50), or train at {size[0]} (train_seedlings.py: "
            f"--image_size {size[0]})")


def check_image_size(model, name, *, in_chans, image_size):
    """One forward of a blank image, so that a model made for another size (a ViT for 224 x 224) or too small an
    image stops here in one line, not in the first training step with timm's assertion."""
    training, size = model.training, tuple(model.pretrained_cfg.get("input_size", (in_chans, 224, 224))[1:])
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, in_chans, image_size, image_size))
    except (AssertionError, RuntimeError, ValueError) as error:
        if model.pretrained_cfg.get("fixed_input_size"):
            raise UserError(_fixed_size(name, size, image_size)) from None
        raise UserError(f"--model {name} cannot take {image_size}x{image_size} images ({str(error).splitlines()[0]}): "
                        f"choose another model, or train on larger images (it was made for {size[0]}; "
                        "train_seedlings.py: --image_size)") from None
    finally:
        model.train(training)


def build_ema(model, accelerator, *, decay):
    """timm's EMA of `model`'s weights (ModelEmaV3, with warmup), prepared so that `save_state` keeps it
    (model_1.safetensors). timm is imported here: CIFAR and MNIST runs need it only for this."""
    from timm.utils import ModelEmaV3

    ema = ModelEmaV3(accelerator.unwrap_model(model, keep_torch_compile=False), decay=decay, use_warmup=True)
    return prepare_to_evaluate(accelerator, ema)


# ---- what a trained model is: written into best/meta.json and every checkpoint, read by every tool ----

def describe_model(architecture, classes, *, image_size, normalize, dataset, arguments):
    """What best/meta.json and every checkpoint say of a model: its `build_model` arguments, classes, evaluation
    preprocessing (`normalize`: (mean, std) per channel), `dataset` (cifar10, mnist, fashion_mnist, digits or
    folder) and the run's `arguments`. Folder datasets resize the short side to `resize_size`, then crop the center."""
    (mean, std), image_size = normalize, list(image_size)
    return {"architecture": architecture, "model_kwargs": {"num_classes": len(classes), "in_chans": len(mean)},
            "class_names": list(classes), "image_size": image_size,
            "eval_transform": ({"resize": resize_size(image_size[0]), "center_crop": image_size}
                               if dataset == "folder" else {"resize": image_size}),
            "mean": list(mean), "std": list(std), "dataset": dataset, "args": arguments}


def resize_size(image_size):
    """The short side evaluation resizes to before its center crop of `image_size` (ImageNet's 256 for 224)."""
    return round(image_size / 0.875)


def save_best_model(accelerator, model, output_dir, *, meta, evaluation, later=False):
    """Replace best/ as a whole: model.safetensors, meta.json, val_predictions.csv (this evaluation) and, for a timm
    model, timm's config.json (`timm_config`). `later`: written while training goes on, from a copy of the weights
    (common.outputs.write_atomically)."""
    # get_state_dict keeps a torch.compile wrapper, whose names start with "_orig_mod."
    state_dict = {name.removeprefix("_orig_mod."): tensor for name, tensor in accelerator.get_state_dict(model).items()}
    if not accelerator.is_main_process:
        return
    config = timm_config(accelerator.unwrap_model(model, keep_torch_compile=False), meta)
    weights = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in state_dict.items()}

    def write(folder):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors")
        weights_file = folder / "model.safetensors"  # its size and checksum, checked by load_best_model
        files = {"files": {weights_file.name: [weights_file.stat().st_size, sha256(weights_file)]}}
        (folder / "meta.json").write_text(json.dumps(meta | files, indent=2))
        if config:
            (folder / "config.json").write_text(json.dumps(config, indent=2))
        write_predictions(folder / "val_predictions.csv", evaluation, class_names=meta["class_names"])

    write_atomically(Path(output_dir) / "best", write, later=later)


def timm_config(model, meta):
    """timm's config.json for a timm `model` described by `meta` (None for our own architectures), which makes best/
    a timm folder: `timm.create_model("local-dir:best", pretrained=True)` builds the model with these weights and
    its label names, and `timm.data.resolve_data_config` + `create_transform` preprocess as our evaluation does (PIL
    resizes where we resize with torchvision: docs/after-training.md)."""
    source = getattr(model, "pretrained_cfg", None)
    if source is None:
        return None
    size, spec, kwargs = meta["image_size"], meta["eval_transform"], meta["model_kwargs"]
    # timm resizes the short side to floor(size / crop_pct): a hair under size / resize keeps it at `resize` exactly
    crop = ({"crop_pct": size[0] / (spec["resize"] + 1e-4), "crop_mode": "center"} if "center_crop" in spec
            else {"crop_pct": 1.0, "crop_mode": "squash"})  # the in-memory sets: a resize to the size itself
    return {"architecture": source["architecture"], "num_classes": kwargs["num_classes"],
            "label_names": meta["class_names"], "model_args": dict(kwargs),
            "pretrained_cfg": {"input_size": [kwargs["in_chans"], *size], "interpolation": "bilinear", **crop,
                               "mean": meta["mean"], "std": meta["std"], "num_classes": kwargs["num_classes"],
                               **{key: source[key] for key in ("first_conv", "classifier", "fixed_input_size")
                                  if key in source}}}


def model_folder(model_dir):
    """The folder a --model_dir names: itself, the folder of a file in best/ or in a checkpoint (the
    model.safetensors a user points at), or the checkpoint that checkpoints/latest names (the file or its folder,
    as --resume latest takes it)."""
    model_dir = Path(model_dir)
    checkpoints = model_dir.parent if model_dir.name == "latest" else model_dir
    named = latest_checkpoint(checkpoints)
    if named and (named / "trainer_state.json").is_file():
        return named
    if named and not any((model_dir / name).exists() for name in ("meta.json", "trainer_state.json", "best")):
        saved = sorted(path.parent.name for path in checkpoints.glob("*/trainer_state.json"))
        raise UserError(f"--model_dir {model_dir}: {checkpoints / 'latest'} names {named.name}, which is not there "
                        "(removed since?): pass the run's best/ folder or one of its checkpoints"
                        + (f" (in {checkpoints}: {', '.join(saved[-3:])})" if saved else ""))
    if model_dir.is_file() and any((model_dir.parent / name).is_file() for name in ("meta.json", "trainer_state.json")):
        return model_dir.parent
    return model_dir


def load_best_model(model_dir):
    """(model in eval mode, meta) from a best/ folder, a run's folder or a checkpoint (its trainer_state.json), or
    a file in one of them; every way it can be wrong is a UserError."""
    model_dir = model_folder(model_dir)
    wanted = "pass the best/ folder a training run wrote (or the run's folder, or one of its checkpoints)"
    if not model_dir.is_dir():
        raise UserError(f"--model_dir {model_dir} {'is a file' if model_dir.exists() else 'not found'}: {wanted}")
    if not (model_dir / "meta.json").exists() and (model_dir / "best" / "meta.json").is_file():
        model_dir = model_dir / "best"
    meta_path, weights_path = model_dir / "meta.json", model_dir / "model.safetensors"
    if not meta_path.is_file() and (model_dir / "trainer_state.json").is_file():
        meta_path = model_dir / "trainer_state.json"
    if not meta_path.is_file():
        runs = sorted(str(meta.parent.parent) for meta in model_dir.glob("*/best/meta.json"))  # a folder of runs
        if runs:
            raise UserError(f"{model_dir} holds no model but the runs {', '.join(runs[:5])}: pass one of them")
        saved = sorted(model_dir.glob("checkpoints/epoch_*/trainer_state.json"))  # a run before its first best/
        raise UserError(f"{model_dir} has no best/ (a run writes it at the end of its first epoch) but has "
                        f"checkpoints: pass one, e.g. --model_dir {saved[-1].parent}" if saved
                        else f"{meta_path} not found: {wanted}")
    meta, problem = read_description(meta_path)
    if problem:
        raise UserError(f"{meta_path} is not a model description written by our training scripts ({problem}); "
                        "use the meta.json the run wrote beside model.safetensors")
    # in the memory format the run trained and scored in, so that its scores are the run's to the last digit
    model = build_model(meta["architecture"], **meta["model_kwargs"],
                        channels_last=isinstance(meta.get("args"), dict) and meta["args"].get("channels_last") is True)
    check_weights(model, weights_path, expected=f"{meta['architecture']} with {meta['model_kwargs']}")
    recorded = {name: record for name, record in meta.get("files", {}).items() if name == weights_path.name}
    if damage := find_damage(model_dir, recorded):  # a folder written before the record existed: not checked
        raise UserError(f"{damage}: it was not used (a copy cut short, a disk's error?). Use another checkpoint or "
                        "best/ folder, or copy it again")
    model.load_state_dict(load_file(weights_path))
    return model.eval(), meta


def read_json(path, *, check):
    """(the JSON in `path`, what is wrong with it): `check(data)`'s answer, None when nothing is."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as error:  # UnicodeDecodeError included
        return None, f"not JSON ({error})"
    return data, check(data)


def read_description(path):
    """(the model description in `path`, what is wrong with it or None): a best/meta.json, a trainer_state.json or
    export.py's description, older ones included."""
    meta, problem = read_json(path, check=lambda data: None if isinstance(data, dict) else "not a JSON object")
    if problem:
        return meta, problem
    if "eval_transform" not in meta and isinstance(meta.get("image_size"), list):  # older: folder runs had resize_size
        size = meta["image_size"]
        meta["eval_transform"] = ({"resize": meta["resize_size"], "center_crop": size} if "resize_size" in meta
                                  else {"resize": size})
    return meta, _check_description(meta)


def _check_description(meta):
    kwargs, classes = meta.get("model_kwargs"), meta.get("class_names")
    if not isinstance(meta.get("architecture"), str):
        return f"'architecture' is {meta.get('architecture')!r}"
    if not (isinstance(kwargs, dict) and {"num_classes", "in_chans"} <= kwargs.keys()
            and all(isinstance(kwargs[k], int) and kwargs[k] > 0 for k in ("num_classes", "in_chans"))):
        return f"'model_kwargs' is {kwargs!r}, not num_classes and in_chans"
    if not (isinstance(classes, list) and len(classes) == kwargs["num_classes"]):
        return f"'class_names' is not a list of {kwargs['num_classes']} names"
    size = meta.get("image_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        return f"'image_size' is {size!r}, not [height, width]"
    spec = meta["eval_transform"]
    if not (isinstance(spec, dict) and isinstance(spec.get("resize"), (int, list))
            and isinstance(spec.get("center_crop", []), list)):
        return f"'eval_transform' is {spec!r}"
    for name in ("mean", "std"):
        values = meta.get(name)
        if not (isinstance(values, list) and len(values) == kwargs["in_chans"]
                and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
            return f"{name!r} is {values!r}, not {kwargs['in_chans']} numbers"
    if min(meta["std"]) <= 0:
        return f"'std' is {meta['std']}: every value must be above 0"
    return None


def check_weights(model, weights_path, *, expected):
    """Name both sides when a safetensors file does not fit the model, instead of PyTorch's list of keys."""
    if not Path(weights_path).is_file():
        raise UserError(f"{weights_path} is missing (deleted?): the folder is incomplete. Use another checkpoint or "
                        "best/ folder, or train again")
    try:
        with safe_open(weights_path, framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as error:
        raise UserError(f"{weights_path} is corrupt or not a safetensors file ({error}); use another checkpoint or "
                        "best/ folder, or train again") from None
    own = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    missing, unexpected = own.keys() - shapes.keys(), shapes.keys() - own.keys()
    mismatched = [(k, shapes[k], shape) for k, shape in own.items() if k in shapes and shapes[k] != shape]
    if missing or unexpected or mismatched:
        detail = (f"{len(missing)} tensors missing, {len(unexpected)} unexpected" if missing or unexpected else
                  "shapes differ, e.g. {} is {} in the file but {} in the model".format(*mismatched[0]))
        raise UserError(f"the weights in {weights_path} do not fit {expected}: {detail}. They come from another "
                        "architecture or class count; use the meta.json written beside them.")


def load_pretrained(model, name, source, state_dict=None):
    """Load ImageNet weights into a fresh timm `model` from `source` (`read_pretrained`; `state_dict`: what it read
    already); tensors whose shape differs (the classifier) are left out. Returns a line to print."""
    state_dict = read_pretrained(name, source) if state_dict is None else state_dict
    own = model.state_dict()
    fitting = {k: v for k, v in state_dict.items() if k in own and v.shape == own[k].shape}
    if not fitting:
        raise UserError(f"--pretrained {source}: none of its tensors fit {name}; are they weights for another model?")
    model.load_state_dict(fitting, strict=False)
    new = sorted(own.keys() & state_dict.keys() - fitting.keys())  # the classifier, for another class count
    absent = sorted(own.keys() - state_dict.keys())
    return (f"pretrained weights from {source}: {len(fitting)} of {len(own)} tensors loaded"
            + (f"; left out (new for this task): {', '.join(new)}" if new else "")
            + (f"; not in the file, so as initialised: {len(absent)} tensors, e.g. {', '.join(absent[:3])} (weights "
               f"of another model than {name}?)" if absent else ""))


def read_pretrained(name, source):
    """The state dict of `source`, a weights file (safetensors or a state dict) or `hub` (timm's download of
    `name`'s ImageNet weights): read before the images are, so that a wrong file stops the run at once."""
    if source == "hub":
        import timm

        from .hf import offline_unless_reachable

        unreachable = offline_unless_reachable()
        try:
            state_dict = timm.create_model(name, pretrained=True).state_dict()
        except Exception as error:  # offline, no such weights, hub errors: all mean "use a file"
            why = (f"the Hub is out of reach here ({unreachable}) and they are not in the local cache" if unreachable
                   else f"{type(error).__name__}: {error}")
            raise UserError(f"--pretrained hub: could not fetch ImageNet weights for {name} ({why}). Offline, "
                            "download them elsewhere and pass --pretrained FILE.") from None
    else:
        path = Path(source)
        if path.is_dir():
            inside = path / "model.safetensors"  # best/ or an exported folder
            raise UserError(f"--pretrained {source} is a folder: pass its weights file"
                            + (f", --pretrained {inside}" if inside.is_file() else " (.safetensors or a state dict)"))
        if not path.is_file():
            raise UserError(f"--pretrained {source}: no such file. Pass a weights file (.safetensors or a PyTorch "
                            "state dict), `hub` to download when online, or leave --pretrained out")
        not_weights = UserError(f"--pretrained {source}: not a weights file (neither safetensors nor what torch.save "
                                "writes of a state dict)")
        try:
            if path.suffix == ".safetensors":
                state_dict = load_file(path)
            else:
                state_dict = torch.load(path, map_location="cpu", weights_only=True)
                if isinstance(state_dict, dict):
                    state_dict = state_dict.get("state_dict", state_dict.get("model", state_dict))
        except pickle.UnpicklingError as error:  # weights_only refused a class (a whole pickled model), or no pickle
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
            if not found:  # a text file, a web page saved under the name
                raise not_weights from None
            raise UserError(f"--pretrained {source} holds pickled Python objects ({found.group(1)}), not only tensors: "
                            "it is not loaded, since unpickling can run any code. Save the weights alone, e.g. "
                            "torch.save(model.state_dict(), 'weights.pth'), and pass that file") from None
        except OSError as error:
            raise UserError(f"--pretrained {source}: cannot read it ({error.strerror or error})") from None
        except Exception:  # any other file (a zip, a text file under .safetensors): one message, not a traceback
            raise not_weights from None
        other = (next((f"{key!r} is a {type(value).__name__}" for key, value in state_dict.items()
                       if not isinstance(value, torch.Tensor)), None) if isinstance(state_dict, dict) and state_dict
                 else f"a {type(state_dict).__name__}")
        if other:
            raise UserError(f"--pretrained {source} is not a state dict (a dict of tensor names to tensors; {other}): "
                            "save the weights with torch.save(model.state_dict(), 'weights.pth')")
    return state_dict


def build_resnet18_cifar(*, num_classes=10, in_chans=3, identity_start=True):
    """torchvision's ResNet-18 with the usual CIFAR stem: 3x3 conv, stride 1, no max-pool (32x32 stays 32x32).
    Each block's last BatchNorm starts at zero, so every block starts as the identity (Goyal et al. 2017; timm's
    default): without it the loss blew up to 4-9 in the warm-up at the recipe's LR, and where a run landed after
    one epoch (31-51%) depended on the seed. `identity_start=False`: at 1, as the published fast recipe starts."""
    from torchvision.models import resnet18

    model = resnet18(num_classes=num_classes, zero_init_residual=identity_start)
    model.conv1 = nn.Conv2d(in_chans, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_mnist_convnet(*, num_classes=10, in_chans=1):
    """The Keras convnet of the seed post, layer for layer (its `Rescaling(1/255)` is normalizing with mean 0, std 1).
    Keras "same" padding for the last conv is 2 on each side for the even sizes it sees (12x12, 2x2)."""
    return nn.Sequential(
        nn.Conv2d(in_chans, 12, kernel_size=3, padding="same", bias=False), nn.BatchNorm2d(12), nn.ReLU(),
        nn.Conv2d(12, 24, kernel_size=6, stride=2, bias=False), nn.BatchNorm2d(24), nn.ReLU(),
        nn.Conv2d(24, 32, kernel_size=6, stride=2, padding=2), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(256, num_classes),
    )
