"""Baseline memory-scheduling policies run in the same simulator as TENSILE: vDNN-conv and Capuchin."""
