"""Predict classes for images with a trained `best/` folder (model.safetensors + meta.json).

Same preprocessing as evaluation, as meta.json's "eval_transform" says: convert to the model's channels;
resize to its image size (bilinear), or for train_seedlings.py models resize the short side and center-crop;
normalise with the mean/std in meta.json. Needs no training script and no pickled code.
Unreadable images are reported by name and skipped; the rest are still predicted.

    python scripts/predict.py --model_dir outputs/cifar/best --output predictions.csv my_images/ extra.jpg
"""

import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
from common.checkpoint import load_best_model  # noqa: E402
from common.data import preprocess  # noqa: E402
from common.errors import UserError, run_main  # noqa: E402
from common.flags import ArgumentParser, device, positive_int  # noqa: E402
from common.folders import build_eval_transform, find_images, read_image  # noqa: E402
from common.outputs import check_output_file, write_atomically  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="image files and/or folders (searched recursively)")
    parser.add_argument("--model_dir", required=True, help="a best/ folder written by a training script")
    parser.add_argument("--output", default="predictions.csv",
                        help="CSV to write; an existing one is replaced only if predict.py wrote it (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output whatever it holds")
    parser.add_argument("--top_k", type=positive_int, default=3, help="classes per image (default: %(default)s)")
    parser.add_argument("--batch_size", type=positive_int, default=64, help="default: %(default)s")
    parser.add_argument("--device", type=device, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: %(default)s")
    return parser.parse_args(argv)


def is_predictions_csv(path):
    """A CSV this script wrote (its header), which a new run may replace."""
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), [])[:3] == ["file", "class_1", "probability_1"]
    except (OSError, UnicodeDecodeError, csv.Error):
        return False


@torch.inference_mode()
def main(args):
    paths = find_images(args.inputs)
    check_output_file(args.output, suffix=".csv", what="a CSV written by predict.py", is_ours=is_predictions_csv,
                      inputs=paths, overwrite=args.overwrite)
    model, meta = load_best_model(args.model_dir)
    model.to(args.device)
    classes, channels = meta["class_names"], meta["model_kwargs"]["in_chans"]
    transform = build_eval_transform(meta["eval_transform"])  # what the run's evaluation did
    top_k = min(args.top_k, len(classes))
    rows, failures = [], []
    for start in range(0, len(paths), args.batch_size):
        batch, kept = [], []
        for path in paths[start:start + args.batch_size]:
            try:
                batch.append(transform(read_image(path, channels=channels)))
                kept.append(path)
            except (OSError, ValueError) as error:
                failures.append(path)
                print(f"skipped {path}: not a readable image ({error})", file=sys.stderr)
        if not batch:
            continue
        images = torch.stack(batch).to(args.device)
        probabilities = model(preprocess(images, mean=meta["mean"], std=meta["std"])).float().softmax(1)
        top = probabilities.topk(top_k, dim=1)
        for path, values, indices in zip(kept, top.values.tolist(), top.indices.tolist()):
            rows.append([str(path)] + [item for i, p in zip(indices, values) for item in (classes[i], f"{p:.6f}")])

    if not rows:
        raise UserError(f"none of the {len(paths)} images could be read (see the lines above); {args.output} was "
                        "not written")

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["file"] + [f"{kind}_{k}" for k in range(1, top_k + 1) for kind in ("class", "probability")])
            writer.writerows(rows)

    write_atomically(args.output, write)
    print(f"predicted {len(rows)} images -> {args.output}" + (f"; skipped {len(failures)} unreadable" if failures else ""))
    return rows


if __name__ == "__main__":
    run_main(main, parse_args())
