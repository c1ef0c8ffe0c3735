"""The training progress lines: a run ETA only where the run's length is known."""

from types import SimpleNamespace

from retrieval.training.checkpoints import TrainingState
from retrieval.training.loop import _Progress


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _lines(monkeypatch, eta_bound):
    clock = _Clock()
    monkeypatch.setattr("retrieval.training.loop.time.perf_counter", clock)
    said = []
    source = SimpleNamespace(steps_per_epoch=10, batch_size=100)
    progress = _Progress(1, source, 30, TrainingState(), say=said.append, eta_bound=eta_bound)
    state = TrainingState()
    for batch in range(1, 11):  # one epoch of 10 steps, 1 s a step
        clock.now += 1.0
        state.batch = batch
        if batch == 9:
            clock.now += _Progress.EVERY_SECONDS  # a step line after the 9th step
        progress.step(state, 0)
    progress.epoch(0, {"loss": 1.0}, {"epoch_seconds": 10.0 + _Progress.EVERY_SECONDS, "clicks_per_second": 50.0})
    return said


def test_with_early_stopping_no_run_eta_is_claimed_only_the_epochs_end(monkeypatch):
    step, epoch = _lines(monkeypatch, eta_bound=True)
    # 9 steps in 24 s: the one step left in the epoch takes 24/9 s, not 291 steps of the 30-epoch bound.
    assert step.endswith("epoch ETA 0m02s") and "at most" not in step
    assert epoch == "epoch 1/30: 25s, 50 clicks/s, loss 1.0000"


def test_without_early_stopping_the_run_eta_counts_every_epoch_left(monkeypatch):
    step, epoch = _lines(monkeypatch, eta_bound=False)
    assert step.endswith(", ETA 12m56s")  # 291 steps at 24/9 s each
    assert epoch.endswith(", ETA 12m05s")  # 290 steps at 25/10 s each


def test_the_data_line_before_evaluation_leaves_the_evaluated_users_out(caplog):
    import json
    import logging

    from retrieval.config import load_config
    from retrieval.jobs import read_and_split

    config = load_config(None, ["data.synthetic.n_users=120", "data.synthetic.n_items=60"])
    with caplog.at_level(logging.INFO, logger="retrieval"):
        data = read_and_split(config)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    logged = json.loads(line.removeprefix("data: "))
    assert "evaluated_users" not in logged and logged["train_clicks"] > 0
    assert data.summary(17)["evaluated_users"] == 17  # the run's metrics hold it once evaluated
    assert {**logged, "evaluated_users": 17} == data.summary(17)
