"""Instances of a model and the states they move through."""
