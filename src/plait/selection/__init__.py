"""Choosing an algorithm per call."""
