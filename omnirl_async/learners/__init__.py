"""Learner workers, the learner group and weight publishing."""
