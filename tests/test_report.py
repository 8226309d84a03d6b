"""The mistakes report: what it counts, the wrong labels it finds, and that a real browser shows all of it."""

import csv

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix, recall_score

from conftest import REPO, assert_report_shows, launch_warm, require, write_idx
from common.mistakes import EXAMPLES, SHOWN, confident_learning, find_label_issues, find_mistakes
from common.mnist import FASHION_MNIST_CLASSES, build_mnist, read_idx


def rows(path):
    return list(csv.DictReader(open(path)))


def test_the_mistakes_are_counted_from_the_probabilities_as_scikit_learn_counts_them():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 300)
    logits = rng.normal(size=(300, 5)) + 2 * np.eye(5)[labels]
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    indices = rng.permutation(1000)[:300]  # rows of a dataset, not positions
    evaluation = {"probabilities": probabilities, "labels": labels, "indices": indices, "macro_f1": 0.5}
    names = list("abcde")
    mistakes = find_mistakes(evaluation, class_names=names)

    loss = -np.log(probabilities[np.arange(300), labels])
    assert [image["index"] for image in mistakes["losses"]] == indices[np.argsort(-loss, kind="stable")].tolist()
    assert mistakes["top_losses"] == mistakes["losses"][:SHOWN]
    assert mistakes["loss"] == pytest.approx(loss.mean())
    predictions = probabilities.argmax(1)
    matrix = confusion_matrix(labels, predictions)
    for pair in mistakes["confused_pairs"]:
        true, taken = names.index(pair["label"]), names.index(pair["prediction"])
        assert pair["count"] == matrix[true, taken] and true != taken
        assert len(pair["examples"]) == min(EXAMPLES, pair["count"])
        assert all((image["label"], image["prediction"]) == (pair["label"], pair["prediction"])
                   for image in pair["examples"])
    off_diagonal = np.sort((matrix - np.diag(np.diag(matrix))).ravel())[::-1]
    assert [pair["count"] for pair in mistakes["confused_pairs"]] == off_diagonal[:len(mistakes["confused_pairs"])].tolist()
    recalls = recall_score(labels, predictions, average=None)
    assert {c["class"]: c["recall"] for c in mistakes["per_class"]} == pytest.approx(dict(zip(names, recalls)))
    assert [c["recall"] for c in mistakes["per_class"]] == sorted(recalls)  # the weakest class first
    for entry in mistakes["per_class"]:  # its highest-loss images: the class's own, the worst first
        assert all(image["label"] == entry["class"] for image in entry["worst"])
        assert [image["loss"] for image in entry["worst"]] == sorted((image["loss"] for image in entry["worst"]),
                                                                     reverse=True)


def test_confident_learning_flags_and_ranks_the_images_cleanlab_does(monkeypatch):
    """Ours (numpy, so that a run's end imports neither cleanlab nor scikit-learn) against cleanlab's
    find_label_issues with the options the report uses: the same images in the same order, on softmax outputs of
    float32 and float64, confident and unsure models, rare, missing and single-image classes, ties."""
    import sys

    if "datasets" not in sys.modules:  # cleanlab's Datalab, unused, would import it (seconds); put back after
        monkeypatch.setitem(sys.modules, "datasets", None)
    from cleanlab.filter import find_label_issues

    rng = np.random.default_rng(0)
    flagged = 0
    for trial in range(300):
        classes, n = int(rng.integers(2, 13)), int(rng.integers(2, 800))
        labels = rng.integers(0, classes, n)
        if trial % 5 == 1:
            labels[labels == classes - 1] = 0  # a class absent from the labels
        if trial % 5 == 2:
            labels[rng.integers(0, n)] = classes - 1  # a class of one image (or more, by the draw)
        strength = rng.uniform(0, 6)
        logits = rng.normal(size=(n, classes)) + strength * np.eye(classes)[labels]
        logits[rng.random(n) < 0.1] = logits[0]  # repeated rows: ties in every sort
        probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        probs = probs.astype(np.float32 if trial % 2 else np.float64)
        probs /= probs.sum(1, keepdims=True)
        if len(np.unique(labels)) < 2:
            continue
        expected = find_label_issues(labels, probs, return_indices_ranked_by="self_confidence", n_jobs=1)
        ours = confident_learning(labels, probs)
        assert ours.tolist() == expected.tolist(), (trial, classes, n)
        flagged += len(ours)
    assert flagged > 1000  # the trials flag images, not only none


