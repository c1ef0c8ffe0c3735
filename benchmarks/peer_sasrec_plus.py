"""SASRec+'s reference PyTorch code, trained and scored on this project's Beauty target: the peer run.

    python -m benchmarks.peer_sasrec_plus --reference-dir REF/src --data-dir ../shared/datasets \\
        --max-epochs 20 --patience 3

The question: what does the reference implementation of SASRec+ (Klenitskiy & Vasilev, RecSys 2023,
"Turning Dross Into Gold Loss: is BERT4Rec really better than SASRec?"; antklen/sasrec-bert4rec-recsys23)
score on the target of ``configs/beauty-sasrec.yaml``, under the same caps as that config's row, so the
framework's figure can be set beside it like for like.

It runs in a PyTorch environment of its own, not the project's: nothing here imports TensorFlow or
``retrieval``, and torch is imported inside the functions that need it. The reference's modules are
imported from ``--reference-dir`` (its ``src/`` folder) and never copied: ``models.SASRec`` (the model),
``datasets.CausalLMDataset`` / ``CausalLMPredictionDataset`` / ``PaddingCollateFn`` (training windows,
validation and test inputs, padding), ``modules.SeqRec`` (Adam, the loss, and a cross-check of the
scoring) and ``preprocess.add_time_idx`` (the leave-one-out indices). Its ``run.py`` needs Hydra,
ClearML and PyTorch Lightning; this driver is its loop instead:

- split: ``run.prepare_data``'s conditions on ``add_time_idx`` (``time_idx_reversed`` 0 is the test
  item, 1 the validation item, >= 2 training), checked against ``leave_last_two`` here;
- training: ``CausalLMDataset(train, max_length=50)``, 128 sequences a step shuffled,
  ``SASRec(maxlen=200, hidden_units=64, num_blocks=2, num_heads=1, dropout_rate=0.1)``, Adam 1e-3 from
  ``SeqRec.configure_optimizers``; the loss is ``SeqRec.compute_loss`` (cross-entropy over every column
  of ``states @ item_emb.weight.T``, padding labels ignored) computed on the non-padded positions only,
  which is the same mean and gradient without the padded rows' logits (checked on a batch at the start,
  ``loss_check`` in the results);
- validation after each epoch on 10,000 random users (``np.random.choice`` as ``run.create_dataloaders``):
  the training window ending before the validation item, the training items filtered, NDCG@10 watched;
  the best epoch's weights kept (strict improvement, as Lightning's ``EarlyStopping`` and
  ``ModelCheckpoint``), training stopped after ``--patience`` epochs without one or at ``--max-epochs``;
- test: ``CausalLMPredictionDataset(train + validation)``, so the input ends with the validation item,
  full ranking, the user's training and validation items excluded. Two scorings: ``project`` ranks the
  catalogue of ``items.txt`` (this project's protocol); ``reference`` ranks every column of the
  reference's output, padding column 0 included, and excludes the padded history row as
  ``SeqRecBase.filter_seen_items`` does (so column 0 is excluded for every user shorter than the
  longest in their batch). ``reference_prediction_check`` compares both with the reference's own
  ``make_prediction`` top-10 on a batch.

The reference's ``models.py`` imports ``transformers`` (for BERT4Rec and GPT4Rec) and ``modules.py``
``pytorch_lightning``; where they are not installed the driver stands in placeholders (a plain
``torch.nn.Module`` with a no-op ``log`` for ``LightningModule``), which SASRec's path never calls.
The reference sets no seed; ``--seed`` seeds numpy and torch here.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import subprocess
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._harness import (
    RESULTS,
    command,
    data_dir,
    describe_machine,
    load_average,
    machine,
    markdown_table,
    write_report,
)

KS = (10, 20, 50, 100)


# -- data and metrics: plain numpy, no torch -------------------------------------------------------


def read_sequences(path: Path | str) -> dict[int, np.ndarray]:
    """Each line ``user item item ...`` (items in time order) -> {user: int64 items}.

    Raises ValueError naming the file and line for a non-integer field, a repeated user, or a user
    with fewer than 3 items (leave-two-out needs a test, a validation and a training item).
    """
    sequences: dict[int, np.ndarray] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            fields = line.split()
            if not fields:
                continue
            try:
                user, *items = (int(field) for field in fields)
            except ValueError:
                raise ValueError(f"{path}, line {number}: a field is not an integer id: {line.strip()!r}") from None
            if user in sequences:
                raise ValueError(f"{path}, line {number}: user {user} appears twice")
            if len(items) < 3:
                raise ValueError(
                    f"{path}, line {number}: user {user} has {len(items)} items; leave-two-out needs at least 3"
                )
            sequences[user] = np.asarray(items, dtype=np.int64)
    if not sequences:
        raise ValueError(f"{path}: no sequences")
    return sequences


def read_catalogue(path: Path | str) -> np.ndarray:
    """The item ids of ``items.txt`` (the first tab-separated column), as int64; ValueError names the line."""
    ids = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            field = line.split("\t")[0].strip()
            if not field:
                continue
            try:
                ids.append(int(field))
            except ValueError:
                raise ValueError(f"{path}, line {number}: item id {field!r} is not an integer") from None
    return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True)
class Split:
    """Leave-two-out: per user, the training items (in order), the validation item and the test item."""

    train: dict[int, np.ndarray]
    validation: dict[int, int]
    test: dict[int, int]


def leave_last_two(sequences: dict[int, np.ndarray]) -> Split:
    """Each user's last item is the test target, the one before it the validation target, the rest training."""
    return Split(
        train={user: items[:-2] for user, items in sequences.items()},
        validation={user: int(items[-2]) for user, items in sequences.items()},
        test={user: int(items[-1]) for user, items in sequences.items()},
    )


