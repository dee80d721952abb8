"""Helpers shared by the tests: reference models, kinds, devices, the small world-model session."""
