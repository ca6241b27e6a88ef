"""Tests of the lossy modes (judge verification, step routing) and of lossless staying untouched."""