def target_ranks(
    scores: np.ndarray,
    targets: np.ndarray,
    excluded: Sequence[np.ndarray] | np.ndarray,
    candidates: np.ndarray | None = None,
) -> np.ndarray:
    """1-based rank of each row's target among that row's admissible columns.

    Args:
      scores: [batch_size, num_columns] float scores (column = item id).
      targets: [batch_size] int column of each row's target.
      excluded: per row, the int columns removed from its ranking (the user's seen items); a padded
        [batch_size, width] array is read as is, its padding value excluded too.
      candidates: optional [num_columns] bool, the columns that may be ranked at all (the catalogue);
        None ranks every column.

    Returns:
      [batch_size] int64: 1 + the number of admissible columns scoring strictly above the target (ties
      go to the target). A target that is itself excluded or no candidate cannot be recommended:
      its rank is num_columns + 1, a miss at every k.
    """
    scores = np.asarray(scores)
    targets = np.asarray(targets, dtype=np.int64)
    if scores.ndim != 2 or targets.shape != (scores.shape[0],):
        raise ValueError(f"target_ranks: scores {scores.shape} and targets {targets.shape} need [B, V] and [B]")
    if len(excluded) != scores.shape[0]:
        raise ValueError(f"target_ranks: {len(excluded)} excluded rows for {scores.shape[0]} score rows")
    if candidates is not None and np.asarray(candidates).shape != (scores.shape[1],):
        raise ValueError(f"target_ranks: candidates {np.asarray(candidates).shape} need [{scores.shape[1]}]")
    admissible = (
        np.ones(scores.shape, dtype=bool)
        if candidates is None
        else np.repeat(np.asarray(candidates, bool)[None], len(scores), 0)
    )
    for row, columns in enumerate(excluded):
        admissible[row, np.asarray(columns, dtype=np.int64)] = False
    rows = np.arange(len(scores))
    target_scores = scores[rows, targets]
    ranks = 1 + ((scores > target_scores[:, None]) & admissible).sum(axis=1)
    return np.where(admissible[rows, targets], ranks, scores.shape[1] + 1).astype(np.int64)


def data_counts(split: Split, max_length: int) -> dict[str, int]:
    """Training positions (each user's newest ``max_length + 1`` training items give that many minus one
    targets) and the test targets no model can rank from the clicks: items in no user's training items,
    and in no user's training or validation items."""
    training = set(np.concatenate(list(split.train.values())).tolist())
    seen = training | set(split.validation.values())
    return {
        "training_positions": int(sum(min(len(items), max_length + 1) - 1 for items in split.train.values())),
        "test_targets_unseen_in_training": sum(item not in training for item in split.test.values()),
        "test_targets_unseen_in_training_or_validation": sum(item not in seen for item in split.test.values()),
    }


