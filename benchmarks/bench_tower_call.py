"""Eager call time of an ID tower over a large vocabulary: the ``StringLookup`` vocabulary as a list
(tf-keras tracks it as a ``ListWrapper`` and walks it on every eager call) against the object array
the towers now pass (``retrieval.towers.id.lookup_vocabulary``), and a ``tf.function`` call beside them.

    python -m benchmarks.bench_tower_call            # 1M ids, ~1 min on 2 cores

Writes ``benchmarks/results/bench_tower_call.{json,md}``.
"""

from __future__ import annotations

import argparse

import retrieval  # noqa: F401  (TF_USE_LEGACY_KERAS and TF_ENABLE_ONEDNN_OPTS before TensorFlow is imported)

# isort: split
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks._harness import (  # noqa: E402
    RESULTS,
    command,
    load_average,
    machine,
    markdown_table,
    timed,  # noqa: E402
    write_report,
)
from retrieval.towers.id import lookup_vocabulary  # noqa: E402


def tower(vocabulary, dim: int) -> tf.keras.Model:
    ids = tf.keras.Input(shape=(), dtype=tf.string, name="item_id")
    lookup = tf.keras.layers.StringLookup(vocabulary=vocabulary, mask_token=None, num_oov_indices=1)
    return tf.keras.Model({"item_id": ids}, tf.keras.layers.Embedding(len(vocabulary) + 1, dim)(lookup(ids)))


def seconds_per_call(call, batch, repeats: int) -> float:
    call(batch)  # warm-up (and the trace of a tf.function)
    with timed() as clock:
        for _ in range(repeats):
            call(batch)
    return clock.seconds / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "bench_tower_call"))
    args = parser.parse_args()
    ids = [f"i{i}" for i in range(args.ids)]
    batch = {"item_id": tf.constant(np.asarray(ids[: args.batch], dtype=object))}
    rows = []
    for name, vocabulary in [("list", ids), ("object array (lookup_vocabulary)", lookup_vocabulary(ids))]:
        model = tower(vocabulary, 64)
        rows.append({"vocabulary": name, "call": "eager",
                     "seconds": seconds_per_call(lambda x, m=model: m(x, training=False), batch, args.repeats)})
        graph = tf.function(lambda x, m=model: m(x, training=False))
        rows.append({"vocabulary": name, "call": "tf.function",
                     "seconds": seconds_per_call(graph, batch, args.repeats)})
    report = {"command": command("bench_tower_call"), "ids": args.ids, "batch": args.batch,
              "repeats": args.repeats, "rows": rows, "load_average_end": load_average(),
              "machine": machine("tensorflow")}
    write_report(args.out, report, markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "# Eager call of an ID tower over a large vocabulary",
        "",
        f"`{report['command']}`: {report['ids']:,} ids, batches of {report['batch']:,}, mean of {report['repeats']} "
        f"calls after a warm-up, {report['machine']['cpus']} CPUs, load average {report['load_average_end'][0]:.1f} "
        "at the end.",
        "",
        *markdown_table(["StringLookup vocabulary", "call", "ms per call"],
                        [[r["vocabulary"], r["call"], f"{r['seconds'] * 1000:.1f}"] for r in report["rows"]],
                        align="llr"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
