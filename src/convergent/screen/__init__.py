"""Screening and active learning with the surrogate."""