def hit_rate_and_ndcg(ranks: np.ndarray, k: int) -> tuple[float, float]:
    """HR@k and NDCG@k of one target a user: the share of ranks <= k, and the mean of 1 / log2(rank + 1) there."""
    ranks = np.asarray(ranks)
    if k < 1 or ranks.size == 0:
        raise ValueError(f"hit_rate_and_ndcg: needs k >= 1 and ranks, got k={k}, {ranks.size} ranks")
    hit = ranks <= k
    return float(hit.mean()), float(np.where(hit, 1.0 / np.log2(ranks + 1.0), 0.0).mean())


def metrics_at(ranks: np.ndarray, ks: Sequence[int] = KS) -> dict[str, float]:
    """{"hr@k", "ndcg@k"} for each k."""
    out: dict[str, float] = {}
    for k in ks:
        out[f"hr@{k}"], out[f"ndcg@{k}"] = hit_rate_and_ndcg(ranks, k)
    return out


# -- the reference's modules ------------------------------------------------------------------------


def import_reference(reference_dir: Path) -> types.SimpleNamespace:
    """The reference's modules from its ``src/`` folder (given, or found under ``reference_dir``)."""
    import torch

    src = reference_dir / "src" if (reference_dir / "src" / "models.py").exists() else reference_dir
    if not (src / "models.py").exists():
        raise ValueError(f"--reference-dir {reference_dir}: no models.py there nor under src/")
    try:
        import transformers  # noqa: F401
    except ImportError:  # only BERT4Rec and GPT4Rec use it
        stand_in = types.ModuleType("transformers")
        for name in ("BertConfig", "BertModel", "GPT2Config", "GPT2Model"):
            setattr(stand_in, name, None)
        sys.modules["transformers"] = stand_in
    try:
        import pytorch_lightning  # noqa: F401
    except ImportError:  # the driver is the training loop; SeqRec only needs to be a module

        class LightningModule(torch.nn.Module):
            def log(self, *args: Any, **kwargs: Any) -> None:
                pass

        stand_in = types.ModuleType("pytorch_lightning")
        stand_in.LightningModule = LightningModule  # type: ignore[attr-defined]
        sys.modules["pytorch_lightning"] = stand_in
    # Each loaded from its file (none imports another), so the checkout never goes onto the import path.
    loaded = {name: _module_from_file(name, src / f"{name}.py") for name in ("datasets", "models", "modules",
                                                                              "preprocess")}
    return types.SimpleNamespace(**loaded, src=src)


