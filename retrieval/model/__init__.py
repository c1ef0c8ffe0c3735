"""The model: the config's names mapped to its parts (``parts``), and the two-tower model wiring them (``two_tower``).

``parts`` maps config names to samplers, log-Q sources, losses and the hard-negative miner (and
derives the temperature); ``two_tower.TwoTowerModel`` wires them to the towers; ``build_model``
builds it from the config.
"""

from retrieval.model.two_tower import TwoTowerModel, build_model, tower_inputs

__all__ = ["TwoTowerModel", "build_model", "tower_inputs"]
