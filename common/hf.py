"""Hugging Face datasets in (`--data_dir hf:NAME_OR_PATH`), as the same splits as a folder of class folders.

`hf:NAME` is a dataset on the Hub (or in the local cache with HF_HUB_OFFLINE=1, or where the Hub is out of reach: a
compute node without internet), `hf:DIR` a folder written by
`save_to_disk` or a folder of data files (parquet, ...; `datasets` infers the splits from the file names), and
`hf:parquet:GLOB` (or csv:, json:, imagefolder:) data files of that format. `datasets` does the loading; a split
becomes what `common.folders.find_splits` gives for a folder: "files" that `read_image` opens (each an `HFImage`,
its encoded bytes undecoded until a worker or the decode cache reads it), "labels", "classes", "name", and "root",
the folder where the decode cache and its record go (the split's own Arrow files; None for a set in memory).
`find_hf_stream` chooses the same splits and columns of a dataset read as streams (--streaming: common.streaming).
"""

import hashlib
import io
import os
import re
import socket
import sys
import tempfile
import urllib.parse
from pathlib import Path

from .errors import UserError
from .flags import positive_int
from .images import list_image_folder, split_dataset

PREFIX = "hf:"
VAL_SPLITS = ("validation", "valid", "val", "test")  # the first one a dataset has chooses the best model
FORMATS = ("parquet", "arrow", "csv", "json", "imagefolder", "webdataset")  # hf:FORMAT:GLOB
DATA_FILES = (".parquet", ".arrow", ".csv", ".json", ".jsonl", ".tar")  # a folder of these is hf:DIR


def is_hf(data_dir):
    return str(data_dir).startswith(PREFIX)


def add_hf_args(parser, *, splits=True, streaming=False):
    """The flags that choose a Hugging Face dataset's columns and (`splits`) its training and validation splits;
    by default found by type and name. `streaming`: --streaming and --shuffle_buffer (common.streaming)."""
    if splits:
        parser.add_argument("--train_split", default=None, help="hf: the training split (default: train)")
        parser.add_argument("--val_split", default=None,
                            help=f"hf: the split that chooses the best model (default: the first of "
                                 f"{', '.join(VAL_SPLITS)}; without one, --val_fraction of the training split)")
    parser.add_argument("--dataset_config", default=None,
                        help="hf: the configuration (subset) of a dataset that has several (default: its only one)")
    parser.add_argument("--image_column", default=None, help="hf: the image column (default: the Image feature)")
    parser.add_argument("--label_column", default=None,
                        help="hf: the label column (default: the ClassLabel feature); strings or integers become "
                             "classes by sorted value")
    if streaming:
        parser.add_argument("--streaming", action="store_true",
                            help="hf: read the training split as a stream while training, never whole on the disk "
                                 "(needs a held-out split; see docs/data.md)")
        parser.add_argument("--shuffle_buffer", type=positive_int, default=10000,
                            help="--streaming: examples each process shuffles among (default: %(default)s)")


def _has_data_files(folder):
    """Whether `folder`, or a folder in it (the Hub's data/ or train/), holds data files `datasets` loads."""
    return any(path.suffix in DATA_FILES and not path.name.startswith(".")  # not our .checked-*.json records
               for path in [*folder.glob("*"), *folder.glob("*/*")])


# what --dataset_config, --train_split, --val_split, --image_column and --label_column choose (None: found)
OPTIONS = ("dataset_config", "train_split", "val_split", "image_column", "label_column")


