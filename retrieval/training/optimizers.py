"""Optimizers by config name, with Adam's lazy variant and a row-wise Adagrad for embedding tables."""

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


class RowWiseAdagrad(tf.keras.optimizers.Optimizer):
    """Adagrad with one accumulator per embedding-table row: DLRM's and FBGEMM's row-wise Adagrad.

    Adam keeps two slots the size of each table (at 1M rows x 64 that is
    512 MB a table on top of the table's 256 MB); elementwise Adagrad keeps
    one. Row-wise Adagrad keeps one float per row: the running sum of the
    row's mean squared gradient, ``a_r += mean_d(g_rd^2)``, and steps the row
    by ``lr * g_r / (sqrt(a_r) + epsilon)``. A row's coordinates share their
    adaptive rate, which loses little for embeddings, whose coordinates have no
    separate meaning (FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` for large tables; DLRM's
    ``rwsadagrad``). A sparse gradient touches only its rows, as ``LazyAdam`` does.

    Tables are the rank-2 variables named ``embeddings`` (Keras ``Embedding``
    and the towers' hashed-text layer); every other variable gets elementwise
    Adagrad.
    """

    # initial_accumulator_value 0, as FBGEMM's: a row's first step is then lr in size whatever the
    # gradient's scale (as Adam's is). Keras Adagrad's 0.1 dwarfs the squared gradients of a mean
    # loss over a batch of 1024 (~1e-6), and training crawled (at lr 0.05, valid recall@20 0.056
    # against lazy Adam's 0.134 after an epoch of the 2M-click scale log).
    def __init__(self, learning_rate=0.02, initial_accumulator_value=0.0, epsilon=1e-7, name="RowWiseAdagrad",
                 **kwargs):
        # weight_decay=None, as tf-keras' own optimizers pass it: the base class defaults to 0, which
        # still runs a dense `variable -= 0 * variable` over every table at every step.
        super().__init__(name=name, weight_decay=kwargs.pop("weight_decay", None), **kwargs)
        self._learning_rate = self._build_learning_rate(learning_rate)
        self.initial_accumulator_value, self.epsilon = float(initial_accumulator_value), float(epsilon)

    @staticmethod
    def is_table(variable) -> bool:
        """Whether ``variable`` gets one accumulator per row."""
        return variable.shape.rank == 2 and variable.name.split("/")[-1].startswith("embeddings")

    def build(self, var_list):
        super().build(var_list)
        if getattr(self, "_built", False):
            return
        self._built = True
        self._accumulators = []
        for variable in var_list:
            shape = (variable.shape[0], 1) if self.is_table(variable) else variable.shape
            self._accumulators.append(self.add_variable_from_reference(
                variable, "accumulator", initial_value=tf.fill(shape, tf.constant(self.initial_accumulator_value,
                                                                                  variable.dtype)),
            ))

    def update_step(self, gradient, variable):
        lr = tf.cast(self.learning_rate, variable.dtype)
        accumulator = self._accumulators[self._index_dict[self._var_key(variable)]]
        row_wise = self.is_table(variable)

        def squares(values):  # what the accumulator adds: per row for a table, else per weight
            return tf.reduce_mean(tf.square(values), axis=1, keepdims=True) if row_wise else tf.square(values)

        if isinstance(gradient, tf.IndexedSlices):  # rows deduplicated by the base optimizer
            rows, values = gradient.indices, gradient.values
            updated = tf.gather(accumulator, rows) + squares(values)
            accumulator.scatter_update(tf.IndexedSlices(updated, rows))
            variable.scatter_sub(tf.IndexedSlices(lr * values / (tf.sqrt(updated) + self.epsilon), rows))
            return
        accumulator.assign_add(squares(gradient))
        variable.assign_sub(lr * gradient / (tf.sqrt(accumulator) + self.epsilon))

    def get_config(self):
        return {**super().get_config(), "learning_rate": self._serialize_hyperparameter(self._learning_rate),
                "initial_accumulator_value": self.initial_accumulator_value, "epsilon": self.epsilon}


# Which apply sparse (IndexedSlices) gradients of embedding tables sparsely, i.e. at a cost that
# does not grow with the number of rows: adagrad, lazy_adam and rowwise_adagrad do; adam decays
# both moments of every row at every step, and tf-keras sgd always keeps a momentum slot that it scales and adds
# to the whole table (even with momentum 0).
OPTIMIZERS = {
    "adam": tf.keras.optimizers.Adam,
    "adagrad": tf.keras.optimizers.Adagrad,
    "sgd": tf.keras.optimizers.SGD,
    "lazy_adam": LazyAdam,
    "rowwise_adagrad": RowWiseAdagrad,
}


def make_optimizer(config: TrainConfig) -> tf.keras.optimizers.Optimizer:
    """A new optimizer of ``config.optimizer`` at ``config.learning_rate`` (Adam's: ``config.adam_epsilon``)."""
    if config.optimizer in ("adam", "lazy_adam"):
        return OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate, epsilon=config.adam_epsilon)
    return OPTIMIZERS[config.optimizer](learning_rate=config.learning_rate)
