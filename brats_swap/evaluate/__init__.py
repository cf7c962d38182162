"""Evaluation: cube and sliding-window inference, mapping back to the original grid, BraTS metrics."""
