"""``monokernel bench``: the engines side by side on one model shape, in one run."""
