"""Evaluation on every process, each sample counted exactly once; scoring a test set into reports."""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import broadcast
from torch.nn.parallel import DistributedDataParallel

from .distributed import is_compiled
from .flags import TTA
from .mistakes import find_label_issues, write_mistakes_report
from .reporting import confusion_matrix, tta_steps, tta_warning, write_predictions, write_reports


def probabilities(model, images, *, tta="none"):
    """The model's class probabilities for a batch of transformed images (float32). `tta` (common.flags.TTA) "flip":
    averaged with the horizontal mirror's; "flip_translate": that, averaged with the flip-averaged views shifted one
    pixel up-left and one down-right (reflect padding), as the fast CIFAR-10 recipe's evaluation does."""
    return tta_probabilities(model, images, tta=tta)[tta]


def tta_probabilities(model, images, *, tta="none"):
    """{"none": the plain probabilities, then each step of `tta` (see `probabilities`): the probabilities with it},
    in that order: each step averages the one before with new views, so an evaluation with TTA also learns, at no
    cost, what each step bought."""
    def flip_averaged(views, plain=None):
        plain = model(views).float().softmax(1) if plain is None else plain
        return (plain + model(views.flip(3)).float().softmax(1)) / 2

    found = {"none": model(images).float().softmax(1)}
    if tta == "none":
        return found
    found["flip"] = flip_averaged(images, found["none"])
    if tta == "flip_translate":
        height, width = images.shape[2:]
        padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
        # each view copied into the batch's layout: a compiled model is not compiled again for a view's strides
        views = (padded[:, :, :height, :width], padded[:, :, 2:, 2:])
        shifted = sum(flip_averaged(view.contiguous(memory_format=_layout(images))) for view in views) / 2
        found["flip_translate"] = (found["flip"] + shifted) / 2
    return found


@torch.inference_mode()
def evaluate(model, eval_dataloader, accelerator, *, transform, tta="none"):
    """Loss (plain cross entropy), accuracy, macro-F1, samples, the `tta` used (see `probabilities`), the accuracy at
    each step of it (`accuracy_by_tta`: {"none": without TTA, ...}; `tta_vs_plain`: how many images the TTA
    "gained" and "lost" against none), and the predictions, probabilities, labels and indices (numpy) of every
    process's samples, each once, in index order.
    A compiled model (--compile) sees every batch at the first one's size: the last, smaller batch is filled up with
    copies of its last image, whose scores are dropped, so that Dynamo does not compile the model again for that
    size (in eval mode each image's scores are its own: BatchNorm uses its running statistics)."""
    model.eval()
    _as_on_the_main_process(model, accelerator)
    compiled, size = is_compiled(model), None
    kept = [], [], [], [], []  # this process's indices, losses, probabilities, labels, right at each TTA step
    for batch in eval_dataloader:
        images = transform(batch["image"])
        count, size = len(images), size or len(images)
        if compiled and count < size:
            filler = images[-1:].expand(size - count, *images.shape[1:])
            images = torch.cat([images, filler]).contiguous(memory_format=_layout(images))
        steps = tta_probabilities(model, images, tta=tta)
        probs = steps[tta][:count]
        loss = F.nll_loss(probs.clamp_min(1e-12).log(), batch["label"], reduction="none")
        right = torch.stack([step[:count].argmax(1) == batch["label"] for step in steps.values()], 1)
        for parts, tensor in zip(kept, (batch["index"], loss, probs, batch["label"], right)):
            parts.append(tensor.cpu())
    indices, losses, all_probabilities, labels, right = gather_samples(accelerator, *map(torch.cat, kept))
    predictions = all_probabilities.argmax(1)
    return {"loss": losses.mean().item(), "accuracy": (predictions == labels).float().mean().item(),
            "macro_f1": macro_f1(labels, predictions, num_classes=all_probabilities.shape[1]),
            "samples": len(labels), "tta": tta,
            "accuracy_by_tta": dict(zip(TTA, right.float().mean(0).tolist())),  # {"none": ..., up to `tta`}
            # the images the TTA got right where the plain model did not, and the other way round
            "tta_vs_plain": {"gained": int((right[:, -1] & ~right[:, 0]).sum()),
                             "lost": int((right[:, 0] & ~right[:, -1]).sum())},
            "predictions": predictions.numpy(),
            "probabilities": all_probabilities.numpy(), "labels": labels.numpy(), "indices": indices.numpy()}


def _layout(images):
    """The memory format `images` (a batch, NCHW) is in: torch.channels_last or torch.contiguous_format."""
    channels_last = images.dim() == 4 and not images.is_contiguous() and images.is_contiguous(
        memory_format=torch.channels_last)
    return torch.channels_last if channels_last else torch.contiguous_format


