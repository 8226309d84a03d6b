"""Export a trained model to ONNX for deployment, checked against PyTorch on real images.

    python scripts/export.py --model_dir outputs/seedlings/best --output seedlings.onnx \\
        --check_images data/plant-seedlings/Maize

Writes FILE.onnx, exported by torch.onnx.export (dynamo): input "images", float32 (N, C, H, W) normalised
images, any N; output "logits", (N, classes). Beside it FILE.json: the class names, image size, mean/std,
the preprocessing (`eval_transform` and in words) and the model it came from, so that a deployment needs
onnxruntime and an image library, not this repository, timm or PyTorch. The export is run with
onnxruntime on --check_images, preprocessed as evaluation does, and kept only if every logit is within
--tolerance of PyTorch's (|onnx - torch| <= tolerance x (1 + |torch|)) and every top-1 class agrees.
`python scripts/predict.py --model_dir FILE.onnx ...` predicts with it.
"""

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
try:  # a copy of this script needs the folder of what the scripts share (docs/recipes.md)
    import common.errors  # noqa: E402
except ModuleNotFoundError as missing:
    sys.exit(f"error: {Path(__file__).name} needs the common/ folder it came with, beside it or one folder up "
             f"({missing}): copy common/ into your repository too")
common.errors.on_another_version_of_common(__file__)
# torch only now: a copy without common/ is told so at once, not after seconds of imports
import torch  # noqa: E402
from common.data import preprocess  # noqa: E402
from common.errors import UserError, refuse_several_processes, run_main  # noqa: E402
from common.exported import INPUT, OUTPUT, OnnxModel, description_path  # noqa: E402
from common.flags import ArgumentParser, number, path  # noqa: E402
from common.folders import build_file_dataloader  # noqa: E402
from common.images import build_eval_transform  # noqa: E402
from common.models import load_best_model  # noqa: E402
from common.outputs import write_atomically  # noqa: E402
from common.tools import ImageFiles, check_output_file, find_images  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_dir", type=path, required=True, help="best/, a run's output folder, or a checkpoint")
    parser.add_argument("--output", type=path, required=True, help="the .onnx file to write (its .json goes beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--check_images", type=path, nargs="+", required=True, metavar="PATH",
                        help="image files and/or folders to compare the export with PyTorch on")
    parser.add_argument("--tolerance", type=number(float, min=0, min_open=True), default=1e-4,
                        help="largest logit difference, relative to 1 + |logit| (default: %(default)s)")
    return parser.parse_args(argv)


def require_export_packages():
    """torch.onnx's exporter needs onnx and onnxscript, the check onnxruntime: say so before a long export."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"exporting needs {', '.join(missing)}, not installed: pip install -r requirements-export.txt")


def is_description(path):
    try:
        return json.loads(Path(path).read_text()).get("format") == "onnx"
    except (OSError, ValueError, AttributeError):
        return False


def describe_preprocessing(meta):
    """The evaluation preprocessing in words, for a deployment that does not read eval_transform."""
    spec, channels = meta["eval_transform"], "RGB" if meta["model_kwargs"]["in_chans"] == 3 else "grayscale"
    if "center_crop" in spec:
        size = f"resize the shorter side to {spec['resize']} (bilinear, antialiased), crop the center {spec['center_crop']}"
    else:
        size = f"resize to {spec['resize']} (height, width; PIL bilinear)"
    return (f"decode as {channels} uint8; {size}; scale to [0, 1]; subtract mean, divide by std (per channel); "
            f"float32 (N, C, H, W) as input '{INPUT}'; softmax of '{OUTPUT}' gives the class probabilities")


@torch.inference_mode()
def compare(model, exported, images, meta):
    """(largest relative difference, top-1 disagreements, images) of the two models on the readable `images`."""
    dataloader = build_file_dataloader(images, batch_size=64, shuffle=False, num_workers=0)
    worst, disagree, count = 0.0, 0, 0
    for batch in dataloader:
        inputs = preprocess(batch["image"][batch["ok"]], normalize=(meta["mean"], meta["std"]))
        if not len(inputs):
            continue
        theirs, ours = model(inputs).float(), exported(inputs)
        worst = max(worst, ((ours - theirs).abs() / (1 + theirs.abs())).max().item())
        disagree += (ours.argmax(1) != theirs.argmax(1)).sum().item()
        count += len(inputs)
    return worst, disagree, count


def main(args):
    refuse_several_processes("export.py")
    paths = find_images(args.check_images)
    check_output_file(args.output, suffix=".onnx", what="an ONNX model", is_ours=None, inputs=paths,
                      overwrite=args.overwrite)  # an ONNX file may be deployed: replaced only with --overwrite
    check_output_file(description_path(args.output), suffix=".json", what="a description written by export.py",
                      is_ours=is_description, inputs=paths, overwrite=args.overwrite)
    require_export_packages()
    model, meta = load_best_model(args.model_dir)
    channels, (height, width) = meta["model_kwargs"]["in_chans"], meta["image_size"]

    example = torch.zeros(2, channels, height, width)
    program = torch.onnx.export(model, (example,), input_names=[INPUT], output_names=[OUTPUT], dynamo=True,
                                dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
    output = Path(args.output)
    # best/meta.json as it is (common.models.describe_model owns its fields) but its weights' checksum, and how to
    # feed the ONNX graph
    description = {key: value for key, value in meta.items() if key != "files"} | {
        "format": "onnx", "input": INPUT, "output": OUTPUT, "preprocessing": describe_preprocessing(meta)}
    images = ImageFiles(paths, transform=build_eval_transform(meta["eval_transform"]), channels=channels,
                        image_size=meta["image_size"])

    def save_checked(tmp):  # checked before it replaces anything: a failed export leaves an earlier one in place
        program.save(str(tmp))
        checked[:] = compare(model, OnnxModel(tmp), images, meta)
        worst, disagree, count = checked
        if not count:
            raise UserError(f"none of the {len(paths)} --check_images could be read as an image, so the export could "
                            "not be checked against the PyTorch model; nothing was written. Pass images that open, "
                            "e.g. a few of the validation images")
        if worst > args.tolerance or disagree:
            raise UserError(f"the export does not match the PyTorch model: on {count} images the largest logit "
                            f"difference is {worst:.2e} (tolerance {args.tolerance:g}) and {disagree} top-1 classes "
                            "differ; nothing was written. Check the model with predict.py, or raise --tolerance if "
                            "the difference is acceptable")

    checked = []
    write_atomically(output, save_checked)
    worst, disagree, count = checked
    write_atomically(description_path(output), lambda tmp: tmp.write_text(json.dumps(description, indent=2)))
    print(f"exported {meta['architecture']} to {output} ({output.stat().st_size / 1e6:.1f} MB) and "
          f"{description_path(output)}; checked on {count} images: largest logit difference {worst:.1e} "
          f"(tolerance {args.tolerance:g}), top-1 the same on all")


if __name__ == "__main__":
    run_main(main, parse_args())
