"""Rollout workers and the prompt dispatcher."""
