"""Compiled CPU kernels (Cython + OpenMP). Import through ``fastattn.backends.cpu``."""
