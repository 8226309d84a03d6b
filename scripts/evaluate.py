"""Score a trained model on a labelled dataset, on any number of processes, each image counted once.

The model: a best/ folder, a run's output folder (its best/), a checkpoint, or an .onnx file from
scripts/export.py (run by onnxruntime, as a deployment runs it). The data: any layout the
training scripts read, the one the model was trained on unless --dataset says otherwise:
  cifar10        CIFAR-10 python batches, their .tar.gz, a train/ + test/ (or val/) folder tree
  mnist, fashion_mnist   IDX files;  digits   scikit-learn's digits (no --data_dir)
  folder         DIR/<class>/<image>, or DIR/<split>/<class>/<image>
  any of them    hf:NAME_OR_PATH, a Hugging Face dataset (--image_column, --label_column if not found by type)
--split (default test) picks the split of the first three; for folder, DIR/<split> when DIR has one, else
(train or val) the share the training run's --val_fraction and --seed split off, else all of DIR; for a
Hugging Face dataset, the split of that name.
Classes are matched by name: the dataset may hold fewer classes than the model, never others.
Preprocessing is the training run's evaluation (meta.json's eval_transform, mean, std).

Writes to --output_dir: classification_report.txt/.json, confusion_matrix.png, predictions.csv (one row per
image: index, file for folder datasets, label, prediction, probability), the mistakes report (report.html: the
highest-loss images, confused pairs, each class's worst images, and the images whose label is suspect, by
confident learning, as cleanlab's; mistakes.json, losses.csv, label_issues.csv), and prints accuracy and macro-F1.

    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/evaluate.py \\
        --model_dir outputs/cifar/best --data_dir data --output_dir outputs/cifar/test
    python scripts/evaluate.py --model_dir outputs/seedlings --data_dir my_test_photos --tta flip
"""

import sys
from functools import partial
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find common/ from any working directory
try:  # a copy of this script needs the folder of what the scripts share (docs/recipes.md)
    import common.errors  # noqa: E402
except ModuleNotFoundError as missing:
    sys.exit(f"error: {Path(__file__).name} needs the common/ folder it came with, beside it or one folder up "
             f"({missing}): copy common/ into your repository too")
common.errors.on_another_version_of_common(__file__)
from common import cifar, mnist  # noqa: E402
from common.data import InMemoryDataset, build_dataloader, preprocess  # noqa: E402
from common.decode_cache import decode_split  # noqa: E402
from common.distributed import build_accelerator, prepare_to_evaluate  # noqa: E402
from common.errors import UserError, run_main  # noqa: E402
from common.evaluation import evaluate, report_evaluation  # noqa: E402
from common.exported import is_exported, load_model  # noqa: E402
from common.flags import ArgumentParser, add_tta_arg, nonnegative_int, path, positive_int  # noqa: E402
from common.folders import build_file_dataloader, build_folder_dataset, find_splits  # noqa: E402
from common.hf import add_hf_args, find_hf_split, hf_options, is_hf  # noqa: E402
from common.images import build_eval_transform, folder_entries, list_image_folder  # noqa: E402
from common.mistakes import MISTAKES_FILES  # noqa: E402
from common.models import model_folder  # noqa: E402
from common.outputs import make_folder  # noqa: E402
from common.reporting import describe_tta  # noqa: E402

IN_MEMORY_DATASETS = cifar.DATASETS | mnist.DATASETS  # by the name best/meta.json records, as "dataset"
DATASETS = (*IN_MEMORY_DATASETS, "folder")
OUTPUTS = ("classification_report.txt", "classification_report.json", "confusion_matrix.png", "predictions.csv",
           *MISTAKES_FILES)


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_dir", type=path, required=True,
                        help="best/, a run's output folder, a checkpoint, or an .onnx file from scripts/export.py")
    parser.add_argument("--data_dir", type=path, default=None, help="the labelled data (see above)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="its layout (default: the one the model was trained on, from meta.json)")
    parser.add_argument("--split", default="test", help="test, train, or a folder's split name (default: %(default)s)")
    parser.add_argument("--output_dir", type=path, default=None,
                        help="where the reports go (default: MODEL_DIR/../evaluation; for FILE.onnx, "
                             "FILE-evaluation beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace reports that are there already")
    add_tta_arg(parser)
    parser.add_argument("--batch_size", type=positive_int, default=256, help="per process (default: %(default)s)")
    parser.add_argument("--num_workers", type=nonnegative_int, default=None,
                        help="DataLoader workers per process, folder datasets (default: from the cores per process)")
    parser.add_argument("--skip_bad_images", action="store_true", help="leave unreadable images out instead of stopping")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="overrides the accelerate config (without one: bf16 where the device computes it)")
    add_hf_args(parser, splits=False)
    return parser.parse_args(argv)


