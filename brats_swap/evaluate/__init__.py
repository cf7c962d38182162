"""Evaluation: trained folds and any tool's predictions scored with the BraTS metrics, prediction of new cases."""
