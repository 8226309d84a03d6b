"""What a run writes: metrics.jsonl, the per-epoch summary line, trackers, the classification report, plots.
matplotlib is imported where the plots are drawn: a run needs it only at its end. The classification report is
scikit-learn's, counted here in numpy (scikit-learn's import is most of a second at the end of every run)."""

import csv
import json
import math
import os
from pathlib import Path

import numpy as np

from .outputs import write_atomically


def describe_launch(accelerator, *, batch_size, grad_accum):
    """One line on how the run is distributed, with the global batch size."""
    global_batch = batch_size * accelerator.num_processes * grad_accum
    return (f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, "
            f"device {accelerator.device}, mixed precision {accelerator.mixed_precision}; global batch {global_batch} "
            f"= {batch_size} per process x {accelerator.num_processes} processes x {grad_accum} accumulation steps")


def describe_tta(tta, accuracy_by_tta=None):
    """A --tta, in words: "flip + translate TTA" ("" for none); with an evaluation's `accuracy_by_tta`, what each step
    bought too: "flip + translate TTA; without it 96.44%, flip alone 92.22%"."""
    if tta == "none":
        return ""
    steps = tta_steps(tta, accuracy_by_tta)
    return f"{tta.replace('_', ' + ')} TTA" + (f"; {steps}" if steps else "")


def tta_steps(tta, accuracy_by_tta, *, plain="without it"):
    """The accuracy of each step of `tta` before the last, from an evaluation's `accuracy_by_tta`: "without it
    96.44%, flip alone 92.22%" ("" without TTA)."""
    return ", ".join(f"{plain if step == 'none' else step + ' alone'} {100 * accuracy:.2f}%"
                     for step, accuracy in (accuracy_by_tta or {}).items() if step != tta)


def tta_warning(evaluation):
    """A warning when an `evaluate` result's TTA lost clearly more images than it gained against the plain model
    (more than chance would: a sign test's 2 sigma), as flipping does to digits; else None."""
    gained, lost = evaluation["tta_vs_plain"].values()
    if lost - gained <= 2 * math.sqrt(lost + gained):
        return None
    return (f"warning: --tta {evaluation['tta']} lowered this model's accuracy to {evaluation['accuracy']:.2%}, from "
            f"{evaluation['accuracy_by_tta']['none']:.2%} without it (it turned {lost} right answers wrong and {gained} "
            "wrong ones right): these images do not keep their class mirrored or shifted. Score them without --tta, and "
            "train without it (a run chooses best/ on the accuracy with it)")


def log_epoch(accelerator, output_dir, record, *, epochs):
    """Append the epoch's record to metrics.jsonl, send it to the trackers, print one summary line."""
    epoch, lr, epoch_time_s = record["epoch"], record["lr"], record["epoch_time_s"]
    accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=epoch)
    if accelerator.is_main_process:
        write_metrics(output_dir, [*read_metrics(output_dir), record])
    tta = describe_tta(record.get("val_tta", "none"), record.get("val_accuracy_by_tta"))
    tta = f", {tta}" if tta else ""
    ema = f"ema_val_accuracy {100 * record['ema_val_accuracy']:.2f}%  " if "ema_val_accuracy" in record else ""
    accelerator.print(
        f"epoch {epoch}/{epochs}  train_loss {record['train_loss']:.4f}  val_loss {record['val_loss']:.4f}  "
        f"val_accuracy {100 * record['val_accuracy']:.2f}% ({record['val_samples']} images{tta})  {ema}"
        f"lr {lr:.2e}  {record['images_per_s']:,.0f} img/s  {epoch_time_s:.1f}s"
    )
    return record


def truncate_metrics(output_dir, *, before_epoch):
    """Keep the epochs before `before_epoch`: a run resumed from an older checkpoint writes the later ones again."""
    write_metrics(output_dir, [record for record in read_metrics(output_dir) if record["epoch"] < before_epoch])


def write_metrics(output_dir, records):
    """metrics.jsonl rewritten whole (a line per epoch), never a half-written line after a kill or a full disk."""
    write_atomically(Path(output_dir) / "metrics.jsonl",
                     lambda tmp: tmp.write_text("".join(json.dumps(record) + "\n" for record in records)))