def hf_options(args, data_dir=None, *, flag="--data_dir"):
    """Those of --dataset_config, --train_split, --val_split, --image_column, --label_column that the script of
    `args` has; refused (with --streaming) when given for data (`data_dir`, else args.data_dir; given as `flag`)
    that is not a Hugging Face dataset: they would do nothing."""
    options = {name: getattr(args, name) for name in OPTIONS if hasattr(args, name)}
    data_dir = args.data_dir if data_dir is None else data_dir
    given = [f"--{name}" for name, value in options.items() if value is not None]
    given += ["--streaming"] if getattr(args, "streaming", False) else []
    if given and not is_hf(data_dir):
        where = f"{flag} {data_dir}".strip() + " is a folder" if data_dir else f"no {flag} names one"
        raise UserError(f"{' and '.join(given)} {'chooses' if len(given) == 1 else 'choose'} what to read of a "
                        f"Hugging Face dataset, and {where}: drop {' and '.join(given)}, or pass "
                        + f"{flag} hf:NAME_OR_PATH".strip())
    return options


def load_hf(data_dir, config=None, *, streaming=False):
    """{split name: datasets.Dataset} of `hf:...` (of its configuration `config`, --dataset_config); one message for a
    name that is neither a folder nor a dataset the Hub (or the offline cache) knows, or a configuration it lacks.
    `streaming`: datasets.IterableDataset splits, read as they are iterated (a save_to_disk folder's from its files)."""
    import datasets  # imported here: only this source needs it (2 s)

    if streaming:
        # datasets waits 5 s each time a shuffled stream of several shards is read through (every epoch), so that
        # Arrow's reading threads are done before a process that ends just then tears its interpreter down
        # (apache/arrow#45214). The scripts never tear theirs down (common.errors.end_process ends them with
        # os._exit): the wait is only time lost, 15 s of a 3-epoch run.
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
    if os.environ.get("RANK", "0") != "0":  # one process shows the download and conversion
        datasets.disable_progress_bars()
    spec = str(data_dir)[len(PREFIX):]
    if not spec.strip():
        raise UserError(f"{data_dir!r} names no dataset: pass hf:NAME (a dataset on the Hub), hf:PATH (a folder "
                        "written by save_to_disk, or of data files) or hf:parquet:GLOB")
    if spec.startswith(("/", "./", "../")) and not Path(spec).exists():  # a path, never a name on the Hub
        raise UserError(f"{data_dir}: {spec} not found")
    kind, _, files = spec.partition(":")
    unreachable = None  # why the Hub is out of reach, where it was asked for a name and is
    saved = Path(spec).is_dir() and any((Path(spec) / name).is_file() for name in ("dataset_dict.json", "state.json"))
    if config is not None and ((kind in FORMATS and files) or saved):
        raise UserError(f"--dataset_config chooses one of the configurations of a dataset on the Hub or of a folder of "
                        f"data files; {data_dir} is {'a folder written by save_to_disk' if saved else f'{kind} files'}"
                        f", which has none: drop --dataset_config {config}")
    try:
        if kind in FORMATS and files:
            loaded = datasets.load_dataset(kind, data_files=files, streaming=streaming)
        elif saved:
            loaded = datasets.load_from_disk(spec)
            if streaming:
                loaded = (datasets.IterableDatasetDict({name: split.to_iterable_dataset() for name, split in
                                                        loaded.items()})
                          if isinstance(loaded, datasets.DatasetDict) else loaded.to_iterable_dataset())
        elif Path(spec).is_dir() and not _has_data_files(Path(spec)):
            raise UserError(f"{data_dir} is a folder, but neither one written by save_to_disk nor one of data files "
                            f"({', '.join(DATA_FILES)}). For a folder of images pass --data_dir {spec} (without hf:)")
        else:
            unreachable = offline_unless_reachable()
            loaded = datasets.load_dataset(spec, name=config, streaming=streaming)
    except UserError:
        raise
    except Exception as error:  # datasets raises a dozen kinds: not found, offline, a format it cannot read
        names = re.search(r"(?:available configs|Available): \[([^\]]*)\]", str(error))
        if names:  # several configurations and none chosen, or one it does not have
            raise UserError(f"{data_dir} has the configurations {names.group(1)}"
                            + (f", not {config!r}" if config else "") + ": choose one with --dataset_config NAME")
        offline = (f" (the Hub is out of reach here, {unreachable}: from the local cache only. Without internet, "
                   "save the dataset with datasets' save_to_disk on a machine that has it and pass hf:FOLDER)"
                   if unreachable else " (offline: HF_HUB_OFFLINE=1, from the local cache only)"
                   if os.environ.get("HF_HUB_OFFLINE") == "1" else "")
        read_as = (f"{kind} files matching {files!r}" if kind in FORMATS and files
                   else f"the folder written by save_to_disk {spec}" if saved
                   else f"the folder of data files {spec}" if Path(spec).exists()
                   else f"a dataset name on the Hub{offline} (data files of one format are hf:parquet:GLOB, also "
                        f"{', '.join(FORMATS[1:])})")
        raise UserError(f"cannot load {data_dir}, read as {read_as}: "
                        f"{' '.join(str(error).split()) or type(error).__name__}") from None
    return (dict(loaded) if isinstance(loaded, (datasets.DatasetDict, datasets.IterableDatasetDict))
            else {"train": loaded})


