"""The mistakes of a model on a labelled set, in one report a person opens: the images it gets most wrong, the class
pairs it confuses, each class's recall and worst images, and the images whose given label it finds least likely.

`write_mistakes_report` writes, into a run's folder (or scripts/evaluate.py's): report.html (self-contained: the
thumbnails, curves and confusion matrix embedded, no network), mistakes.json (what the report shows), losses.csv
(every evaluated image, highest loss first) and label_issues.csv (the suspected wrong labels, most suspect first).
Suspected wrong labels are confident learning (Northcutt et al. 2021) as cleanlab's `find_label_issues` does it by
default: an image is flagged when the model's probability for another class is above that class's average
self-confidence, as many per pair of classes as the calibrated confident joint counts. Written out here in numpy, the
same steps and results (tests/test_report.py holds it to cleanlab's): importing cleanlab imports scikit-learn, a
second at the end of every run.
"""

import base64
import csv
import html
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from .images import read_image
from .outputs import write_atomically

MISTAKES_FILES = ("report.html", "mistakes.json", "losses.csv", "label_issues.csv")
SHOWN = 24  # images in the highest-loss and suspected-label galleries
EXAMPLES = 4  # images per confused pair and per class
PAIRS = 10  # confused pairs shown
CLASSES_WITH_IMAGES = 30  # the classes of lowest recall that get example images (all are in the table)
THUMBNAIL = 128  # longest side, pixels; smaller images are kept as they are and shown enlarged
TOO_MANY_SUSPECTS = 1 / 3  # beyond this share of the images flagged, the list may say more of the model than the labels


# ---- what the report holds ----

