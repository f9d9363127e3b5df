"""omnirl-async: asynchronous actor-learner RL fine-tuning of flow-matching and omni models on Ray."""

__version__ = "0.1.0"