def hub_out_of_reach(timeout=5):
    """Why the Hub (HF_ENDPOINT's host: a mirror too) takes no connection from here, or None where it does or a proxy
    stands between (then `datasets` finds out)."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                              "all_proxy")):
        return None
    from huggingface_hub import constants

    url = urllib.parse.urlsplit(constants.ENDPOINT)  # one urllib cannot split stops huggingface_hub's own import
    if not url.hostname:
        return f"HF_ENDPOINT={constants.ENDPOINT!r} is not a URL such as https://huggingface.co"
    address = (url.hostname, url.port or (80 if url.scheme == "http" else 443))
    try:
        socket.create_connection(address, timeout=timeout).close()
    except OSError as error:
        return f"{address[0]}:{address[1]} {error.strerror or error}"
    return None


def offline_unless_reachable():
    """hub_out_of_reach's answer (None where offline already: HF_HUB_OFFLINE); where the Hub is out of reach,
    huggingface_hub (and datasets, timm's downloads through it, this process's DataLoader workers) switched to the
    local cache only, at once: they would retry for 23-50 s, a line each time, before the same failure."""
    from huggingface_hub import constants

    unreachable = None if constants.HF_HUB_OFFLINE else hub_out_of_reach()
    if unreachable:
        constants.HF_HUB_OFFLINE = True
        os.environ["HF_HUB_OFFLINE"] = "1"
        if "datasets" in sys.modules:
            sys.modules["datasets"].config.HF_HUB_OFFLINE = True
    return unreachable


def find_hf_splits(data_dir, *, val_fraction, seed, options=None, fraction_typed=False):
    """(train, val, classes, skipped) as `find_splits` gives them for a folder, the dataset's config, splits and
    columns as `options` (`hf_options`) choose them; each split's "source" says in words which were chosen and why,
    for the first log line. Without a validation split, `val_fraction` of the training split validates (None:
    refused); `fraction_typed`: --val_fraction was typed, and is refused where a validation split validates."""
    options = {**dict.fromkeys(OPTIONS), **(options or {})}
    dataset_config, given_val = options.pop("dataset_config"), options["val_split"] is not None
    splits = load_hf(data_dir, dataset_config)
    train_name, val_name, image_column, label_column, (labels, classes, named) = _choose(splits, data_dir, **options)
    train = splits[train_name]
    how = [f"{_named(data_dir, dataset_config)}: split {train_name!r} trains"]
    if val_name is None and val_fraction is None:
        raise UserError(f"{data_dir} has no held-out split ({', '.join(VAL_SPLITS)}); its splits: "
                        f"{', '.join(map(repr, splits))}. Name the one to score with --val_split")
    if val_name is not None and fraction_typed:
        raise UserError(f"--val_fraction {val_fraction} splits the training split of a dataset without a held-out "
                        f"one, and {data_dir} has {val_name!r}, which validates: drop --val_fraction")
    if val_name is None:
        train_rows, val_rows = split_dataset(labels, val_fraction=val_fraction, seed=seed, classes=classes)
        parts = {"train": (train, train_rows, [labels[i] for i in train_rows]),
                 "val": (train, val_rows, [labels[i] for i in val_rows])}
        how.append(f"no {' / '.join(VAL_SPLITS)} split: {len(val_rows)} of its images validate (--val_fraction "
                   f"{val_fraction}, stratified, --seed)")
    else:
        val = splits[val_name]
        _column(val, image_column, "Image", "--image_column", data_dir, val_name)
        _column(val, label_column, "ClassLabel", "--label_column", data_dir, val_name)
        val_labels = _labels_as(val, label_column, classes, data_dir, val_name)
        parts = {"train": (train, range(len(train)), labels), "val": (val, range(len(val)), val_labels)}
        how.append(f"{val_name!r} validates" + ("" if given_val else f" (the first of {', '.join(VAL_SPLITS)} "
                                                                    "it has; --val_split chooses another)"))
    how.append(f"images from column {image_column!r}, labels from {label_column!r}"
               + ("" if named else f" ({len(classes)} classes: its values, sorted)"))
    how = "; ".join(how)
    split_names = {"train": train_name, "val": val_name or train_name}
    train, val = (_as_split(HFImages(dataset, image_column, rows, name=f"{data_dir}[{split_names[name]}]"),
                            part_labels, classes=classes, name=name, source=how)
                  for name, (dataset, rows, part_labels) in parts.items())
    return train, val, classes, []


def find_hf_stream(data_dir, *, dataset_config=None, train_split=None, val_split=None, image_column=None,
                   label_column=None):
    """(train, val, classes) of a dataset read as streams (--streaming): splits and columns chosen as
    `find_hf_splits` chooses them, but a held-out split is needed (a stream is not split here). Each split is a
    dict of "stream" (a datasets.IterableDataset of the two columns, images undecoded), "image_column", "classes",
    "files_name" and "source"; the training one also "num_examples" and "label_of" (an example -> its class),
    the held-out one "labels". Classes and counts come from one pass over each label column."""
    import datasets

    splits = {name: split if split.features else split._resolve_features()  # a format that names no features
              for name, split in load_hf(data_dir, dataset_config, streaming=True).items()}
    train_name, val_name, image_column, label_column, (labels, classes, named) = _choose(
        splits, data_dir, train_split=train_split, val_split=val_split, image_column=image_column,
        label_column=label_column)
    if val_name is None:
        raise UserError(f"{data_dir} has no held-out split ({', '.join(VAL_SPLITS)}) and --streaming does not split "
                        f"one off; its splits: {', '.join(map(repr, splits))}. Name the one to validate with "
                        "--val_split, or drop --streaming")
    train, val = splits[train_name], splits[val_name]
    _column(val, image_column, "Image", "--image_column", data_dir, val_name)
    val_labels = _labels_as(val, label_column, classes, data_dir, val_name)
    source = (f"{_named(data_dir, dataset_config)}: split {train_name!r} streamed ({len(labels)} examples), {val_name!r} validates; images from "
                f"column {image_column!r}, labels from {label_column!r}"
              + ("" if named else f" ({len(classes)} classes: its values, sorted)"))
    index = {value: i for i, value in enumerate(classes)}

    def undecoded(split):
        return split.select_columns([image_column, label_column]).cast_column(image_column,
                                                                              datasets.Image(decode=False))

    def label_of(example):
        value = example[label_column]
        return value if named else index[str(value)]

    common = {"image_column": image_column, "classes": classes, "source": source}
    return ({**common, "stream": undecoded(train), "files_name": f"{data_dir}[{train_name}]",
             "num_examples": len(labels), "label_of": label_of},
            {**common, "stream": undecoded(val), "files_name": f"{data_dir}[{val_name}]", "labels": val_labels},
            classes)


def find_hf_split(data_dir, split, *, dataset_config=None, image_column=None, label_column=None):
    """One split of a Hugging Face dataset (scripts/evaluate.py), as `find_hf_splits` gives them; its classes are
    its own (a ClassLabel's names, else its sorted values)."""
    dataset, name, image_column = _one_split(data_dir, split, image_column, dataset_config)
    label_column = _column(dataset, label_column, "ClassLabel", "--label_column", data_dir, name)
    labels, classes, _ = _classes(dataset, label_column, data_dir, name)
    return _as_split(HFImages(dataset, image_column, range(len(dataset)), name=f"{data_dir}[{name}]"), labels,
                     classes=classes, name=f"hf-{name}", source=f"{data_dir} split {name!r}")


def hf_images(data_dir, split, *, dataset_config=None, image_column=None):
    """The images of one split of a Hugging Face dataset, as HFImages (scripts/compute_mean_std.py)."""
    dataset, name, image_column = _one_split(data_dir, split, image_column, dataset_config)
    return HFImages(dataset, image_column, range(len(dataset)), name=f"{data_dir}[{name}]")


def _one_split(data_dir, split, image_column, dataset_config):
    splits = load_hf(data_dir, dataset_config)
    name = _split_name(splits, split, (), "--split", data_dir)
    return splits[name], name, _column(splits[name], image_column, "Image", "--image_column", data_dir, name)


def _as_split(images, labels, *, classes, name, source):
    """The dict `find_splits` gives for a folder, of a dataset's `images` (HFImages)."""
    return {"files": images, "labels": list(labels), "classes": classes, "name": name, "root": images.folder,
            "source": source}


def _choose(splits, data_dir, *, train_split, val_split, image_column, label_column):
    """(training split's name, held-out split's name or None, image column, label column, (labels, classes,
    whether the column names them)) of `splits`: found by name and type, or given; the labels checked as classes."""
    train_name = _split_name(splits, train_split, ("train",), "--train_split", data_dir)
    val_name = (_split_name(splits, val_split, (), "--val_split", data_dir) if val_split is not None
                else next((name for name in VAL_SPLITS if name in splits and name != train_name), None))
    if val_name == train_name:
        raise UserError(f"--val_split {val_name!r} is the split that trains (--train_split): the run would score, and "
                        "choose best/ on, the images it learns from. Name another of its splits ("
                        f"{', '.join(map(repr, splits))}), or leave --val_split out: a split named "
                        f"{' or '.join(VAL_SPLITS)} validates, else --val_fraction of {train_name!r}")
    train = splits[train_name]
    image_column = _column(train, image_column, "Image", "--image_column", data_dir, train_name)
    label_column = _column(train, label_column, "ClassLabel", "--label_column", data_dir, train_name)
    if image_column == label_column:
        raise UserError(f"--image_column and --label_column are both {image_column!r}: give two columns")
    labels, classes, named = _classes(train, label_column, data_dir, train_name)
    if len(classes) < 2:
        raise UserError(f"{data_dir} split {train_name!r} column {label_column!r} has "
                        f"{'one class' if classes else 'no labels'}: a classifier needs at least 2 classes")
    return train_name, val_name, image_column, label_column, (labels, classes, named)


def _named(data_dir, dataset_config):
    """The dataset as the first log line names it."""
    return f"{data_dir}" + (f" (configuration {dataset_config!r})" if dataset_config else "")


def _split_name(splits, given, defaults, flag, data_dir):
    for name in ([given] if given is not None else defaults):
        if name in splits:
            return name
    wanted = repr(given) if given is not None else " or ".join(map(repr, defaults))
    raise UserError(f"{data_dir} has no split {wanted}; its splits: {', '.join(map(repr, splits))}. Choose one with "
                    f"{flag}")


def _first_value(dataset, column):
    """The first row's `column` of a split read from disk (None for a stream, or an empty split)."""
    try:
        return dataset.select_columns([column])[0][column] if len(dataset) else None
    except TypeError:  # an IterableDataset has no len
        return None


def _column(dataset, given, kind, flag, data_dir, split):
    """The column `given`, else the one whose feature is `kind` (Image, ClassLabel)."""
    import datasets

    features = dataset.features
    described = ", ".join(f"{name} ({type(feature).__name__})" for name, feature in features.items())
    if given is not None:
        if given not in features:
            raise UserError(f"{data_dir} split {split!r} has no column {given!r} ({flag}); its columns: {described}")
        feature = features[given]
        if kind == "Image" and not (isinstance(feature, datasets.Image) or isinstance(feature, datasets.Value)
                                    and feature.dtype in ("string", "large_string", "binary", "large_binary")):
            raise UserError(f"{data_dir} split {split!r} column {given!r} ({flag}) holds {feature}, not images (an "
                            f"Image feature, encoded bytes or file paths); its columns: {described}")
        first = _first_value(dataset, given) if kind == "Image" and isinstance(feature, datasets.Value) else None
        if isinstance(first, str) and not Path(first).is_file():  # text, not paths: said once, not per image
            raise UserError(f"{data_dir} split {split!r} column {given!r} ({flag}) holds text that names no file "
                            f"({first[:60]!r} in its first row), not images (an Image feature, encoded bytes or "
                            f"file paths); its columns: {described}")
        return given
    found = [name for name, feature in features.items() if isinstance(feature, getattr(datasets, kind))]
    if len(found) != 1:
        raise UserError(f"{data_dir} split {split!r} has {'no' if not found else 'more than one'} {kind} column "
                        f"({described}): name the {'images' if kind == 'Image' else 'labels'} with {flag}")
    return found[0]


def _classes(dataset, column, data_dir, split):
    """(labels, class names, whether the column names them): a ClassLabel's names, else the sorted values."""
    import datasets

    feature = dataset.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return _values(dataset, column, data_dir, split), list(feature.names), True
    values = _values(dataset, column, data_dir, split)
    classes = sorted(set(values))
    index = {value: i for i, value in enumerate(classes)}
    return [index[value] for value in values], [str(value) for value in classes], False


def _labels_as(dataset, column, classes, data_dir, split):
    """The labels of another split in the training split's `classes` (by name: a ClassLabel's order may differ)."""
    import datasets

    feature = dataset.features[column]
    values = _values(dataset, column, data_dir, split)
    names = feature.names if isinstance(feature, datasets.ClassLabel) else None
    index = {name: i for i, name in enumerate(classes)}
    labels = []
    for row, value in enumerate(values):
        name = names[value] if names else str(value)
        if name not in index:
            raise UserError(f"{data_dir} split {split!r} row {row} has label {name!r}, which the training split does "
                            f"not have (its classes: {', '.join(classes)})")
        labels.append(index[name])
    return labels


def _values(dataset, column, data_dir, split):
    """The column's values; refused where they are not classes (floats, lists, missing ones)."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):  # a stream: one pass over the label column
        values = [example[column] for example in dataset.select_columns([column])]
    else:
        values = (dataset.data if dataset._indices is None else dataset.flatten_indices().data).column(column).to_pylist()
    for row, value in enumerate(values):
        if value is None or isinstance(value, bool) or not isinstance(value, (int, str)):
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
            what = "is empty" if value is None else f"is {shown} ({type(value).__name__})"
            raise UserError(f"{data_dir} split {split!r} column {column!r} row {row} {what}: labels must be class "
                            "names (strings) or integers. Name the label column with --label_column")
        if isinstance(value, int) and value < 0:  # ClassLabel's "no label"
            raise UserError(f"{data_dir} split {split!r} column {column!r} row {row} has no label ({value}): remove "
                            "the unlabelled rows (Dataset.filter) or choose another split")
    return values


def save_folder_as_dataset(folder, target):
    """A folder of class folders as a save_to_disk dataset at `target` (unless one is there): each image's bytes as
    they are in an Image column `image`, the classes in a ClassLabel column `label`; a split folder's train/ and
    val/ as the splits "train" and "validation" (scripts/benchmark_hf.py, scripts/benchmark_folders.py)."""
    if any((Path(target) / name).exists() for name in ("state.json", "dataset_dict.json")):
        return
    import datasets

    def split(part, cache_dir):
        files, labels, classes, _ = list_image_folder(part)
        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
        return datasets.Dataset.from_generator(  # one image at a time: 100,000 images are not all held in memory
            lambda: ({"image": {"bytes": file.read_bytes(), "path": file.name}, "label": label}
                     for file, label in zip(files, labels)), features=features, cache_dir=cache_dir)

    parts = {"train": Path(folder) / "train", "validation": Path(folder) / "val"}
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    # the generator's own copy goes beside `target` and is removed, not left in ~/.cache/huggingface
    with tempfile.TemporaryDirectory(dir=Path(target).parent, prefix=".generator-") as cache_dir:
        if all(part.is_dir() for part in parts.values()):
            datasets.DatasetDict({name: split(part, cache_dir) for name, part in parts.items()}).save_to_disk(target)
        else:
            split(folder, cache_dir).save_to_disk(target)


def encoded(value):
    """A file object of an Image column's undecoded value ({"bytes", "path"}: its bytes, or the file it names), or of
    a column of encoded bytes or file paths."""
    if value is None:
        raise ValueError("the row has no image")
    if isinstance(value, dict):
        return io.BytesIO(value["bytes"]) if value.get("bytes") else open(value["path"], "rb")
    return open(value, "rb") if isinstance(value, str) else io.BytesIO(value)


class HFImages:
    """The images of `rows` of a split's `column`, undecoded: item i is an HFImage that `read_image` opens. Passed to
    DataLoader workers by pickling, which for a dataset read from disk is its file names (Arrow maps the files)."""

    def __init__(self, dataset, column, rows, *, name):
        import datasets

        if dataset._indices is not None:  # a selection or shuffle not yet written: rows as they are seen
            dataset = dataset.flatten_indices()
        self.dataset = dataset.select_columns([column]).cast_column(column, datasets.Image(decode=False))
        self.column, self.rows, self.name = column, list(rows), name
        self._paths = None
        files = [Path(file["filename"]) for file in dataset.cache_files]
        self.folder = files[0].parent if files else None

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [HFImage(self, i) for i in range(len(self))[index]]
        return HFImage(self, index)

    def __iter__(self):
        return (HFImage(self, i) for i in range(len(self)))

    def encoded(self, index):
        """A file object of item `index`'s encoded image (its bytes, or the file it names)."""
        return encoded(self.dataset[self.rows[index]][self.column])

    def __getstate__(self):  # to a worker: the dataset (for one read from disk, its file names), not the paths
        return {**self.__dict__, "_paths": None}

    def path(self, index):
        """The file name item `index` came from, as the dataset keeps it ('' where it keeps none)."""
        if self._paths is None:  # read once, from the Arrow column's path field alone (its bytes stay on disk)
            column = self.dataset.data.column(self.column)
            self._paths = [path for chunk in column.chunks for path in chunk.field("path").to_pylist()]
        return (self._paths[self.rows[index]] or "") if self._paths else ""

    def fingerprint(self):
        """The dataset's fingerprint (`datasets` changes it with every change of its data), the column and rows."""
        rows = hashlib.sha256(",".join(map(str, self.rows)).encode()).hexdigest()
        return hashlib.sha256(f"{self.dataset._fingerprint}:{self.column}:{rows}".encode()).hexdigest()


class HFImage:
    """One image of an HFImages: `read_image` opens it; named `hf:NAME[split][row]` in messages and reports."""

    def __init__(self, images, index):
        self.images, self.index = images, index

    def open(self):
        return self.images.encoded(self.index)

    def __str__(self):
        path = self.images.path(self.index)
        return f"{self.images.name}[{self.images.rows[self.index]}]" + (f" ({path})" if path else "")

    __repr__ = __str__