def test_a_model_too_weak_for_its_suspected_labels_to_mean_much_is_said_with_them():
    """A short or failed run flags most of the images it gets wrong: beyond a third of them flagged, the list and
    the report say that the labels are that noisy or the model too weak; a trained model's list says nothing more."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 2000)
    for strength, caveat in ((0.3, True), (6.0, False)):  # about chance, and a trained model with a few wrong labels
        logits = rng.normal(size=(2000, 10)) + strength * np.eye(10)[labels]
        probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        scores = {"probabilities": probabilities, "labels": labels, "indices": np.arange(2000)}
        found = find_label_issues(scores, class_names=list("abcdefghij"), split="training", trained_on=True)
        assert ("caveat" in found) == caveat and (found["flagged"] > 2000 / 3) == caveat, found["flagged"]
    wrong = np.full((2000, 10), 0.1) + 0.05 * np.eye(10)[(labels + 1) % 10]  # every image taken for the next class
    weak = find_label_issues({**scores, "probabilities": wrong}, class_names=list("abcdefghij"), split="training",
                             trained_on=True)
    assert weak["caveat"] == (f"{weak['flagged'] / 2000:.0%} of the labels suspected: they are that noisy, or the "
                              "model (right on 0% of these images) is too weak yet for this list to mean much; train "
                              "longer before reading it")


@pytest.mark.slow
def test_flipped_training_labels_are_the_most_suspect_and_the_report_opens_in_a_browser(tmp_path, fashion_subset):
    """40 of 2,001 Fashion-MNIST training labels changed to another class: most of them head the suspects."""
    data = tmp_path / "fashion"
    data.mkdir()
    rng = np.random.default_rng(0)
    flipped = rng.choice(2001, 40, replace=False)
    for name in ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        write_idx(data / name, read_idx(next(fashion_subset.glob(f"{name}*"))))
    labels = read_idx(fashion_subset / "train-labels-idx1-ubyte.gz").copy()
    labels[flipped] = (labels[flipped] + rng.integers(1, 10, 40)) % 10
    write_idx(data / "train-labels-idx1-ubyte", labels)

    output_dir = tmp_path / "run"
    result = launch_warm(REPO / "scripts" / "train_mnist.py", "--dataset", "fashion_mnist", "--data_dir", data,
                         "--output_dir", output_dir, "--epochs", 2, "--batch_size", 64)
    assert result.returncode == 0, result.output
    suspects = [int(row["index"]) for row in rows(output_dir / "label_issues.csv")]
    assert f"{len(suspects)} suspected wrong labels among the 2001 training images" in result.output  # each once
    caught = len(set(suspects[:40]) & set(flipped.tolist()))
    assert caught >= 12, caught  # of the 40 most suspect (21 and 24 for two draws); at chance 40 x 40 / 2001 = 0.8
    for row in rows(output_dir / "label_issues.csv")[:40]:  # the label given, as the training set holds it
        assert row["label"] == FASHION_MNIST_CLASSES[labels[int(row["index"])]]
    # every test image once in losses.csv, with its own label, across the two processes
    _, test = build_mnist(data, name="fashion_mnist")
    losses = rows(output_dir / "losses.csv")
    assert sorted(int(row["index"]) for row in losses) == list(range(1001))
    assert all(row["label"] == test.classes[test.labels[int(row["index"])]] for row in losses)
    assert [float(row["loss"]) for row in losses] == sorted((float(row["loss"]) for row in losses), reverse=True)
    assert_report_shows(output_dir / "report.html", classes=10, top_losses=SHOWN, label_issues=SHOWN)


@pytest.mark.slow
def test_the_digits_demos_report_opens_in_a_browser(digits_run):
    """scikit-learn's 8x8 digits, shown enlarged with square pixels: every image loads, all ten classes listed."""
    shown = assert_report_shows(digits_run / "report.html", classes=10, top_losses=SHOWN,
                                label_issues=min(SHOWN, len(rows(digits_run / "label_issues.csv"))))
    assert int(shown.body["data-images"]) > SHOWN + 2 * 10  # the highest-loss gallery, the plots, the class table
    assert (digits_run / "report.html").read_text().count(" class=tiny alt=") >= SHOWN  # enlarged with square pixels


@pytest.mark.parametrize("epochs", [3, 5, 8, 15, 30])
def test_the_curves_epoch_axes_show_whole_epochs(epochs):
    from common.reporting import curves_figure

    records = [{"epoch": e, "train_loss": 1 / e, "val_loss": 1.2 / e, "val_accuracy": 1 - 1 / (e + 1)}
               for e in range(1, epochs + 1)]
    figure = curves_figure(records)
    figure.canvas.draw()
    for ax in figure.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (epochs, ticks)


CJK_FONT = "/usr/share/fonts/truetype/wqy/wqy-microhei.ttc"  # Debian's fonts-wqy-microhei, which make test installs


