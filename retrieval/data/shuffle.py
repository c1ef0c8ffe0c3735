"""One epoch order for every click source: clicks sorted by a seeded hash of their content.

A click frame in memory (``retrieval.training.FrameClicks``) and shards
streamed through a bounded buffer (``streaming.train_batches``) see their
rows in different orders (frame order; shard order permuted, shards
interleaved). To train on the same batches they must not order rows by
*position* (``rng.permutation`` of a buffer, ``stateless_shuffle`` of a
frame) but by a function of what a row *is*: ``click_keys`` hashes each
click's user, item, weight and timestamp (every click column a tower can
read), and ``epoch_order`` sorts the keys mixed with ``(seed, epoch)``.
Sorting a subset by the same keys keeps its rows' relative order, so a
stream whose buffer holds the whole training part yields exactly the
frame's batches, and a smaller buffer yields the frame's order within each
buffer (a bounded approximation of it).

Copies of one click (the same user, item, weight and timestamp; common in a
log without timestamps) would share a key and always sit side by side, in
one batch every epoch. Each copy's key therefore also holds its rank among
the copies in the rows hashed together: the keys of a set of rows depend
only on the multiset of the rows, whatever order they come in, and copies
are interchangeable, so which copy gets which rank does not matter.

Keys are 8 bytes a click; hashing a million clicks takes about 0.1 s and
each epoch's order is one ``argsort`` (a couple of seconds at 20M clicks).
Two different clicks share a 64-bit key with probability about
``n^2 / 2^65`` (1e-5 at 20M clicks); they then keep their input order, which
only the frame-vs-stream identity could notice.

Importing this module does not import TensorFlow, like the rest of ``retrieval.data``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["click_keys", "epoch_order"]

# splitmix64 (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators"):
# its finaliser spreads every input bit over the 64 output bits.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 of ``values`` (uint64 [n]), wrapping modulo 2^64."""
    with np.errstate(over="ignore"):  # in place: one temporary of [n] at a time
        z = values.astype(np.uint64) + _GOLDEN
        z ^= z >> np.uint64(30)
        z *= _MUL1
        z ^= z >> np.uint64(27)
        z *= _MUL2
        z ^= z >> np.uint64(31)
        return z


_RANK0 = _mix(np.zeros(1, np.uint64))[0]  # the rank term of a click's first copy


def _hash_ids(ids: np.ndarray) -> np.ndarray:
    """A stable 64-bit hash (SipHash, ``pd.util.hash_array``) of each id string: uint64 [n]."""
    ids = np.asarray(ids)
    if ids.dtype != object:  # numpy str or numbers: hashed as the strings the sources hold
        ids = ids.astype(str).astype(object)
    # Not factorised first (categorize=False): factorising costs more than hashing every string.
    return pd.util.hash_array(ids, categorize=False)


def click_keys(
    users: np.ndarray, items: np.ndarray, weights: np.ndarray, timestamps: np.ndarray | None = None
) -> np.ndarray:
    """The sort keys of clicks: a hash of each click's content and its rank among its copies.

    Args:
      users, items: [n] ids, object str as both sources hold them (other dtypes are
        converted with ``str``).
      weights: [n] click weights, hashed as float32 bits.
      timestamps: [n] int64 seconds, or None when the log has none. Pass them
        whenever the log has them: a tower may read them, and two clicks that
        differ only in time must not be taken for copies.

    Returns:
      uint64 [n]. Equal rows get distinct keys (their copy rank differs); the
      keys of any reordering of the rows are the same set, each on an equal row.
    """
    n = len(users)
    if len(items) != n or len(weights) != n or (timestamps is not None and len(timestamps) != n):
        raise ValueError(
            f"users, items, weights and timestamps must have one length, got {n}, {len(items)}, {len(weights)}, "
            f"{None if timestamps is None else len(timestamps)}"
        )
    content = _mix(_hash_ids(users))
    content = _mix(content ^ _hash_ids(items))
    content = _mix(content ^ np.asarray(weights, np.float32).view(np.uint32).astype(np.uint64))
    if timestamps is not None:
        content = _mix(content ^ np.asarray(timestamps).astype(np.int64).view(np.uint64))
    # Rank of each row among the rows of equal content (0 for a click without copies).
    copies = pd.Series(content).duplicated().to_numpy()
    if not copies.any():  # the usual case with timestamps: every rank is 0
        return _mix(content ^ _RANK0)
    rank = pd.Series(content).groupby(content, sort=False).cumcount().to_numpy(np.uint64)
    return _mix(content ^ _mix(rank))


def epoch_order(keys: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch ``epoch`` visits the clicks of ``keys``: int64 [n], a permutation.

    Row ``i`` comes before row ``j`` when ``mix(keys[i] ^ salt) < mix(keys[j] ^ salt)``,
    ``salt`` a hash of ``(seed, epoch)``: a pure function of the keys, the seed and the epoch,
    so any subset of the rows, in any input order, comes out in the same relative order.

    Args:
      keys: uint64 [n], from ``click_keys``.
      seed, epoch: non-negative integers (a seed < 2^32, as the config allows).
    """
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got {seed}, {epoch}")
    salt = _mix(_mix(np.array([seed], np.uint64)) ^ np.array([epoch], np.uint64))[0]
    return np.argsort(_mix(np.asarray(keys, np.uint64) ^ salt), kind="stable").astype(np.int64)
