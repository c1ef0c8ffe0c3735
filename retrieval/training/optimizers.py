"""Optimizers by config name, with Adam's lazy variant for embedding tables."""

from __future__ import annotations

import tensorflow as tf

from retrieval.config import TrainConfig


class LazyAdam(tf.keras.optimizers.Adam):
    """Adam that, for a sparse gradient, updates only the rows it touches (moments and weights).

    Keras Adam applies the moment decay to the whole table at every step (its
    docstring says so), which costs a pass over every row of a 1M-item
    embedding per step whatever the batch. This is the "lazy" variant of
    TensorFlow Addons' ``LazyAdam`` (and of TF1's ``LazyAdamOptimizer``): rows
    absent from the batch keep their moments and weights. Dense gradients get
    plain Adam. Duplicate indices are summed by the base optimizer
    (``_deduplicate_sparse_grad``) before ``update_step``.
    """

    def update_step(self, gradient, variable):
        if not isinstance(gradient, tf.IndexedSlices) or self.amsgrad:
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        alpha = tf.cast(self.learning_rate, dtype) * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        rows, values = gradient.indices, gradient.values
        m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
        v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        variable.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + self.epsilon), rows))


# Which apply sparse (IndexedSlices) gradients of embedding tables sparsely, i.e. at a cost that
# does not grow with the number of rows: adagrad and lazy_adam do; adam decays both moments of
# every row at every step, and tf-keras sgd always keeps a momentum slot that it scales and adds
# to the whole table (even with momentum 0).
OPTIMIZERS = {
    "adam": tf.keras.optimizers.Adam,
    "adagrad": tf.keras.optimizers.Adagrad,
    "sgd": tf.keras.optimizers.SGD,
    "lazy_adam": LazyAdam,
}


def make_optimizer(config: TrainConfig) -> tf.keras.optimizers.Optimizer:
    """A new optimizer of ``config.optimizer`` at ``config.learning_rate``."""
    return OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate)