def build_dataset(kind, data_dir, split, *, meta, skip_bad_images, accelerator, options=None):
    """The split, in the layout `kind`; items are dicts with image, label, index (`files`: each one's file or None).
    `options`: the parsed flags that name a Hugging Face dataset's columns."""
    if kind != "digits" and data_dir is None:
        raise UserError(f"--data_dir is needed for a {kind} dataset")
    columns = hf_options(options, data_dir) if options else {}
    if is_hf(data_dir) and kind != "folder":  # any split by name, decoded as the model's training set was
        return decode_split(find_hf_split(data_dir, split, **columns), size=meta["image_size"],
                            channels=meta["model_kwargs"]["in_chans"], accelerator=accelerator)
    if kind == "digits" and data_dir is not None:  # else the digits would be scored under the folder's name
        raise UserError(f"--data_dir {data_dir}: the digits are scikit-learn's and take no --data_dir; to score the "
                        "images there, add --dataset folder")
    if kind == "folder":
        trained = meta.get("args") or {}
        listed = (find_hf_split(data_dir, split, **columns) if is_hf(data_dir)
                  else list_folder_split(data_dir, split, val_fraction=trained.get("val_fraction"),
                                         seed=trained.get("seed")))
        dataset = build_folder_dataset(listed, transform=build_eval_transform(meta["eval_transform"]),
                                       skip_bad_images=skip_bad_images, accelerator=accelerator)
        if accelerator.is_main_process:
            if dataset.left_out:
                print(f"warning: left out {len(dataset.left_out)} unreadable images, e.g. {dataset.left_out[0]}",
                      file=sys.stderr)
            if not is_hf(data_dir) and not (Path(data_dir) / split).is_dir():  # DIR/<class>/<image>
                print(f"{data_dir} has no {split}/ folder: scoring " + (
                    f"its {split} share as the training run's --val_fraction {trained['val_fraction']} and --seed "
                    f"{trained['seed']} split a folder (stratified), {len(listed['files'])} images"
                    if listed["name"] in ("train", "val") else f"all its {len(listed['files'])} images"))
            if listed["name"] == "all" and (Path(data_dir) / ".checked-train.json").exists():
                print(f"warning: a training run split {data_dir} into train and val here (its .checked-train.json): "
                      "its training images are among those scored; --split val scores only the ones it held out",
                      file=sys.stderr)
        return dataset
    if split not in ("train", "test"):
        raise UserError(f"--split {split}: a {kind} dataset has the splits train and test")
    train, test = IN_MEMORY_DATASETS[kind](data_dir, seed=meta.get("args", {}).get("seed", 42))
    return train if split == "train" else test


def list_folder_split(data_dir, split, *, val_fraction, seed):
    """DIR/<split>/<class>/<image> where DIR has that split, else DIR/<class>/<image>, as find_splits lists them: of
    it, with --split train or val, the share that a split here with the training run's `val_fraction` and `seed`
    gives that name (the run's own split where it trained on DIR), else all of it."""
    named = (Path(data_dir) / split).is_dir()
    splits = [] if named or not Path(data_dir).is_dir() else split_names(data_dir)
    if splits:  # DIR/<split>/<class>/<image> without this split
        raise UserError(f"no split {split!r} in {data_dir} (there are: {', '.join(splits)}): pass --split "
                        f"{' or --split '.join(splits)}")
    if not named and split in ("train", "val") and val_fraction and seed is not None:
        train, val, _, _ = find_splits(data_dir, val_fraction=val_fraction, seed=seed)
        return train if split == "train" else val
    files, labels, classes, _ = list_image_folder(Path(data_dir) / split if named else data_dir)
    # the check is kept where a training run keeps its own
    return {"files": files, "labels": labels, "classes": classes, "name": split if named else "all",
            "root": Path(data_dir)}


