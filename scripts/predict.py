"""Predict classes for images with a trained model (best/, a run's folder, or a checkpoint).

Same preprocessing as evaluation, as meta.json's "eval_transform" says: convert to the model's channels;
resize to its image size (bilinear), or for train_seedlings.py models resize the short side and center-crop;
normalise with the mean/std in meta.json. Needs no training script and no pickled code.
Images are decoded in DataLoader workers and predicted in batches (bf16 autocast where the device computes
it natively, unless --mixed_precision or the accelerate config says otherwise); under `accelerate launch`
the processes share the images, and one CSV is written in input order. Unreadable images are reported by
name and skipped; the rest are still predicted.

    python scripts/predict.py --model_dir outputs/cifar/best --output predictions.csv my_images/ extra.jpg
    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/predict.py --model_dir ... photos/
    python scripts/predict.py --model_dir outputs/cifar/best --output - photos/ | cut -d, -f1,2  # to a pipe
"""

import contextlib
import csv
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
from common.distributed import build_accelerator, prepare_to_evaluate  # noqa: E402
from common.errors import UserError, run_main  # noqa: E402
from common.evaluation import gather_samples, probabilities  # noqa: E402
from common.exported import load_model  # noqa: E402
from common.flags import ArgumentParser, add_tta_arg, device, nonnegative_int, path, positive_int  # noqa: E402
from common.folders import build_file_dataloader  # noqa: E402
from common.images import build_eval_transform  # noqa: E402
from common.outputs import write_atomically  # noqa: E402
from common.reporting import describe_tta  # noqa: E402
from common.tools import ImageFiles, check_output_file, find_images  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", type=path, nargs="+", help="image files and/or folders (searched recursively)")
    parser.add_argument("--model_dir", type=path, required=True,
                        help="best/, a run's output folder, a checkpoint, or an .onnx file from scripts/export.py")
    parser.add_argument("--output", type=path, default="predictions.csv",
                        help="CSV to write, - for standard output (every other line then goes to standard error); "
                             "an existing one is replaced only if predict.py wrote it (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output whatever it holds")
    parser.add_argument("--top_k", type=positive_int, default=3, help="classes per image (default: %(default)s)")
    add_tta_arg(parser)
    parser.add_argument("--batch_size", type=positive_int, default=64, help="per process (default: %(default)s)")
    parser.add_argument("--num_workers", type=nonnegative_int, default=None,
                        help="DataLoader workers per process that decode the images (default: from the cores per "
                             "process)")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="default: the accelerate config's; without one, bf16 where the device computes it")
    return parser.parse_args(argv)


def is_predictions_csv(path):
    """A CSV this script wrote (its header), which a new run may replace."""
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), [])[:3] == ["file", "class_1", "probability_1"]
    except (OSError, UnicodeDecodeError, csv.Error):
        return False


def main(args):
    """--output -: the CSV on standard output, for a pipe, and every other line of the run on standard error."""
    if str(args.output) != "-":
        return predict(args)
    csv_out = sys.stdout
    if csv_out is None:  # started with it closed (>&-): Python has no stream for it
        raise UserError("--output -: standard output is closed here; give a file name, e.g. --output predictions.csv")
    with contextlib.redirect_stdout(sys.stderr):
        return predict(args, csv_out=csv_out)


@torch.inference_mode()
def predict(args, *, csv_out=None):
    paths = find_images(args.inputs)
    if csv_out is None:
        check_output_file(args.output, suffix=".csv", what="a CSV written by predict.py", is_ours=is_predictions_csv,
                          inputs=paths, overwrite=args.overwrite)
    on_gpu = torch.device(args.device).type == "cuda"
    accelerator = build_accelerator(cpu=not on_gpu, mixed_precision=args.mixed_precision)
    model, meta, exported = load_model(args.model_dir)  # exported: scripts/export.py's file, run by onnxruntime
    classes, channels = meta["class_names"], meta["model_kwargs"]["in_chans"]
    images = ImageFiles(paths, transform=build_eval_transform(meta["eval_transform"]), channels=channels,
                             image_size=meta["image_size"])
    dataloader = build_file_dataloader(images, batch_size=args.batch_size, shuffle=False, num_workers=args.num_workers)
    model = model if exported else prepare_to_evaluate(accelerator, model)
    dataloader = accelerator.prepare(dataloader)
    top_k = min(args.top_k, len(classes))
    if args.top_k > top_k:
        accelerator.print(f"warning: --top_k {args.top_k} is more than the model's {top_k} classes: each row lists all "
                          f"{top_k}")
    found = []  # (index, ok, top-k probabilities, top-k classes) of every image, in input order
    for batch in dataloader:
        top = probabilities(model, preprocess(batch["image"], normalize=(meta["mean"], meta["std"])),
                            tta=args.tta).topk(top_k, dim=1)
        found.append([t.cpu() for t in (batch["index"], batch["ok"], *top)])
    index, ok, values, labels = gather_samples(accelerator, *map(torch.cat, zip(*found)))
    target = "standard output" if csv_out else args.output
    rows = [[str(paths[i])] + [item for p, c in zip(v, k) for item in (classes[c], f"{p:.6f}")]
            for i, good, v, k in zip(index.tolist(), ok.tolist(), values.tolist(), labels.tolist()) if good]
    if not rows:
        raise UserError(f"none of the {len(paths)} images could be read (see the lines above); {target} was "
                        "not written")

    def write(out):
        writer = csv.writer(out)
        writer.writerow(["file"] + [f"{kind}_{k}" for k in range(1, top_k + 1) for kind in ("class", "probability")])
        writer.writerows(rows)

    def write_file(tmp):
        with open(tmp, "w", newline="") as f:
            write(f)

    if accelerator.is_main_process and csv_out:
        write(csv_out)
        csv_out.flush()
    elif accelerator.is_main_process:
        write_atomically(args.output, write_file)
    skipped = len(paths) - len(rows)
    tta = describe_tta(args.tta)
    images = f"{len(rows)} image{'s' * (len(rows) != 1)}"
    accelerator.print(f"predicted {images}{f' ({tta})' if tta else ''} -> {target}"
                      + (f"; skipped {skipped} unreadable" if skipped else ""))
    accelerator.wait_for_everyone()  # and then all together: one that exits while another still works can abort
    accelerator.end_training()  # destroys the process group: exiting with it alive can abort a process
    return rows


if __name__ == "__main__":
    run_main(main, parse_args())
