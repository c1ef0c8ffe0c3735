"""The serving bundle: one home for its format.

A bundle (``artifacts/<run>/``) is a directory of parts and a ``manifest.json`` that describes
them, written last (layout: docs/operations.md, generated from the parts by ``layout``):

- ``manifest``: the typed manifest (``Manifest``: unknown keys refused, naming them; older format
  versions brought to the current shape in one function, ``migrate``), read first by everything
  that opens a bundle;
- ``parts``: each part (the SavedModels, the index, seen items, user histories, user features,
  display item features) one class with ``write``, ``read``, ``info`` and ``fingerprint``, and
  its place in the layout;
- ``writer``: the one writer: ``write_bundle`` for a new bundle (the job, the tests and
  benchmarks), ``rewrite_bundle`` for a copy with a rebuilt index (re-indexing, the serving
  benchmarks); a caller cannot set a key the writer derives from the parts (``files``,
  ``format_version``, ...);
- ``fingerprints``: the size and hash of every served file, checked at load;
- ``saved_models``: the towers' serving signatures and TensorFlow Serving's layout;
- ``run_directory``: the scratch directory renamed into place under a locked name;
- ``seen_items``, ``user_histories``, ``user_features``, ``display_features``: the tables the
  parts hold.

Importing this package does nothing: import the module you need.
"""
