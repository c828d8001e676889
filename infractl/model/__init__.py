"""The trained model: one file of its weights from a committed checkpoint (``export``), and text
sampled from them (``sample``)."""