def read_metrics(output_dir):
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write_predictions(path, evaluation, *, class_names, files=None):
    """One row per evaluated image: index, file (when there are files), label, predicted class, its probability."""
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["index", *(["file"] if files else []), "label", "prediction", "probability"])
            for index, label, probabilities in zip(evaluation["indices"], evaluation["labels"],
                                                   evaluation["probabilities"]):
                writer.writerow([index, *([files[index]] if files else []), class_names[label],
                                 class_names[probabilities.argmax()], f"{probabilities.max():.6f}"])

    write_atomically(path, write)


def write_reports(accelerator, output_dir, *, evaluation, class_names, curves=True):
    """classification_report.txt/.json on the main process, which gets the text report back (the others None);
    confusion_matrix.png and (`curves`) curves.png on `plotting_process`, at the same time where that is another
    process. Every process calls it; the plots are on disk once the caller's next `wait_for_everyone` returns."""
    output_dir = Path(output_dir)
    labels, predictions, text = evaluation["labels"], evaluation["predictions"], None
    if accelerator.is_main_process:
        text, report = classification_report(labels, predictions, class_names)
        write_atomically(output_dir / "classification_report.txt", lambda tmp: tmp.write_text(text))
        write_atomically(output_dir / "classification_report.json",
                         lambda tmp: tmp.write_text(json.dumps(report, indent=2)))
    if accelerator.process_index == plotting_process(accelerator):
        plot_confusion_matrix(output_dir / "confusion_matrix.png",
                              confusion_matrix(labels, predictions, len(class_names)), class_names)
        if curves:
            plot_curves(output_dir / "curves.png", read_metrics(output_dir))
    return text


def plotting_process(accelerator):
    """Which process draws the plots: the main process's neighbour on its machine where it has one (a launcher
    numbers one machine's processes together, the main process first), so that they are drawn into the same folder
    while the main process writes the other reports (on 2 CPU processes a second off the end of a run); else the
    main process."""
    return 1 if accelerator.num_processes > 1 and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1 else 0


def classification_report(labels, predictions, class_names, *, digits=4):
    """scikit-learn's classification_report(labels, predictions, labels=range(classes), target_names=class_names,
    digits=digits, zero_division=0), as its text and as its output_dict=True, to the last digit: precision, recall,
    F1 and support per class, then accuracy and the macro and weighted averages."""
    matrix = confusion_matrix(labels, predictions, len(class_names))
    tp, predicted, true = matrix.diagonal(), matrix.sum(axis=0), matrix.sum(axis=1)

    def divide(numerator, denominator):  # 0 where the denominator is (zero_division=0)
        return np.where(denominator == 0, 0.0, numerator / np.where(denominator == 0, 1, denominator))

    precision, recall, f1 = divide(tp, predicted), divide(tp, true), divide(2.0 * tp, 1.0 * true + predicted)
    rows = [(name, [float(p), float(r), float(f), int(n)]) for name, p, r, f, n in
            zip(class_names, precision, recall, f1, true)]
    accuracy = float(divide(tp.sum(), predicted.sum()))
    micro_f1 = float(divide(2.0 * tp.sum(), 1.0 * true.sum() + predicted.sum()))
    weighted = ([float(np.average(column, weights=true)) for column in (precision, recall, f1)] if true.sum()
                else [float(np.mean(column)) for column in (precision, recall, f1)])
    averages = {"macro avg": [float(np.mean(column)) for column in (precision, recall, f1)],
                "weighted avg": weighted}
    headers = ["precision", "recall", "f1-score", "support"]
    report = {name: dict(zip(headers, [*scores[:3], float(scores[3])])) for name, scores in rows}
    report["accuracy"] = accuracy
    report.update({name: dict(zip(headers, [*scores, float(true.sum())])) for name, scores in averages.items()})
    width = max(max(len(name) for name in class_names), len("weighted avg"), digits)
    row = "{:>{width}s} " + " {:>9.{digits}f}" * 3 + " {:>9}\n"
    text = "{:>{width}s} ".format("", width=width) + "".join(f" {header:>9}" for header in headers) + "\n\n"
    text += "".join(row.format(name, *scores, width=width, digits=digits) for name, scores in rows) + "\n"
    text += ("{:>{width}s} " + " {:>9}" * 2 + " {:>9.{digits}f} {:>9}\n").format(
        "accuracy", "", "", micro_f1, int(true.sum()), width=width, digits=digits)
    text += "".join(row.format(name, *scores, int(true.sum()), width=width, digits=digits)
                    for name, scores in averages.items())
    return text, report


