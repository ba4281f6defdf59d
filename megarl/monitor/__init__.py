"""Run monitoring: resource sampling, W&B logging, progress lines, end-of-run curves."""
