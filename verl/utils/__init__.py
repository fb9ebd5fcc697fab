"""Leaf utilities: registries, masked tensor helpers, metric names. Imports nothing above it."""
