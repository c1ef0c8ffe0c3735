"""train.adam_epsilon: the epsilon of Adam's step, against Adam's update written in numpy."""

import numpy as np
import pytest
import tensorflow as tf

import retrieval  # noqa: F401
from retrieval.config import ConfigError, TrainConfig, load_config
from retrieval.training import make_optimizer


def _numpy_adam(gradients, lr, epsilon, beta_1=0.9, beta_2=0.999):
    """tf-keras Adam: ``w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)``."""
    w, m, v = 0.0, 0.0, 0.0
    for t, g in enumerate(gradients, start=1):
        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g * g
        w -= lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t) * m / (np.sqrt(v) + epsilon)
    return w


@pytest.mark.parametrize("optimizer", ["adam", "lazy_adam"])
def test_adam_steps_with_the_configured_epsilon(optimizer):
    # Gradients of 1e-7: the size of an unclicked item's full-softmax gradient, where epsilon 1e-7
    # halves the step that 1e-8 takes.
    gradients = [1e-7, 2e-7, 5e-8]
    steps = {}
    for epsilon in (1e-8, 1e-7):
        variable = tf.Variable(np.zeros(1, np.float64))
        adam = make_optimizer(TrainConfig(optimizer=optimizer, learning_rate=0.001, adam_epsilon=epsilon))
        for g in gradients:
            adam.apply_gradients([(tf.constant([g], tf.float64), variable)])
        steps[epsilon] = float(variable.numpy()[0])
        # float32 hyper-parameters: equal to a relative 1e-4
        assert steps[epsilon] == pytest.approx(_numpy_adam(gradients, 0.001, epsilon), rel=1e-4)
    assert abs(steps[1e-8]) > 1.5 * abs(steps[1e-7])
    assert TrainConfig().adam_epsilon == 1e-7  # tf-keras' default stays the default
    with pytest.raises(ConfigError, match="adam_epsilon"):
        load_config(None, ["train.adam_epsilon=0"])