def gather_samples(accelerator, index, *columns, chunk_bytes=2 ** 27):
    """(index, *columns) of every process's samples, each sample once, in the order of `index` (the samples' dataset
    indices): per-sample columns on the CPU (floats of at most 32 bits, integers, bools) gathered as the bits of one
    int64 tensor, in as few collectives as `chunk_bytes` of gathered rows on the device allow (one for an evaluation
    of 60,000 images and 10 classes). The samples that the processes' last batches repeat to keep them even
    (Accelerate's even_batches) are dropped by their index. (A 2-process label pass over 60,000 images spent a third
    of its time in its gathers when they were one per batch: the processes waited for each other at every batch.)"""
    columns = (index, *columns)
    if accelerator.num_processes > 1:
        widths = [math.prod(column.shape[1:]) for column in columns]
        bits = torch.cat([(column.float().view(torch.int32) if column.is_floating_point() else column)
                          .to(torch.int64).reshape(len(column), width) for column, width in zip(columns, widths)], 1)
        rows = int(accelerator.gather(torch.tensor([len(bits)], device=accelerator.device)).max())
        bits = torch.cat([bits, bits.new_full((rows - len(bits), bits.shape[1]), -1)])  # index -1: no sample
        step = max(1, chunk_bytes // (bits.element_size() * bits.shape[1] * accelerator.num_processes))
        packed = torch.cat([accelerator.gather(bits[start:start + step].to(accelerator.device)).cpu()
                            for start in range(0, rows, step)])
        packed, start, gathered = packed[packed[:, 0] >= 0], 0, []
        for column, width in zip(columns, widths):
            piece, start = packed[:, start:start + width], start + width
            if column.is_floating_point():
                piece = piece.to(torch.int32).view(torch.float32)
            gathered.append(piece.to(column.dtype).reshape(-1, *column.shape[1:]))
        columns = gathered
    order = torch.argsort(columns[0], stable=True)
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = columns[0][order[1:]] != columns[0][order[:-1]]
    return [column[order[first]] for column in columns]


def macro_f1(labels, predictions, *, num_classes):
    """scikit-learn's f1_score(average="macro", labels=range(num_classes), zero_division=0), without importing
    scikit-learn (1.6 s) before the first epoch's line: per class 2 TP / (predicted + true), 0 where both are 0."""
    counts = torch.from_numpy(confusion_matrix(labels, predictions, num_classes))
    both = counts.sum(0) + counts.sum(1)
    return (2 * counts.diag() / both.clamp_min(1)).mean().item()


def report_evaluation(accelerator, evaluation, *, output_dir, dataset, about=None, trained_on=False):
    """Write an `evaluate` result's classification report, confusion matrix, predictions.csv and mistakes report
    (with the suspected wrong labels of these images; `trained_on`: the model trained on them) into `output_dir`,
    and print one line: scripts/evaluate.py's reports, and a training run's test set. `about`: {"title" (the
    images, in words), "arguments" (the model's training run's)}, by default {"title": "test"}."""
    about = about or {"title": "test"}
    name, class_names = about["title"], dataset.classes
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    report = write_reports(accelerator, output_dir, evaluation=evaluation, class_names=class_names, curves=False)
    if accelerator.is_main_process:
        files = getattr(dataset, "files", None)
        write_predictions(Path(output_dir) / "predictions.csv", evaluation, class_names=class_names, files=files)
        label_issues = find_label_issues(evaluation, class_names=class_names, files=files, split=name,
                                         trained_on=trained_on)
    accelerator.wait_for_everyone()  # the plots drawn: report.html embeds them
    if accelerator.is_main_process:
        write_mistakes_report(output_dir, evaluation=evaluation, dataset=dataset, about=about,
                              label_issues=label_issues)
        print(f"classification report, {name} ({evaluation['samples']} images):\n{report}")
    steps = tta_steps(evaluation["tta"], evaluation["accuracy_by_tta"], plain="without TTA")
    if accelerator.is_main_process and (warning := tta_warning(evaluation)):
        print(warning)
    accelerator.print(f"{name}: {evaluation['samples']} images, accuracy {100 * evaluation['accuracy']:.2f}%"
                      f"{f' ({steps})' if steps else ''}, macro-F1 {evaluation['macro_f1']:.4f}; reports in {output_dir} "
                      "(open report.html)")
    accelerator.wait_for_everyone()


def _as_on_the_main_process(model, accelerator):
    """A module outside DDP (an EMA) drifts apart between processes, each with its own BatchNorm statistics: every
    process evaluates the main process's copy, the one checkpoints keep."""
    if accelerator.num_processes > 1 and not isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):
        broadcast(list(model.state_dict().values()), from_process=0)
