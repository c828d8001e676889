"""Code that runs on every training node under torchrun."""