def test_class_names_in_chinese_are_drawn_with_a_font_that_has_them_or_numbered_and_said(tmp_path, capsys,
                                                                                         monkeypatch):
    """matplotlib's own font has no Chinese: class folders named 玉米 were boxes in confusion_matrix.png. A font of
    the machine's that has them is used (matplotlib warns of every glyph it cannot draw: none now); without one the
    classes are numbered there, and the log says so and how to get one."""
    import warnings

    import matplotlib.font_manager

    from common.reporting import label_fonts, plot_confusion_matrix

    require(CJK_FONT, "apt-get install -y fonts-wqy-microhei (make test does)")
    names, matrix = ["Maize", "玉米", "猪殃殃"], np.arange(9).reshape(3, 3)
    assert label_fonts(["Maize", "Fat_Hen", "Ωmega"]) == (None, [])  # DejaVu Sans has them all: left as it is
    fonts, undrawn = label_fonts(names)
    assert fonts[0] == "DejaVu Sans" and "WenQuanYi Micro Hei" in fonts[1:] and undrawn == []

    def glyphs_missing(path):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plot_confusion_matrix(path, matrix, names)
        return [str(warning.message) for warning in caught if "missing from font" in str(warning.message)]

    assert glyphs_missing(tmp_path / "drawn.png") == [] and capsys.readouterr().out == ""
    monkeypatch.setattr(matplotlib.font_manager, "findSystemFonts", lambda *args, **kwargs: [])  # no such font
    assert glyphs_missing(tmp_path / "numbered.png") == []
    assert capsys.readouterr().out == (
        "warning: no font here draws the class names 玉米, 猪殃殃: numbered.png numbers them instead (class N, in the "
        "order of classification_report.txt); install one that has their characters (Debian, Ubuntu: apt-get install "
        "fonts-noto-cjk for Chinese, Japanese and Korean) to see the names there (report.html shows them as text)\n")
    assert (tmp_path / "drawn.png").read_bytes() != (tmp_path / "numbered.png").read_bytes()


def test_the_confusion_matrix_counts_as_scikit_learn_counts_it():
    from common.reporting import confusion_matrix as ours

    rng = np.random.default_rng(1)
    labels, predictions = rng.integers(0, 6, 500), rng.integers(0, 5, 500)  # class 5 never predicted
    labels[labels == 3] = 4  # class 3 never in the labels
    expected = confusion_matrix(labels, predictions, labels=list(range(7)))  # class 6 in neither
    assert np.array_equal(ours(labels, predictions, 7), expected)


def test_the_classification_report_is_scikit_learns_to_the_last_digit():
    """Ours (numpy: a run's end no longer imports scikit-learn) against scikit-learn's, text and dict, with classes
    absent from the labels, never predicted, in neither, long and short names, 2 to 30 classes."""
    import json

    from sklearn.metrics import classification_report as theirs

    from common.reporting import classification_report

    rng = np.random.default_rng(2)
    for trial in range(300):
        classes, n = int(rng.integers(2, 31)), int(rng.integers(1, 2000))
        labels = rng.integers(0, classes, n)
        predictions = np.where(rng.random(n) < rng.random(), labels, rng.integers(0, classes, n))
        if trial % 4 == 1:
            labels[labels == 0] = 1  # class 0 never in the labels
        if trial % 4 == 2:
            predictions[predictions == classes - 1] = 0  # the last class never predicted
        names = [("class " * int(rng.integers(0, 4)) + str(c))[:int(rng.integers(1, 20))] + str(c)
                 for c in range(classes)]
        kwargs = dict(labels=list(range(classes)), target_names=names, digits=4, zero_division=0)
        if trial % 50 == 3:
            predictions = (labels + 1) % classes  # none right: scikit-learn then prints its supports as floats
        text, report = classification_report(labels, predictions, names)
        expected = theirs(labels, predictions, **kwargs)
        if (predictions == labels).any():
            assert text == expected, trial
        else:  # none right: scikit-learn prints its supports as floats (12.0), ours as the counts they are
            assert [line.split() for line in text.splitlines()] == [
                [token[:-2] if token.endswith(".0") and token[:-2].isdigit() else token for token in line.split()]
                for line in expected.splitlines()], trial
        assert json.dumps(report) == json.dumps(theirs(labels, predictions, output_dict=True, **kwargs)), trial


def test_a_tta_that_loses_clearly_more_images_than_it_gains_is_warned_of():
    """Flipping digits makes other digits: the run and evaluate.py say so. A loss within chance (a sign test's 2
    sigma over the images the TTA changed) is not warned of: a TTA that is level with the plain model, as at 4
    epochs of CIFAR-10, loses a few images here and there."""
    from common.reporting import tta_warning

    def warned(gained, lost):
        return tta_warning({"tta": "flip", "accuracy": 0.9222, "accuracy_by_tta": {"none": 0.9644, "flip": 0.9222},
                            "tta_vs_plain": {"gained": gained, "lost": lost}})

    assert warned(3, 22) == ("warning: --tta flip lowered this model's accuracy to 92.22%, from 96.44% without it (it "
                             "turned 22 right answers wrong and 3 wrong ones right): these images do not keep their "
                             "class mirrored or shifted. Score them without --tta, and train without it (a run chooses "
                             "best/ on the accuracy with it)")
    assert warned(0, 5) and warned(20, 40)  # 5 > 2 sqrt(5); 20 > 2 sqrt(60)
    assert warned(0, 4) is None and warned(40, 42) is None and warned(22, 3) is None and warned(0, 0) is None
