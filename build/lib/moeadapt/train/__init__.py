"""Trainer loop, checkpoints, metrics."""
