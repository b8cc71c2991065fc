"""Layers of my own, a package next to the model file."""