def find_mistakes(evaluation, *, class_names, files=None):
    """The highest-loss images, the most confused (true, predicted) pairs and each class's recall and worst images
    of an `evaluate` result; every image as a dict (index, file, label, prediction, probabilities, loss)."""
    probs, labels = evaluation["probabilities"], evaluation["labels"]
    predictions = probs.argmax(1)
    loss = -np.log(np.clip(probs[np.arange(len(labels)), labels], 1e-12, None))
    worst = np.argsort(-loss, kind="stable")  # every row below keeps this order: highest loss first

    def image(row):
        return _image(row, evaluation, class_names, files, loss=float(loss[row]))

    matrix = np.zeros((len(class_names),) * 2, dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    off_diagonal = matrix * (1 - np.eye(len(class_names), dtype=np.int64))
    largest = np.argsort(-off_diagonal, axis=None, kind="stable")[:PAIRS]
    pairs = [divmod(int(flat), len(class_names)) for flat in largest]
    confused = [{"label": class_names[true], "prediction": class_names[taken], "count": int(matrix[true, taken]),
                 "examples": [image(row) for row in worst[(labels[worst] == true)
                                                          & (predictions[worst] == taken)][:EXAMPLES]]}
                for true, taken in pairs if matrix[true, taken]]
    per_class = []
    for c, name in enumerate(class_names):
        images, predicted = int(matrix[c].sum()), int(matrix[:, c].sum())
        if images == 0:
            continue  # a class the set does not hold (evaluate.py on a subset of the model's classes)
        recall, precision = matrix[c, c] / images, matrix[c, c] / max(predicted, 1)
        per_class.append({"class": name, "images": images, "recall": float(recall), "precision": float(precision),
                          "f1": float(2 * recall * precision / max(recall + precision, 1e-12)),
                          "taken_for": (class_names[int(off_diagonal[c].argmax())] if off_diagonal[c].any() else None),
                          "worst": [image(row) for row in worst[labels[worst] == c][:EXAMPLES]]})
    per_class.sort(key=lambda entry: (entry["recall"], entry["class"]))  # the weakest first
    for entry in per_class[CLASSES_WITH_IMAGES:]:
        entry["worst"] = []
    return {"images": len(labels), "accuracy": float((predictions == labels).mean()), "loss": float(loss.mean()),
            "macro_f1": evaluation["macro_f1"],
            "top_losses": [image(row) for row in worst[:SHOWN]], "confused_pairs": confused, "per_class": per_class,
            "losses": [image(row) for row in worst]}


def find_label_issues(scores, *, class_names, files=None, split, trained_on):
    """The images of `scores` (an `evaluate` result) whose given label the model finds least likely, most suspect
    first, by confident learning; `split` names the images in the report, `trained_on` whether the model trained on
    them (then a wrong label it learned to repeat is not found: the report says so)."""
    probs, labels = scores["probabilities"], scores["labels"]
    found = {"split": split, "scored": len(labels), "accuracy": float((probs.argmax(1) == labels).mean())}
    if len(np.unique(labels)) < 2:
        return {**found, "flagged": 0, "images": [],
                "not_computed": "these images are all of one class, and confident learning compares classes"}
    flagged = [_image(row, scores, class_names, files) for row in confident_learning(labels, probs)]
    method = ("They were scored by the final model without augmentation; it trained on them, so a wrong label it has "
              "learned to repeat is not found (few are in a short run: a network learns the clean majority first)."
              if trained_on else "The model did not train on them: its probabilities are out-of-sample.")
    found |= {"flagged": len(flagged), "method": method, "images": flagged}
    if len(flagged) > TOO_MANY_SUSPECTS * len(labels):  # a short or failed run: most of its errors are flagged
        found["caveat"] = (f"{len(flagged) / len(labels):.0%} of the labels suspected: they are that noisy, or the "
                           f"model (right on {found['accuracy']:.0%} of these images) is too weak yet for this list "
                           "to mean much; train longer before reading it")
    return found


def confident_learning(labels, probs):
    """The rows whose given label (`labels`, N) is likely wrong under `probs` (N x classes), most suspect (lowest
    probability of the given label) first: cleanlab's `find_label_issues(labels, probs,
    return_indices_ranked_by="self_confidence")`, its defaults (prune by noise rate), step for step."""
    n, k = probs.shape
    counts = np.bincount(labels, minlength=k)
    # each class's threshold: its images' mean probability for it (2, above any, for a class with no image)
    thresholds = np.clip([np.mean(probs[:, c][labels == c]) if counts[c] else 2 for c in range(k)], 2e-6, None)
    # the confident joint, rows the given label and columns the true one guessed: a row's class where one
    # probability is above its threshold, the most probable where several are, uncounted where none
    above = probs >= thresholds - 1e-6
    classes_above = above.sum(axis=1)
    confident = classes_above > 0
    guess = np.where(classes_above > 1, probs.argmax(axis=1), above.argmax(axis=1))
    # (counted true-label first and transposed, as cleanlab does: its sums below then add in the same order, and
    # calibrated counts that end in .5 round alike)
    joint = np.bincount(guess[confident] * k + labels[confident], minlength=k * k).reshape(k, k).T
    np.fill_diagonal(joint, joint.diagonal().clip(min=1))
    # calibrated: each row sums to its label's count, the whole to N
    joint = (joint.T / np.clip(joint.sum(axis=1), 1e-100, None) * counts).T
    joint = np.apply_along_axis(_round_keeping_sum, 1, joint / np.clip(joint.sum(), 1e-100, None) * counts.sum())
    # how many of each label to flag as each other class: at least one image of a class kept
    prune = joint.T.astype(float)
    kept = np.maximum(prune.diagonal(), 1)
    prune -= (kept - prune.diagonal()) / np.maximum(np.count_nonzero(prune, axis=0) - 1.0, 1.0)
    prune[prune < 0] = 0
    np.fill_diagonal(prune, kept)
    prune = prune.astype(int)
    # within each label, the images with the largest margin of the other class over the given one
    flagged = np.zeros(n, dtype=bool)
    for given in range(k):
        if counts[given] <= 1:
            continue
        rows = labels == given
        class_probs, class_flagged = probs[rows], np.zeros(counts[given], dtype=bool)
        for other in range(k):
            if other != given and prune[other, given] > 0:
                margin = class_probs[:, other] - class_probs[:, given]
                class_flagged[np.argsort(-margin)[:prune[other, given]]] = True
        flagged[rows] = class_flagged
    # never an image the model predicts its given label for
    nudged = probs.copy()
    nudged[np.arange(n), labels] += 1e-6
    flagged[nudged.argmax(axis=1) == labels] = False
    rows = np.arange(n)[flagged]
    return rows[np.argsort(probs[np.arange(n), labels][flagged])]


def _round_keeping_sum(values):
    """`values` rounded to integers that keep their sum (rounded), the largest remainders rounded up."""
    floats = np.asarray(values, dtype=float)
    ints, total = floats.round(), floats.sum().round()
    while abs(ints.sum().round() - total) > 1e-6:
        step = -1 if total - ints.sum().round() < 0 else 1
        changes = min(int(abs(np.round(total - ints.sum().round()))), len(floats))
        ints[np.argsort(floats - ints)[::-step][:changes]] += step
    return ints.astype(int)


def _image(row, scores, class_names, files, loss=None):
    """Row `row` of `scores` (an `evaluate` result) as the report shows an image."""
    probs, labels, indices = scores["probabilities"], scores["labels"], scores["indices"]
    label, prediction = int(labels[row]), int(probs[row].argmax())
    index = int(indices[row])
    return {"index": index, **({"file": str(files[index])} if files is not None else {}),
            "label": class_names[label], "prediction": class_names[prediction],
            "probability": float(probs[row, prediction]), "label_probability": float(probs[row, label]),
            **({"loss": loss} if loss is not None else {})}


# ---- the files ----

def write_mistakes_report(output_dir, *, evaluation, dataset, about, label_issues=None, training_set=None):
    """report.html, mistakes.json, losses.csv and label_issues.csv for an `evaluate` result on `dataset` (its labels
    numbered as its `classes`), headed by `about`: {"title", "arguments" (the model's training run's, or None)};
    `label_issues` from `find_label_issues`, on `training_set` when those are training images. Main process."""
    output_dir = Path(output_dir)
    files = getattr(dataset, "files", None)
    mistakes = find_mistakes(evaluation, class_names=dataset.classes, files=files)
    losses = mistakes.pop("losses")
    write_csv(output_dir / "losses.csv", losses)
    if label_issues is not None:
        write_csv(output_dir / "label_issues.csv", label_issues["images"])
        label_issues = {**label_issues, "images": label_issues["images"][:SHOWN]}
    else:
        (output_dir / "label_issues.csv").unlink(missing_ok=True)  # an earlier evaluation's, not of this model
    summary = {"title": about["title"], "arguments": about.get("arguments"), **mistakes, "label_issues": label_issues}
    write_atomically(output_dir / "mistakes.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1)))
    page = render_report(summary, dataset=dataset, training_set=training_set or dataset, output_dir=output_dir)
    write_atomically(output_dir / "report.html", lambda tmp: tmp.write_text(page))
    return output_dir / "report.html"


def write_csv(path, images):
    columns = list(images[0]) if images else ["index", "label", "prediction", "probability", "label_probability"]

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows({key: f"{value:.6g}" if isinstance(value, float) else value
                              for key, value in image.items()} for image in images)

    write_atomically(path, write)


# ---- the page ----

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; padding: 0 1em; color: #222 }
h1 { font-size: 1.5em } h2 { margin-top: 2em; border-bottom: 1px solid #ccc }
.headline { font-size: 1.15em } .note { color: #666 } .missing { color: #b00; font-weight: bold }
nav a { margin-right: 1em }
.plots img { max-width: 100%; height: auto; vertical-align: top }
.gallery { display: flex; flex-wrap: wrap; gap: 8px }
figure { margin: 0; width: 140px; font-size: 12px; overflow-wrap: anywhere }
figure img { width: 128px; height: 128px; object-fit: contain; background: #eee; image-rendering: auto }
figure img.tiny { image-rendering: pixelated }
.bad { color: #b00 } .good { color: #070 }
table { border-collapse: collapse } td, th { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left }
td.number { text-align: right } td .gallery figure { width: 72px } td .gallery img { width: 64px; height: 64px }
"""

# the page counts the images the browser could show, says so when one is missing, and leaves the counts on <body>
CHECK_IMAGES = """
addEventListener("load", () => {
  const images = [...document.images], shown = images.filter(image => image.complete && image.naturalWidth > 0);
  document.body.dataset.images = images.length;
  document.body.dataset.imagesShown = shown.length;
  if (shown.length < images.length)
    document.getElementById("missing").textContent = `${images.length - shown.length} images could not be shown`;
});
"""


def render_report(summary, *, dataset, training_set, output_dir):
    thumbnails = {}

    def gallery(images, *, source=dataset, caption=True):
        figures = []
        for image in images:
            key = (id(source), image["index"])
            if key not in thumbnails:
                thumbnails[key] = thumbnail(source, image["index"])
            uri, tiny = thumbnails[key]
            name = Path(image["file"]).name if "file" in image else f"#{image['index']}"
            right = "good" if image["prediction"] == image["label"] else "bad"
            text = (f"<b>{_e(image['label'])}</b> &rarr; <span class={right}>{_e(image['prediction'])}</span> "
                    f"{image['probability']:.2f}<br>p(given) {image['label_probability']:.3f}<br>"
                    f"<span class=note>{_e(name)}</span>") if caption else ""
            figures.append(f"<figure title=\"{_e(image.get('file', name))}\"><img src=\"{uri}\""
                           f"{' class=tiny' if tiny else ''} alt=\"{_e(name)}\">"
                           f"<figcaption>{text}</figcaption></figure>")
        return f"<div class=gallery>{''.join(figures)}</div>"

    s = summary
    parts = [f"<h1>{_e(s['title'])}</h1>",
             f"<p class=headline>{s['images']:,} images &middot; accuracy <b>{100 * s['accuracy']:.2f}%</b> &middot; "
             f"macro-F1 {s['macro_f1']:.4f} &middot; loss {s['loss']:.4f}</p><p id=missing class=missing></p>",
             "<nav><a href=#classes>classes</a><a href=#confused>confused pairs</a><a href=#top-losses>highest "
             "loss</a><a href=#label-issues>suspected wrong labels</a><a href=#arguments>arguments</a>"
             "<a href=#files>files</a></nav>"]
    plots = [f"<img src=\"{_data_uri((output_dir / name).read_bytes(), 'image/png')}\" alt=\"{name}\">"
             for name in ("curves.png", "confusion_matrix.png") if (output_dir / name).is_file()]
    parts.append(f"<section id=plots class=plots>{''.join(plots)}</section>")

    rows = "".join(f"<tr><td>{_e(c['class'])}</td><td class=number>{c['images']}</td><td class=number>"
                   f"{100 * c['recall']:.1f}%</td><td class=number>{100 * c['precision']:.1f}%</td><td class=number>"
                   f"{c['f1']:.3f}</td><td>{_e(c['taken_for'] or '')}</td>"
                   f"<td>{gallery(c['worst'], caption=False)}</td></tr>"
                   for c in s["per_class"])
    parts.append("<section id=classes><h2>Classes, lowest recall first</h2><table><tr><th>class</th><th>images</th>"
                 "<th>recall</th><th>precision</th><th>F1</th><th>most often taken for</th><th>its highest-loss images"
                 f"</th></tr>{rows}</table></section>")

    pairs = "".join(f"<h3>{_e(p['label'])} taken for {_e(p['prediction'])}: {p['count']} image(s)</h3>"
                    f"{gallery(p['examples'])}" for p in s["confused_pairs"])
    parts.append(f"<section id=confused><h2>Most confused pairs (true &rarr; predicted)</h2>"
                 f"{pairs or '<p>none: every image is right</p>'}</section>")
    parts.append(f"<section id=top-losses><h2>Highest loss</h2><p class=note>the {len(s['top_losses'])} images "
                 "the model finds least likely to be of their given class; every image is in losses.csv</p>"
                 f"{gallery(s['top_losses'])}</section>")

    issues = s["label_issues"]
    if issues is None:
        body = "<p>not computed (<code>--no-find_label_issues</code>)</p>"
    elif "not_computed" in issues:
        body = f"<p>not computed: {_e(issues['not_computed'])}</p>"
    else:
        body = (f"<p class=note>{issues['flagged']:,} of the {issues['scored']:,} {_e(issues['split'])} images are "
                f"flagged by confident learning (as cleanlab finds them); the model is right on "
                f"{100 * issues['accuracy']:.1f}% of them. {_e(issues['method'])} The {len(issues['images'])} most "
                "suspect are shown, given label &rarr; the model's class; all are in label_issues.csv.</p>"
                + (f"<p class=note><b>{_e(issues['caveat'])}</b></p>" if "caveat" in issues else "")
                + gallery(issues["images"], source=training_set))
    parts.append(f"<section id=label-issues><h2>Suspected wrong labels</h2>{body}</section>")

    argument_rows = "".join(f"<tr><td>{_e(name)}</td><td><code>{_e(json.dumps(value))}</code></td></tr>"
                            for name, value in sorted((summary["arguments"] or {}).items()))
    parts.append(f"<section id=arguments><h2>Arguments</h2><table>{argument_rows}</table></section>")
    links = [name for name in ("mistakes.json", "losses.csv", "label_issues.csv", "classification_report.txt",
                               "classification_report.json", "metrics.jsonl", "predictions.csv")
             if (output_dir / name).is_file()]
    parts.append("<section id=files><h2>Files beside this report</h2><p>"
                 + " &middot; ".join(f"<a href=\"{name}\">{name}</a>" for name in links) + "</p></section>")
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(s['title'])}</title>"
            f"<style>{STYLE}</style><script>{CHECK_IMAGES}</script></head><body>{''.join(parts)}</body></html>\n")


def thumbnail(dataset, index):
    """(data URI, tiny) of sample `index`: its file as it is (or, without one, the image the dataset holds), photos
    as JPEG of at most THUMBNAIL pixels a side, images of 64 pixels or less as PNG at their size; the page enlarges
    them, tiny ones (32 pixels or less: digits, CIFAR) with square pixels rather than a blur. A file that cannot be
    read any more gets an empty URI, which the page counts as not shown."""
    if getattr(dataset, "files", None) is not None:
        try:
            image = read_image(dataset.files[index])
        except (OSError, ValueError):
            return "", False
    else:
        array = dataset.image(index).permute(1, 2, 0).numpy()
        image = Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)
    lossless = max(image.size) <= 64
    if not lossless:
        image = image.copy()
        image.thumbnail((THUMBNAIL, THUMBNAIL), Image.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG" if lossless else "JPEG", quality=85)
    return _data_uri(buffer.getvalue(), "image/png" if lossless else "image/jpeg"), max(image.size) <= 32


def _data_uri(data, mime):
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _e(text):
    return html.escape(str(text))
