"""Evaluation: math accuracy and pass@k, RULER-style needle-in-a-haystack, plots.

Modules import their heavy dependencies (math-verify, transformers, matplotlib) lazily so that
`sparse-rl --help` stays fast.
"""
