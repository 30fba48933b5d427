"""Evaluation: eval sets, prompts rendered as training rendered them, Ray Data scoring, results."""
