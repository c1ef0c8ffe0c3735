"""Foundations every stage may use: errors, native log filtering, progress, arrays, replicas, lock, atomic writes.

Empty on purpose: ``import retrieval`` imports ``retrieval.common.native_logs`` first of all, so this
package must import nothing (no numpy, no TensorFlow); import the module you need.
"""
