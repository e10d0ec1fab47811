"""Optimizers over paramplane.nn parameters."""
