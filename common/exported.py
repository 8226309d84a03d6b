"""A model exported by scripts/export.py: FILE.onnx, run with onnxruntime, and FILE.json, which holds what
best/meta.json holds, so predict.py treats an exported model like best/."""

from pathlib import Path

import torch

from .errors import UserError
from .models import load_best_model, read_description

INPUT, OUTPUT = "images", "logits"


def description_path(onnx_path):
    return Path(onnx_path).with_suffix(".json")


class OnnxModel(torch.nn.Module):
    """onnxruntime on the CPU behind a module's call: float (N, C, H, W) normalised images in, logits out."""

    def __init__(self, path):
        super().__init__()
        try:
            import onnxruntime  # imported here: training does not need it
        except ImportError:
            raise UserError(f"{path} is an ONNX model, which needs onnxruntime to run, and it is not installed: "
                            "pip install -r requirements-export.txt, or pass the best/ folder it was "
                            "exported from") from None
        try:
            self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as error:  # onnxruntime raises its own exception types for a bad file
            raise UserError(f"{path} is not an ONNX model onnxruntime can load ({error}); export it again with "
                            "scripts/export.py") from None

    def forward(self, images):
        logits = self.session.run([OUTPUT], {INPUT: images.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(logits).to(images.device)


def load_exported(path):
    """(OnnxModel, description) for FILE.onnx and the FILE.json beside it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} not found: pass an .onnx file written by scripts/export.py")
    described = description_path(path)
    if not described.is_file():
        raise UserError(f"{described} is missing: scripts/export.py writes it beside {path.name}; copy it along "
                        "with the model, or export again")
    meta, problem = read_description(described)
    if problem:
        raise UserError(f"{described} is not a description written by scripts/export.py ({problem}); export again")
    return OnnxModel(path), meta


def is_exported(model_dir):
    """Whether a tool's --model_dir names an .onnx file from scripts/export.py (which takes the suffix in any case);
    a folder so named is a best/ or run folder."""
    path = Path(model_dir)
    return path.suffix.lower() == ".onnx" and not path.is_dir()


def load_model(model_dir):
    """(model, meta, exported) for a tool's --model_dir: an .onnx file from scripts/export.py (`load_exported`), else
    best/, a run's folder or a checkpoint (common.models.load_best_model)."""
    if is_exported(model_dir):
        return *load_exported(model_dir), True
    return *load_best_model(model_dir), False