def split_names(data_dir):
    """The folders of `data_dir` when each holds folders only (DIR/<split>/<class>/<image>), else none. A class folder
    holding a file ends the look: a folder of classes costs one listing of one class folder, not of all."""
    names = [name for name, kind in sorted(folder_entries(data_dir)) if kind == "dir"]
    for name in names:
        if {kind for _, kind in folder_entries(Path(data_dir) / name)} != {"dir"}:
            return []
    return names


def in_model_classes(dataset, class_names, where):
    """The dataset with its labels renumbered as the model's classes; one with a class the model does not
    know is refused, naming it."""
    unknown = [name for name in dataset.classes if name not in class_names]
    if unknown:
        raise UserError(f"{where} has classes the model does not know: {', '.join(unknown)}. The model's classes "
                        f"are {', '.join(class_names)}; leave the others out, or evaluate a model trained on them.")
    return dataset.relabelled(class_names)


def check_output_dir(args):
    """--output_dir, by default the run's folder/evaluation (FILE-evaluation beside an exported FILE.onnx); checked
    before any work, created if missing."""
    if args.output_dir:
        output_dir = Path(args.output_dir)
    elif is_exported(args.model_dir):
        output_dir = Path(args.model_dir).resolve().with_name(f"{Path(args.model_dir).stem}-evaluation")
    else:
        model_dir = model_folder(args.model_dir).resolve()
        run_dir = model_dir if (model_dir / "best").is_dir() else model_dir.parent
        output_dir = (run_dir.parent if run_dir.name == "checkpoints" else run_dir) / "evaluation"
    earlier = [name for name in OUTPUTS if output_dir.is_dir() and (output_dir / name).exists()]
    if earlier and not args.overwrite:
        raise UserError(f"{output_dir} already holds an evaluation ({', '.join(earlier)}): pass --overwrite to replace "
                        "it, or choose another --output_dir")
    return make_folder(output_dir, inputs=[args.data_dir] if args.data_dir else [], flag="--output_dir")


def main(args):
    accelerator = build_accelerator(mixed_precision=args.mixed_precision)
    model, meta, exported = load_model(args.model_dir)
    kind = args.dataset or meta.get("dataset")
    if kind is None:
        raise UserError(f"{args.model_dir} does not say which dataset layout it was trained on (written before "
                        f"evaluate.py existed): pass --dataset ({', '.join(DATASETS)})")
    output_dir = check_output_dir(args)
    dataset = build_dataset(kind, args.data_dir, args.split, meta=meta, skip_bad_images=args.skip_bad_images,
                            accelerator=accelerator, options=args)
    dataset = in_model_classes(dataset, meta["class_names"], args.data_dir or kind)
    if isinstance(dataset, InMemoryDataset):
        if list(dataset.image_size) != list(meta["image_size"]):
            raise UserError(f"{args.data_dir or kind} holds {dataset.image_size} images, the model takes "
                            f"{meta['image_size']}: pass the dataset it was trained on, or --dataset folder")
        dataloader = build_dataloader(dataset, batch_size=args.batch_size, shuffle=False)
    else:
        dataloader = build_file_dataloader(dataset, batch_size=args.batch_size, shuffle=False,
                                           num_workers=args.num_workers)
    model = model if exported else prepare_to_evaluate(accelerator, model)
    dataloader = accelerator.prepare(dataloader)
    transform = partial(preprocess, normalize=(meta["mean"], meta["std"]))
    evaluation = evaluate(model, dataloader, accelerator, transform=transform, tta=args.tta)
    tta = describe_tta(args.tta)
    about = {"title": f"{args.data_dir or kind} ({kind}, {args.split}{', ' + tta if tta else ''})",
             "arguments": meta.get("args")}
    report_evaluation(accelerator, evaluation, output_dir=output_dir, dataset=dataset, about=about,
                      trained_on=args.split == "train")
    accelerator.wait_for_everyone()  # and then all together: one that exits while another still works can abort
    accelerator.end_training()  # destroys the process group: exiting with it alive can abort a process
    return evaluation


if __name__ == "__main__":
    run_main(main, parse_args())
