"""The serving bundle: one home for its format.

A bundle (``artifacts/<run>/``) is a directory of parts and a ``manifest.json`` that describes
them, written last (layout: docs/operations.md, "The run directory"):

- ``manifest``: reading and writing manifest.json, its format versions;
- ``writer``: ``write_bundle``, the towers, index and parts, then the manifest;
- ``fingerprints``: the size and hash of every served file, checked at load;
- ``saved_models``: the towers' serving signatures and TensorFlow Serving's layout;
- ``run_directory``: the scratch directory renamed into place under a locked name;
- ``seen_items``, ``user_histories``, ``user_features``, ``display_features``: the tables a
  bundle ships for serving.

Importing this package does nothing: import the module you need.
"""
