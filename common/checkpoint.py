"""The best model as safetensors + meta.json: no pickled code, loadable without the training script."""

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .cli import UserError
from .models import build_model


def _write_atomically(path, write):
    """Write through a temporary file and rename it, so a kill never leaves a half-written `path`."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_best_model(accelerator, model, output_dir, *, meta):
    """Write best/model.safetensors then best/meta.json (architecture, model_kwargs, classes, preprocessing, ...)."""
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return
    best = Path(output_dir) / "best"
    best.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state_dict.items()}
    _write_atomically(best / "model.safetensors", lambda tmp: save_file(tensors, tmp))
    _write_atomically(best / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))


def load_best_model(model_dir):
    """(model in eval mode, meta) from a best/ folder; every way it can be wrong is a UserError."""
    model_dir = Path(model_dir)
    meta_path, weights_path = model_dir / "meta.json", model_dir / "model.safetensors"
    for path in (meta_path, weights_path):
        if not path.is_file():
            raise UserError(f"{path} not found: pass the best/ folder a training run wrote")
    try:
        meta = json.loads(meta_path.read_text())
        model = build_model(meta["architecture"], **meta["model_kwargs"])
    except (ValueError, KeyError, TypeError) as error:
        raise UserError(f"{meta_path} is not a model description written by our training scripts ({error})") from None
    try:
        state_dict = load_file(weights_path)
    except (SafetensorError, OSError) as error:
        raise UserError(f"{weights_path} is corrupt or not a safetensors file ({error})") from None
    check_state_dict(model, state_dict, expected=f"{meta['architecture']} with {meta['model_kwargs']}",
                     source=weights_path)
    model.load_state_dict(state_dict)
    return model.eval(), meta


def check_state_dict(model, state_dict, *, expected, source):
    """Name both sides when weights do not fit the model, instead of PyTorch's list of keys."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state_dict.keys(), state_dict.keys() - own.keys()
    mismatched = [(k, tuple(state_dict[k].shape), tuple(v.shape)) for k, v in own.items()
                  if k in state_dict and state_dict[k].shape != v.shape]
    if missing or unexpected or mismatched:
        detail = (f"{len(missing)} tensors missing, {len(unexpected)} unexpected" if missing or unexpected else
                  "shapes differ, e.g. {} is {} in the file but {} in the model".format(*mismatched[0]))
        raise UserError(f"the weights in {source} do not fit {expected}: {detail}. They come from another "
                        "architecture or class count; use the meta.json written beside them.")

