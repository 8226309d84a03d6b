"""Evaluation on every process, each sample counted exactly once."""

import torch
import torch.nn.functional as F
from accelerate.utils import broadcast
from torch.nn.parallel import DistributedDataParallel


@torch.inference_mode()
def evaluate(model, eval_dataloader, accelerator, *, transform):
    """Evaluate on every rank; `gather_for_metrics` per batch counts each sample exactly once.

    Returns loss (plain cross entropy), accuracy, samples, and the gathered predictions,
    probabilities and labels (numpy, in dataset order for an unshuffled loader).
    """
    model.eval()
    _as_on_the_main_process(model, accelerator)
    losses, probabilities, labels = [], [], []
    for batch in eval_dataloader:
        logits = model(transform(batch["image"])).float()
        loss = F.cross_entropy(logits, batch["label"], reduction="none")
        # gather per batch: gather_for_metrics drops the duplicated padding samples, which exist only
        # in the last batch, and only knows to do so while iterating that batch
        loss, probs, label = accelerator.gather_for_metrics((loss, logits.softmax(1), batch["label"]))
        losses.append(loss.cpu())
        probabilities.append(probs.cpu())
        labels.append(label.cpu())
    losses, probabilities, labels = torch.cat(losses), torch.cat(probabilities), torch.cat(labels)
    predictions = probabilities.argmax(1)
    from sklearn.metrics import f1_score  # imported here: a run needs scikit-learn only once it evaluates

    return {
        "loss": losses.mean().item(),
        "accuracy": (predictions == labels).float().mean().item(),
        "macro_f1": f1_score(labels, predictions, average="macro", labels=range(probabilities.shape[1]),
                             zero_division=0),
        "samples": len(labels),
        "predictions": predictions.numpy(),
        "probabilities": probabilities.numpy(),
        "labels": labels.numpy(),
    }


def _as_on_the_main_process(model, accelerator):
    """A module outside DDP, such as an EMA of the weights, drifts apart between processes: each averages the
    BatchNorm statistics of its own batches. Every process then evaluates the main process's copy, the one
    that checkpoints and best/ keep. (DDP broadcasts its buffers itself at every forward.)"""
    if accelerator.num_processes > 1 and not isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel):
        broadcast([tensor for tensor in model.state_dict().values()], from_process=0)