def _module_from_file(name: str, path: Path) -> types.ModuleType:
    """The module in ``path``, executed and registered as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def reference_commit(reference_dir: Path, given: str | None) -> str | None:
    """``--reference-commit`` if given, else the checkout's HEAD (None where it is no git checkout)."""
    if given:
        return given
    try:
        done = subprocess.run(["git", "-C", str(reference_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def reference_frames(ref: types.SimpleNamespace, sequences: dict[int, np.ndarray], split: Split):
    """The interactions as the reference reads them, split by ``run.prepare_data``'s conditions; ValueError
    if they differ from ``split``."""
    import pandas as pd

    users = np.concatenate([np.full(len(items), user) for user, items in sequences.items()])
    data = pd.DataFrame({"user_id": users, "item_id": np.concatenate(list(sequences.values()))})
    data = ref.preprocess.add_time_idx(data, sort=False)
    train = data[data.time_idx_reversed >= 2]
    validation = data[data.time_idx_reversed == 1]
    validation_full = data[data.time_idx_reversed >= 1]
    test = data[data.time_idx_reversed == 0]
    theirs_train = train.groupby("user_id").item_id.agg(list).to_dict()
    if (
        dict(zip(test.user_id, test.item_id)) != split.test
        or dict(zip(validation.user_id, validation.item_id)) != split.validation
        or any(list(split.train[user]) != theirs_train.get(user, []) for user in split.train)
    ):
        raise ValueError("the reference's leave-one-out split differs from leave_last_two on this file")
    return train, validation_full, int(data.item_id.max())


# -- training and scoring -----------------------------------------------------------------------------


def _states_at_last(model, batch):
    """[B, d] state at each row's last non-padded position (right padding, as ``make_prediction`` reads it)."""
    import torch

    states = model(batch["input_ids"], batch["attention_mask"])
    last = (batch["input_ids"] != 0).sum(dim=1) - 1
    return states[torch.arange(len(last)), last]


def score_loader(model, loader, catalogue_mask: np.ndarray, targets: dict[int, int]) -> dict[str, np.ndarray]:
    """Ranks of each user's target: ``project`` (catalogue columns, seen items excluded) and ``reference``
    (every column, the padded history row excluded as ``filter_seen_items`` does)."""
    import torch

    project, reference = [], []
    model.eval()
    with torch.no_grad():
        for batch in loader:
            scores = (_states_at_last(model, batch) @ model.item_emb.weight.T).numpy()
            user_targets = np.array([targets[int(u)] for u in batch["user_id"]])
            history = batch["full_history"].numpy()
            seen = [row[row > 0] for row in history]
            project.append(target_ranks(scores, user_targets, seen, catalogue_mask))
            reference.append(target_ranks(scores, user_targets, history))
    return {"project": np.concatenate(project), "reference": np.concatenate(reference)}


def reference_prediction_check(
    seqrec, loader, ranks: np.ndarray, targets: dict[int, int], rows: int = 64
) -> dict[str, Any]:
    """Set the ``reference`` ranks of the first ``rows`` users beside the reference's own ``make_prediction``
    top-10 (its [B, T, V] logits are what keeps the check to a few rows)."""
    import torch

    batch = {key: value[:rows] for key, value in next(iter(loader)).items()}
    seqrec.model.add_head = True
    seqrec.predict_top_k = 10
    seqrec.eval()
    with torch.no_grad():
        preds, _ = seqrec.make_prediction(batch)
    seqrec.model.add_head = False
    theirs = []
    for user, pred in zip(batch["user_id"].tolist(), preds.numpy()):
        where = np.flatnonzero(pred == targets[user])
        theirs.append(int(where[0]) + 1 if where.size else 11)
    ours = np.minimum(ranks[: len(theirs)], 11)
    return {"users": len(theirs), "agree": int((np.asarray(theirs) == ours).sum())}


def loss_check(seqrec, batch, rows: int = 16) -> dict[str, float]:
    """``SeqRec.compute_loss`` on the full [B, T, V] logits against this driver's loss on the non-padded
    positions: values and the item table's gradient, dropout off, on the first ``rows`` sequences."""

    model = seqrec.model
    small = {key: value[:rows] for key, value in batch.items()}
    model.eval()
    model.add_head = True
    model.zero_grad()
    theirs = seqrec.compute_loss(model(small["input_ids"], small["attention_mask"]), small)
    theirs.backward()
    their_grad = model.item_emb.weight.grad.clone()
    model.add_head = False
    model.zero_grad()
    ours = position_loss(model, small)
    ours.backward()
    gap = (model.item_emb.weight.grad - their_grad).abs().max().item()
    model.zero_grad()
    model.train()
    return {"reference_loss": theirs.item(), "driver_loss": ours.item(), "max_abs_gradient_difference": gap}


def position_loss(model, batch):
    """Mean cross-entropy over the catalogue at each non-padded position (label != -100)."""
    import torch

    states = model(batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"]
    kept = labels != -100
    logits = states[kept] @ model.item_emb.weight.T
    return torch.nn.functional.cross_entropy(logits, labels[kept])


def train_step(model, optimizer, batch) -> float:
    """One Adam step on ``position_loss``; the loss before it."""
    loss = position_loss(model, batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(args.threads)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine_at_start = machine("torch", "numpy", "pandas", torch_threads=args.threads)

    ref = import_reference(args.reference_dir)
    beauty = args.data_dir / "beauty"
    sequences = read_sequences(beauty / "sequences.txt")
    catalogue = read_catalogue(beauty / "items.txt")
    split = leave_last_two(sequences)
    train, validation_full, item_count = reference_frames(ref, sequences, split)
    item_count = max(item_count, int(catalogue.max()))
    catalogue_mask = np.zeros(item_count + 1, dtype=bool)
    catalogue_mask[catalogue] = True
    print(f"{len(sequences)} users, {len(catalogue)} catalogue items, columns 0..{item_count}", flush=True)

    users = validation_full.user_id.unique()  # as run.create_dataloaders draws them
    if args.validation_users and args.validation_users < len(users):
        users = np.random.choice(users, size=args.validation_users, replace=False)
    collate = ref.datasets.PaddingCollateFn()
    train_loader = DataLoader(
        ref.datasets.CausalLMDataset(train, max_length=args.max_length, full_negative_sampling=False),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=0,
        collate_fn=collate,
    )
    validation_loader = DataLoader(
        ref.datasets.CausalLMPredictionDataset(
            validation_full[validation_full.user_id.isin(users)], max_length=args.max_length, validation_mode=True
        ),
        batch_size=args.test_batch_size,
        shuffle=False,
        num_workers=0,
        collate_fn=collate,
    )
    test_loader = DataLoader(
        ref.datasets.CausalLMPredictionDataset(validation_full, max_length=args.max_length),
        batch_size=args.test_batch_size,
        shuffle=False,
        num_workers=0,
        collate_fn=collate,
    )

    model = ref.models.SASRec(
        item_num=item_count,
        maxlen=200,
        hidden_units=args.hidden,
        num_blocks=2,
        num_heads=1,
        dropout_rate=args.dropout,
        add_head=False,
    )
    seqrec = ref.modules.SeqRec(model, lr=args.lr, predict_top_k=10, filter_seen=True)
    optimizer = seqrec.configure_optimizers()
    checked = loss_check(seqrec, next(iter(train_loader)))
    print(f"loss check: {checked}", flush=True)

    if args.time_steps:
        model.train()
        clock = time.perf_counter()
        for step, batch in enumerate(train_loader, start=1):
            train_step(model, optimizer, batch)
            if step == args.time_steps:
                break
        seconds = time.perf_counter() - clock
        per_step = seconds / args.time_steps
        print(
            f"{args.time_steps} steps in {seconds:.1f} s: {per_step:.3f} s a step, {len(train_loader)} steps an epoch "
            f"~ {per_step * len(train_loader):.0f} s; load {load_average()}",
            flush=True,
        )
        return {}

    history: list[dict[str, Any]] = []
    best = {"ndcg@10": -1.0, "epoch": 0, "state": None, "validation_ranks": None}
    stopped_by = "max_epochs"
    training_clock = time.perf_counter()
    for epoch in range(1, args.max_epochs + 1):
        epoch_clock = time.perf_counter()
        model.train()
        losses = []
        for step, batch in enumerate(train_loader, start=1):
            losses.append(train_step(model, optimizer, batch))
            if step % 50 == 0:
                print(f"  epoch {epoch} step {step}/{len(train_loader)} loss {np.mean(losses[-50:]):.4f}", flush=True)
        train_seconds = time.perf_counter() - epoch_clock
        ranks = score_loader(model, validation_loader, catalogue_mask, split.validation)["reference"]
        validation = metrics_at(ranks, (10,))
        row = {
            "epoch": epoch,
            "train_loss": float(np.mean(losses)),
            "val_ndcg@10": validation["ndcg@10"],
            "val_hr@10": validation["hr@10"],
            "train_seconds": train_seconds,
            "seconds": time.perf_counter() - epoch_clock,
            "load_average": load_average(),
        }
        history.append(row)
        print(
            f"epoch {epoch}: loss {row['train_loss']:.4f}, val NDCG@10 {row['val_ndcg@10']:.4f}, "
            f"HR@10 {row['val_hr@10']:.4f}, {row['seconds']:.0f} s, load {row['load_average']}",
            flush=True,
        )
        if row["val_ndcg@10"] > best["ndcg@10"]:
            best = {"ndcg@10": row["val_ndcg@10"], "epoch": epoch, "state": copy.deepcopy(model.state_dict()),
                    "validation_ranks": ranks}
        elif epoch - best["epoch"] >= args.patience:
            stopped_by = "patience"
            break
        elapsed = time.perf_counter() - training_clock
        if args.time_budget_s and elapsed + row["seconds"] > args.time_budget_s and epoch < args.max_epochs:
            stopped_by = "time_budget"
            break
    training_seconds = time.perf_counter() - training_clock
    model.load_state_dict(best["state"])

    test_clock = time.perf_counter()
    ranks = score_loader(model, test_loader, catalogue_mask, split.test)
    test_seconds = time.perf_counter() - test_clock
    check = {
        # The kept weights' validation ranks, from the epoch that chose them (eval mode: the same scores).
        "validation": reference_prediction_check(
            seqrec, validation_loader, best["validation_ranks"], split.validation
        ),
        "test": reference_prediction_check(seqrec, test_loader, ranks["reference"], split.test),
    }
    finished_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "question": "SASRec+'s reference code on configs/beauty-sasrec.yaml's target",
        "command": args.command,
        "reference": {
            "repository": "antklen/sasrec-bert4rec-recsys23",
            "commit": reference_commit(args.reference_dir, args.reference_commit),
        },
        "settings": {
            "max_length": args.max_length,
            "hidden_units": args.hidden,
            "num_blocks": 2,
            "num_heads": 1,
            "dropout_rate": args.dropout,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "validation_users": len(users),
            "max_epochs": args.max_epochs,
            "patience": args.patience,
            "time_budget_s": args.time_budget_s,
            "seed": args.seed,
            "threads": args.threads,
        },
        "data": {
            "users": len(sequences),
            "catalogue_items": len(catalogue),
            "columns": item_count + 1,
            **data_counts(split, args.max_length),
        },
        "loss_check": checked,
        "epochs": len(history),
        "best_epoch": best["epoch"],
        "stopped_by": stopped_by,
        "history": history,
        "training_seconds": training_seconds,
        "seconds_per_epoch": training_seconds / len(history),
        "test_seconds": test_seconds,
        "test": {"project": metrics_at(ranks["project"]), "reference": metrics_at(ranks["reference"])},
        "test_users": int(len(ranks["project"])),
        "reference_prediction_check": check,
        "started_at": started_at,
        "finished_at": finished_at,
        "machine": machine_at_start,
        "load_average_at_start": machine_at_start["load_average"],
        "load_average_at_end": load_average(),
    }


def markdown(report: dict[str, Any]) -> str:
    project, reference = report["test"]["project"], report["test"]["reference"]
    lines = [
        "# SASRec+'s reference code on this project's Beauty target",
        "",
        f"`{report['command']}`",
        "",
        f"Reference: {report['reference']['repository']} at {report['reference']['commit']}. "
        f"{report['epochs']} epochs (stopped by {report['stopped_by']}), best epoch {report['best_epoch']}; "
        f"training {report['training_seconds']:.0f} s, {report['seconds_per_epoch']:.0f} s an epoch with its "
        f"validation; load average {report['load_average_at_start']} at the start, "
        f"{report['load_average_at_end']} at the end. {describe_machine(report['machine'])}.",
        "",
        "Test, full ranking, the user's training and validation items excluded, the input ending with the "
        f"validation item ({report['test_users']} users):",
        "",
        *markdown_table(
            ["scoring", "HR@10", "NDCG@10", "HR@20", "NDCG@20", "HR@100", "NDCG@100"],
            [
                [name, *(f"{m[key]:.4f}" for key in ("hr@10", "ndcg@10", "hr@20", "ndcg@20", "hr@100", "ndcg@100"))]
                for name, m in (("project (the catalogue)", project), ("reference (every column)", reference))
            ],
            "lrrrrrr",
        ),
        "",
        f"Validation ({report['settings']['validation_users']:,} users) after each epoch:",
        "",
        *markdown_table(
            ["epoch", "loss", "NDCG@10", "HR@10", "seconds", "load"],
            [
                [
                    r["epoch"],
                    f"{r['train_loss']:.4f}",
                    f"{r['val_ndcg@10']:.4f}",
                    f"{r['val_hr@10']:.4f}",
                    f"{r['seconds']:.0f}",
                    r["load_average"][0],
                ]
                for r in report["history"]
            ],
            "rrrrrr",
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reference-dir", type=Path, required=True, help="the reference's checkout or its src/ folder")
    parser.add_argument("--reference-commit", help="recorded as the reference's commit (default: the checkout's HEAD)")
    parser.add_argument(
        "--data-dir", type=Path, default=data_dir(), help="holds beauty/sequences.txt and items.txt"
    )
    parser.add_argument("--max-epochs", type=int, default=20, help="the reference: 100")
    parser.add_argument("--patience", type=int, default=3, help="the reference: 10")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=0.0,
        help="stop before an epoch that would end past this many training seconds (0: none)",
    )
    parser.add_argument("--time-steps", type=int, default=0, help="only time this many training steps, write nothing")
    parser.add_argument("--max-length", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--test-batch-size", type=int, default=256)
    parser.add_argument("--validation-users", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "peer_sasrec_plus", help="results stem (.json and .md)")
    args = parser.parse_args(argv)
    for name in ("max_epochs", "patience", "batch_size", "test_batch_size", "max_length", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.command = command("peer_sasrec_plus", argv)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    if report:
        write_report(args.out, report, markdown(report))
        print(f"wrote {args.out}.json and .md: test {report['test']}", flush=True)


if __name__ == "__main__":
    main()
