"""Evaluation: calibration and evaluation texts, llama-perplexity-style scoring, paired comparisons."""
