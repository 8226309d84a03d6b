"""A Hugging Face dataset against the folder it was made from: train_seedlings.py's images/s, start-up and accuracy.

    python scripts/benchmark_hf.py --data_dir data/plant-seedlings --work_dir /tmp/hf-bench -- \\
        --model resnet18 --image_size 64 --epochs 2 --batch_size 64

Splits the folder 70/30 (scripts/split_dataset.py: stratified, seed 42, as train_seedlings.py splits it; a folder
with train/ and val/ is taken as it is; once per --data_dir in --work_dir) and writes
the split's images, their encoded bytes unchanged, as a `save_to_disk` dataset (splits "train" and "validation",
an Image and a ClassLabel column; both kept in --work_dir), then trains on each source in turn, --repeats times,
alternating: `--data_dir SPLIT` and `--data_dir hf:DATASET` with the flags after `--`, the same seed. Each run gives its images/s
(metrics.jsonl, all epochs), its start-up (from the launch to the first epoch's first batch: the first log line)
and its final accuracy. The same images in the same order make the same batches: accuracy must match; the
time is what the source costs. Once with the decode cache (the default for sets up to 4 GB) and once with
--no-cache_images (DataLoader workers decode every image, each epoch: the path where the sources differ), then
the dataset alone with --streaming (each micro-batch decoded as the stream is read, every epoch; its order is the
stream's, so its accuracy differs), against the folder's decode cache rows.
"""

import json
import statistics
from collections import deque
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # find common/ from any working directory
from common.errors import UserError, run_main  # noqa: E402
from common.flags import ArgumentParser, path, positive_int  # noqa: E402
from common.hf import save_folder_as_dataset  # noqa: E402
from common.outputs import make_folder  # noqa: E402
from common.tools import split_once  # noqa: E402


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data_dir", type=path, default="data/plant-seedlings",
                        help="a folder of class folders, or of train/ and val/ (default: %(default)s)")
    parser.add_argument("--work_dir", type=path, default="/tmp/hf-bench",
                        help="the split, the dataset and the runs go here (default: %(default)s)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="runs per source and path (default: 2)")
    parser.add_argument("training", nargs="*", help="train_seedlings.py's flags, after --")
    return parser.parse_args(argv)


def train(data_dir, output_dir, flags):
    """(images/s over the epochs, start-up s, final val accuracy) of one train_seedlings.py run."""
    command = [sys.executable, str(REPO / "scripts" / "train_seedlings.py"), "--data_dir", str(data_dir),
               "--output_dir", str(output_dir), "--overwrite", "--no-find_label_issues", *flags]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    startup, said = None, deque(maxlen=5)
    for line in process.stdout:
        said.append(line.rstrip())
        if startup is None and " optimizer steps, " in line:  # the first log line: data, model, all ready
            startup = time.perf_counter() - start
    if process.wait() != 0:  # the flags after -- are the user's: train_seedlings.py's own message says what is wrong
        raise UserError(f"train_seedlings.py --data_dir {data_dir} {' '.join(flags)} failed; its last lines:\n"
                        + "\n".join(said))
    metrics = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    images = sum(record["train_samples"] for record in metrics)
    return images / sum(record["train_time_s"] for record in metrics), startup, metrics[-1]["val_accuracy"]


def main(args):
    work = make_folder(args.work_dir, inputs=[args.data_dir])
    split, hf_dir = split_once(args.data_dir, work)[0], work / "dataset"
    save_folder_as_dataset(split, hf_dir)
    sources = {"folder": split.resolve(), "hf": f"hf:{hf_dir.resolve()}"}
    results = {}
    for way, flags in (("decode cache", []), ("files, workers", ["--no-cache_images"]), ("streamed", ["--streaming"])):
        for repeat in range(args.repeats):
            for source, data_dir in sources.items():
                if way == "streamed" and source == "folder":  # a folder is not streamed: the cache's rows compare
                    continue
                run = train(data_dir, work / f"run-{source}", [*args.training, *flags])
                results.setdefault((way, source), []).append(run)
                print(json.dumps({"path": way, "source": source, "repeat": repeat, "images_per_s": round(run[0], 1),
                                  "startup_s": round(run[1], 1), "val_accuracy": run[2]}), flush=True)
    print("\n| data path | source | images/s (mean of runs) | hf / folder | start-up s | val accuracy |")
    print("|---|---|---|---|---|---|")
    for (way, source), runs in results.items():
        rate = statistics.mean(run[0] for run in runs)
        folder = statistics.mean(run[0] for run in results[(way if way != "streamed" else "decode cache", "folder")])
        print(f"| {way} | {source} | {rate:.1f} ({', '.join(f'{run[0]:.1f}' for run in runs)}) | "
              f"{rate / folder:.3f} | {statistics.mean(run[1] for run in runs):.1f} | "
              f"{', '.join(f'{run[2]:.2%}' for run in runs)} |")
    return results


if __name__ == "__main__":
    run_main(main, parse_args())