def confusion_matrix(labels, predictions, num_classes):
    """scikit-learn's confusion_matrix(labels, predictions, labels=range(num_classes)): rows true, columns predicted."""
    counts = np.bincount(np.asarray(labels) * num_classes + np.asarray(predictions), minlength=num_classes ** 2)
    return counts.reshape(num_classes, num_classes)


def _figure(**kwargs):
    """A matplotlib Figure drawn by Agg, without pyplot's backend choice and figure registry: no display needed,
    nothing to close (its import costs about what pyplot's does: BENCHMARKS.md)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def label_fonts(names):
    """(the font families that draw `names`, or None for matplotlib's own; the names none of them can draw).
    matplotlib's font, DejaVu Sans, has no Chinese, Japanese or Korean: where a name needs characters it lacks, the
    machine's fonts that have them follow it in the list (matplotlib draws each character with the first font of the
    list that has it); names that still lack one are returned, as they would be drawn as boxes."""
    if all(name.isascii() for name in names):
        return None, []
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    def lacks(path, characters):
        font = FT2Font(path)
        return {c for c in characters if not font.get_char_index(ord(c))}

    families = ["DejaVu Sans"]
    missing = lacks(font_manager.findfont(families[0]), set("".join(names)) - set(" \t"))
    if not missing:
        return None, []
    for path in sorted(font_manager.findSystemFonts()):  # not the cached list: a font
        try:  # installed after matplotlib first ran is found too
            covered = missing - lacks(path, missing)
        except (OSError, RuntimeError, ValueError):  # a font file FreeType cannot read
            continue
        if covered:
            font_manager.fontManager.addfont(path)
            families.append(font_manager.FontProperties(fname=path).get_name())
            missing -= covered
        if not missing:
            break
    return families, [name for name in names if missing & set(name)]


def plot_confusion_matrix(path, matrix, class_names):
    size = max(5, 0.6 * len(class_names))
    fig = _figure(figsize=(size + 1, size))
    ax = fig.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    fig.colorbar(image, ax=ax)
    ticks = np.arange(len(class_names))
    fonts, undrawn = label_fonts(class_names)
    if undrawn:
        print(f"warning: no font here draws the class names {', '.join(undrawn)}: {Path(path).name} numbers them "
              f"instead (class N, in the order of classification_report.txt); install one that has their characters "
              "(Debian, Ubuntu: apt-get install fonts-noto-cjk for Chinese, Japanese and Korean) to see the names "
              "there (report.html shows them as text)", flush=True)
    labels = [f"class {i}" if name in undrawn else name for i, name in enumerate(class_names)]
    fonts = {"fontfamily": fonts} if fonts else {}
    ax.set_xticks(ticks, labels, rotation=45, ha="right", **fonts)
    ax.set_yticks(ticks, labels, **fonts)
    ax.set(xlabel="predicted", ylabel="true")
    threshold = matrix.max() / 2 if matrix.size else 0
    for i, j in np.ndindex(matrix.shape):
        # in_layout False: tight_layout need not measure the counts, which lie inside the axes (a third of the plot's
        # time with 10 classes, more with more)
        ax.text(j, i, str(matrix[i, j]), ha="center", va="center", fontsize=8,
                color="white" if matrix[i, j] > threshold else "black", in_layout=False)
    ax.set_title(f"confusion matrix ({matrix.sum()} images)")
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100))


def plot_curves(path, records):
    """curves.png (the report shows it): loss and validation accuracy per epoch."""
    fig = curves_figure(records)
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100))


def curves_figure(records):
    from matplotlib.ticker import MaxNLocator

    epochs = [r["epoch"] for r in records]
    fig = _figure(figsize=(10, 4))
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(epochs, [r["train_loss"] for r in records], "o-", label="train")
    loss_ax.plot(epochs, [r["val_loss"] for r in records], "o-", label="validation")
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    loss_ax.legend()
    acc_ax.plot(epochs, [100 * r["val_accuracy"] for r in records], "o-", color="tab:green")
    acc_ax.set(xlabel="epoch", ylabel="accuracy (%)", title="validation accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs, not 2.5, 5.0, 7.5
    fig.tight_layout()
    return fig
